"""The published run: README's verdict table is rendered from results/published.json, the committed
summaries were judged by the rules as they stand, and a fresh quick run reaches the snapshot's verdicts."""

import json
import re
from pathlib import Path

import pytest
import torch

from attnscale.lab import published, registry
from attnscale.lab.base import no_progress, rule_fingerprint

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = json.loads((ROOT / "results" / "published.json").read_text(encoding="utf-8"))
QUICK = json.loads((ROOT / "results" / "quick.json").read_text(encoding="utf-8"))
EXPERIMENTS = registry.discover().by_id()


def test_the_readme_verdict_table_is_the_published_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = published.readme_table(PUBLISHED)
    assert table in readme, "README's verdict table differs from results/published.json; run: " + published.BEGIN[5:-4]
    assert published.replace_table(readme, table) == readme


@pytest.mark.parametrize(("summary", "profile"), [(PUBLISHED, "default"), (QUICK, "quick")])
def test_the_committed_runs_were_judged_by_the_current_rules(summary, profile):
    assert (summary["profile"], summary["seed"]) == (profile, 0)
    assert re.fullmatch(r"[0-9a-f]{40}", summary["commit"]), "the run must come from a committed, unchanged checkout"
    assert [c["id"] for c in summary["claims"]] == list(EXPERIMENTS)
    for claim in summary["claims"]:
        exp = EXPERIMENTS[claim["id"]]
        assert claim["rule_fingerprint"] == rule_fingerprint(exp.module), (
            f"{claim['id']}: its rule changed since the committed {profile} run; rerun it and the summary"
        )
        assert claim["rule_version"] == exp.claim.rule_history[-1].version


def _same_rules(other: dict) -> tuple[dict, list[str]]:
    """The published verdicts of the claims ``other`` judged by the rule that stands now (their
    version and fingerprint), and the ids of the claims whose rule is newer than ``other``'s run
    (a claim added since that run among them, as version 0 there)."""
    now = {c["id"]: (c["rule_version"], c["rule_fingerprint"]) for c in PUBLISHED["claims"]}
    then = {c["id"]: (c["rule_version"], c["rule_fingerprint"]) for c in other["claims"]}
    assert set(then) <= set(now), f"claims of the other run the lab no longer has: {set(then) - set(now)}"
    then.update({i: (0, "") for i in now if i not in then})
    newer = [i for i in now if then[i] != now[i]]
    for i in newer:  # a rule changes only forward, and the version says so
        assert then[i][0] < now[i][0], f"{i}: v{then[i][0]} in the other run, v{now[i][0]} now"
    return {c["id"]: c["verdict"] for c in PUBLISHED["claims"] if c["id"] not in newer}, newer


def _other_run(name: str) -> dict:
    other = json.loads((ROOT / "results" / name).read_text(encoding="utf-8"))
    assert (other["profile"], other["seed"]) == ("default", 0) and re.fullmatch(r"[0-9a-f]{40}", other["commit"])
    return other


def _newer_text(other: dict, newer: list[str]) -> str:
    then = {c["id"]: c["rule_version"] for c in other["claims"]}
    now = {c["id"]: c["rule_version"] for c in PUBLISHED["claims"]}
    return ", ".join(f"{i} (v{then[i]} there, v{now[i]} now)" if i in then else f"{i} (added since)" for i in newer)


LAB_REPORT = " ".join((ROOT / "docs" / "lab-report.md").read_text(encoding="utf-8").split())


def test_the_default_run_held_to_avx2_code_reached_the_published_verdicts():
    """docs/lab-report.md says the default run reached every published verdict with torch, oneMKL, oneDNN
    and the compiled kernel held to AVX2 code: results/default_avx2_paths.json is that run's summary;
    a claim whose rule changed since that run is named there, and the others must agree."""
    other = _other_run("default_avx2_paths.json")
    verdicts, newer = _same_rules(other)
    assert {c["id"]: c["verdict"] for c in other["claims"] if c["id"] in verdicts} == verdicts
    assert f"at {other['commit'][:7]}; `results/default_avx2_paths.json`) it reaches the same {len(verdicts)} verdicts" in LAB_REPORT
    assert not newer or f"Rules changed since the run at {other['commit'][:7]}: {_newer_text(other, newer)}" in LAB_REPORT


def test_the_default_run_on_another_cpu_model_reached_the_published_verdicts():
    """docs/lab-report.md says the default run on a second CPU model (an AMD EPYC, where the published
    run's is an Intel Xeon with AMX) reached every published verdict judged by the same rules:
    results/default_amd_epyc.json is that run's summary."""
    other = _other_run("default_amd_epyc.json")
    assert "AMD" in other["environment"]["cpu"] and "Intel" in PUBLISHED["environment"]["cpu"]
    verdicts, newer = _same_rules(other)
    assert {c["id"]: c["verdict"] for c in other["claims"] if c["id"] in verdicts} == verdicts
    minutes = other["seconds"] / 60
    assert f"(at {other['commit'][:7]}; `results/default_amd_epyc.json`, {minutes:.1f} min)" in LAB_REPORT
    assert f"reaches the same {len(verdicts)} verdicts" in LAB_REPORT
    assert not newer or f"Rules changed since the run at {other['commit'][:7]}: {_newer_text(other, newer)}" in LAB_REPORT


@pytest.mark.parametrize(
    ("name", "snapshot", "seed"),
    [("default_seed1.json", PUBLISHED, 1), ("default_seed2.json", PUBLISHED, 2), ("quick_seed1.json", QUICK, 1), ("quick_seed2.json", QUICK, 2)],
    ids=["default at seed 1", "default at seed 2", "quick at seed 1", "quick at seed 2"],
)
def test_the_runs_at_seeds_1_and_2_reached_the_seed_0_verdicts(name, snapshot, seed):
    """docs/lab-report.md says the default and quick runs reach every verdict (and every arm's) of seed
    0 at seeds 1 and 2, by the same rules: results/{default,quick}_seed{1,2}.json are those runs."""
    other = json.loads((ROOT / "results" / name).read_text(encoding="utf-8"))
    assert (other["profile"], other["seed"]) == (snapshot["profile"], seed) and re.fullmatch(r"[0-9a-f]{40}", other["commit"])
    rules = [(c["id"], c["rule_version"], c["rule_fingerprint"]) for c in snapshot["claims"]]
    assert [(c["id"], c["rule_version"], c["rule_fingerprint"]) for c in other["claims"]] == rules
    assert {c["id"]: c["verdict"] for c in other["claims"]} == {c["id"]: c["verdict"] for c in snapshot["claims"]}
    changes = published.compare(snapshot, other)
    assert changes[0] == f"profile/seed: snapshot {snapshot['profile']}/0, results {snapshot['profile']}/{seed}"
    for arm in changes[1:]:  # an arm whose verdict moved with the seed is named, with its move, in the docs
        assert f"{arm}` at seed {seed}" in LAB_REPORT or f"{arm}` at seeds 1 and 2" in LAB_REPORT, arm
    assert f"`results/{name}`" in LAB_REPORT


def test_the_full_training_stall_run_reached_the_published_verdict():
    """docs/lab-report.md cites training-stall's full profile: results/full_training_stall.json, judged
    by a version of the rule its history holds (the one that judged the published run, or an
    earlier one that the report names as changed since), reaches the published verdict."""
    full = json.loads((ROOT / "results" / "full_training_stall.json").read_text(encoding="utf-8"))
    assert (full["profile"], full["seed"]) == ("full", 0) and re.fullmatch(r"[0-9a-f]{40}", full["commit"])
    (claim,) = full["claims"]
    (now,) = [c for c in PUBLISHED["claims"] if c["id"] == "training-stall"]
    history = {v.version: v.fingerprint for v in EXPERIMENTS["training-stall"].claim.rule_history}
    assert claim["id"] == now["id"] and history.get(claim["rule_version"]) == claim["rule_fingerprint"]
    if (claim["rule_version"], claim["rule_fingerprint"]) != (now["rule_version"], now["rule_fingerprint"]):
        assert f"Rules changed since the run at {full['commit'][:7]}: training-stall (v{claim['rule_version']} there, v{now['rule_version']} now)" in LAB_REPORT
    assert claim["verdict"] == now["verdict"]
    assert f"at {full['commit'][:7]}; `results/full_training_stall.json`, {full['seconds'] / 60:.1f} min" in LAB_REPORT
    cited = re.findall(r"\d+\.\d+", LAB_REPORT[LAB_REPORT.index(f"training-stall's v{claim['rule_version']} at `full`") :].split("## ")[0])
    assert [n for n in cited if n not in json.dumps(full)] == [f"{full['seconds'] / 60:.1f}"]  # every number but the wall time is the run's


def test_the_full_real_text_run_is_judged_by_the_published_rule_and_the_lab_report_cites_it():
    """docs/lab-report.md cites real-text-training's full profile: results/full_real_text_training.json
    is judged by a version of the rule its history holds (the one that judged the published run,
    or an earlier one that the report names as changed since), and every decimal of its paragraph
    is that run's (the wall time and the commits aside)."""
    full = json.loads((ROOT / "results" / "full_real_text_training.json").read_text(encoding="utf-8"))
    assert (full["profile"], full["seed"]) == ("full", 0) and re.fullmatch(r"[0-9a-f]{40}", full["commit"])
    (claim,) = full["claims"]
    (now,) = [c for c in PUBLISHED["claims"] if c["id"] == "real-text-training"]
    history = {v.version: v.fingerprint for v in EXPERIMENTS["real-text-training"].claim.rule_history}
    assert claim["id"] == now["id"] and history.get(claim["rule_version"]) == claim["rule_fingerprint"]
    if (claim["rule_version"], claim["rule_fingerprint"]) != (now["rule_version"], now["rule_fingerprint"]):
        assert f"Rules changed since the run at {full['commit'][:7]}: real-text-training (v{claim['rule_version']} there, v{now['rule_version']} now)" in LAB_REPORT
    assert f"recorded at {full['commit'][:7]}" in LAB_REPORT and f"`results/full_real_text_training.json`, {full['seconds'] / 60:.1f} min" in LAB_REPORT
    paragraph = _readme_paragraph(f"real-text-training's v{claim['rule_version']} at `full`", "docs/lab-report.md")
    (judged,) = published.rejudge(full)  # the same runs by the current rule, which the paragraph states
    assert judged["verdict"] == claim["verdict"] and judged["rule_version"] == now["rule_version"]
    stall = [a["reason"] for a in judged["arms"] if a["name"] == "d_k 64, PyTorch's default init"][0]
    assert stall.startswith("stalls: ") and re.search(r"([0-9.]+ \+- [0-9.]+) nats apart seed by seed", stall).group(1) in paragraph
    assert f"`python -m attnscale.lab.published rejudge results/full_real_text_training.json`" in paragraph
    assert [a["name"] for a in judged["arms"] if not a["reason"].startswith("inconclusive: ")] == ["d_k 64, PyTorch's default init"]
    cited = re.findall(r"\d+\.\d+", paragraph)
    recorded = {**full, "claims": [{k: v for k, v in c.items() if k != "measured"} for c in full["claims"]]}  # its verdicts, not its raw runs
    assert cited and [n for n in cited if n not in json.dumps([recorded, judged])] == [f"{full['seconds'] / 60:.1f}"]


def test_the_full_census_reached_the_published_rule_and_the_lab_report_cites_it():
    """docs/lab-report.md cites scale-in-the-wild's full profile (every model type): the summary in
    results/full_scale_in_the_wild.json is judged by the current rule, and every number the section
    cites is that run's, the published default run's or the recorded census benchmark's."""
    full = json.loads((ROOT / "results" / "full_scale_in_the_wild.json").read_text(encoding="utf-8"))
    assert (full["profile"], full["seed"]) == ("full", 0) and re.fullmatch(r"[0-9a-f]{40}", full["commit"])
    (claim,) = full["claims"]
    (now,) = [c for c in PUBLISHED["claims"] if c["id"] == "scale-in-the-wild"]
    assert (claim["id"], claim["rule_version"], claim["rule_fingerprint"]) == (now["id"], now["rule_version"], now["rule_fingerprint"])
    assert f"at {full['commit'][:7]}; `results/full_scale_in_the_wild.json`, {full['seconds'] / 60:.1f} min" in LAB_REPORT
    census = json.loads((ROOT / "results" / "census_full.json").read_text(encoding="utf-8"))
    assert census["types_tried"] == census["types_in_transformers"]  # the full profile: every type
    section = LAB_REPORT[LAB_REPORT.index("## The scale census") :].split("## ")[1]
    bench = json.loads((ROOT / "benchmarks" / "recorded" / "census.json").read_text(encoding="utf-8"))
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", json.dumps([full, census, PUBLISHED, bench]))]
    counts = {len(census["census"]), len(census["not_probed"]), len(census["no_attention"]), len(census["census"]) + len(census["not_probed"])}

    def measured(text: str) -> bool:  # a value of either run, to the digits cited, or a count of the census
        digits = len(text.split(".")[1]) if "." in text else 0
        return any(round(v, digits) == float(text) for v in numbers) or (digits == 0 and int(text) in counts)

    section = section.replace(full["commit"][:7], "").replace(f"{full['seconds'] / 60:.1f} min", "")
    cited = re.findall(r"\d+\.\d+|\b\d{2,}\b", section)
    assert cited and [n for n in cited if not measured(n)] == [], "a number the section cites that neither run has"


FAST = (
    "softmax-peak-example", "qknorm-double-shrink", "flash-exp2", "quant-folding", "fp16-secondary", "linear-attention",
    "alibi-order", "rope-variance", "length-scaling", "saturation-example", "jacobian-collapse", "mup-correlated",
    "variance-law", "divisor-table",
)
"""The experiments whose quick profile runs in about a second or two; the five training ones are checked
at their own small sizes in test_training_verdicts.py; scale-in-the-wild (7 s) and all of them by
comparing a fresh quick report: python -m attnscale.lab.published compare results/quick.json OUT/results.json."""


@pytest.mark.parametrize("claim_id", FAST)
def test_a_fresh_quick_run_reaches_the_snapshots_verdict(claim_id):
    exp = EXPERIMENTS[claim_id]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the report runs it
    try:
        judgement = exp.module.judge(exp.module.run(exp.config("quick"), QUICK["seed"], no_progress))
    finally:
        torch.set_num_threads(threads)
    fresh = {**QUICK, "claims": [{"id": claim_id, "verdict": judgement.verdict.value, "reason": judgement.reason,
                                  "arms": [{"name": a.name, "verdict": a.verdict.value} for a in judgement.arms]}]}
    snapshot = {**QUICK, "claims": [c for c in QUICK["claims"] if c["id"] == claim_id]}
    assert published.compare(snapshot, fresh) == []


def _summary(verdicts, profile="quick"):
    claims = [{"id": cid, "verdict": v, "reason": "r", "arms": arms} for cid, v, arms in verdicts]
    return {"profile": profile, "seed": 0, "claims": claims}


def test_compare_names_every_changed_verdict_arm_and_claim():
    arm = [{"name": "AdamW", "verdict": "holds"}]
    old = _summary([("a", "holds", []), ("b", "holds", arm), ("c", "holds", [])])
    new = _summary([("a", "holds", []), ("b", "holds", [{"name": "AdamW", "verdict": "does-not-hold"}]), ("d", "holds", [])])
    assert published.compare(old, old) == []
    assert published.compare(old, new) == [
        "b, AdamW: holds -> does-not-hold",
        "c: in the snapshot, not in the results",
        "d: not in the snapshot",
    ]
    assert published.compare(old, _summary([("a", "does-not-hold", [])], profile="default"))[:2] == [
        "profile/seed: snapshot quick/0, results default/0",
        "a: holds -> does-not-hold: r",
    ]


def test_main_renders_the_table_into_a_readme_and_compare_exits_1_on_a_changed_verdict_0_on_none(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{published.BEGIN}\nold\n{published.END}\n\nrest\n")
    summary = tmp_path / "published.json"
    summary.write_text(json.dumps(PUBLISHED))
    assert published.main(["readme", str(summary), str(readme)]) == 0
    assert readme.read_text() == f"intro\n\n{published.readme_table(PUBLISHED)}\n\nrest\n"
    changed = {**PUBLISHED, "claims": [{**PUBLISHED["claims"][0], "verdict": "does-not-hold"}, *PUBLISHED["claims"][1:]]}
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    assert published.main(["compare", str(summary), str(summary)]) == 0
    assert capsys.readouterr().out == ""
    assert published.main(["compare", str(summary), str(tmp_path / "changed.json")]) == 1
    assert capsys.readouterr().out.startswith(f"{PUBLISHED['claims'][0]['id']}: {PUBLISHED['claims'][0]['verdict']} -> does-not-hold")
    with pytest.raises(ValueError, match="README: expected one verdict table"):
        published.replace_table("no table here", "x")


def _readme_paragraph(starts: str, page: str = "README.md") -> str:
    readme = (ROOT / page).read_text(encoding="utf-8")
    start = readme.index(starts)
    return " ".join(readme[start : readme.index("\n\n", start)].split())


def test_the_readmes_lab_text_cites_only_numbers_of_the_published_run():
    """The lab's opening paragraph quotes the published run: each decimal and each ratio in it is in
    results/published.json (reasons, arms, key numbers) or, for the full profile, which it names,
    results/full_real_text_training.json and results/full_training_stall.json; the wall times are
    the run's `seconds`."""
    text = _readme_paragraph("`d_k` is the **per-head** key dimension")
    full = [json.loads((ROOT / "results" / name).read_text(encoding="utf-8")) for name in ("full_real_text_training.json", "full_training_stall.json")]
    assert "`--profile full`" in text
    published_text = json.dumps([PUBLISHED, *full])
    cited = re.findall(r"\d+\.\d+|\d+(?=x)", text)
    assert cited, "the README's lab paragraph cites no number of the run"
    assert [n for n in cited if n not in published_text] == [], "README's lab paragraph cites numbers not in results/published.json"
    stall = _readme_paragraph("The published run's training-stall numbers", "docs/lab-report.md")
    assert [n for n in re.findall(r"\d+\.\d+|\d+(?=x)", stall) if n not in published_text] == [], "docs/lab-report.md's stall paragraph cites numbers not in results/published.json"
    times = _readme_paragraph("Wall time of these runs", "docs/lab-report.md")
    assert f"`default` {PUBLISHED['seconds'] / 60:.1f} min" in times
    assert f"`--profile quick` (CI's size) {QUICK['seconds'] / 60:.1f} min" in times


def test_rejudge_refuses_what_it_cannot_judge_and_says_why(tmp_path, capsys):
    """rejudge needs each claim's recorded measurement and a claim the lab has: a summary (which
    keeps none), an unknown claim and a file that is no JSON object are each refused by name."""
    with pytest.raises(ValueError, match="variance-law.*recorded measurement"):
        published.rejudge(PUBLISHED)
    with pytest.raises(ValueError, match="'no-such-claim'.*a claim of the lab"):
        published.rejudge({"claims": [{"id": "no-such-claim", "measured": {}}]})
    bad = tmp_path / "list.json"
    bad.write_text("[1]", encoding="utf-8")
    with pytest.raises(SystemExit, match="expected a JSON object"):
        published.main(["rejudge", str(bad)])
    with pytest.raises(SystemExit, match="recorded measurement"):
        published.main(["rejudge", str(ROOT / "results" / "published.json")])
    odd = tmp_path / "odd.json"
    for text in ('{"claims": {"id": 1}}', '{"claims": [{"id": "real-text-training", "measured": {"conditions": 3}}]}'):
        odd.write_text(text, encoding="utf-8")
        with pytest.raises(SystemExit, match="expected a results file written by attnscale"):
            published.main(["rejudge", str(odd)])
