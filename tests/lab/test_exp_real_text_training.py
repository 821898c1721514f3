"""real-text-training: the rule through the experiment's judge on synthetic sweeps (every verdict,
per condition and for the claim), and the tiny profile run end to end (JSON, determinism, figures,
captions)."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics

import pytest
import torch

from attnscale.lab.base import Verdict, no_progress
from attnscale.lab.experiments import real_text_training as exp

RATES = ("0.0003162", "0.001", "0.003162", "0.01", "0.03162")
L0 = 4.3


def _arm(best, *, noise=0.004, seeds=5, diverge_from=None):
    """An arm as ``combine`` records it: a V in log rate, lowest (``best``) at the middle rate."""
    runs = {}
    for i, lr in enumerate(RATES):
        runs[lr] = [
            {"final": L0 if diverge_from is not None and i >= diverge_from else best + 0.3 * abs(i - 2) + noise * (s - (seeds - 1) / 2),
             "init": L0, "max_logit": 10.0 * (i + 1), "min_entropy": 1.0, "diverged_at": None}
            for s in range(seeds)
        ]  # fmt: skip
    return {"runs": runs}


def _measured(**conditions):
    """``conditions``: name -> (scaled arm, unscaled arm)."""
    return {
        "config": dataclasses.asdict(exp.Config.for_profile("default")),
        "conditions": {name: {"init": "nanogpt", "dk": 32, "arms": {"scaled": s, "unscaled": u}} for name, (s, u) in conditions.items()},
        "headline": None,
    }


@pytest.mark.parametrize(
    ("unscaled", "verdict"),
    [
        (_arm(1.9), Verdict.HOLDS),
        (_arm(1.6), Verdict.HOLDS),
        (_arm(1.5, diverge_from=3), Verdict.HOLDS),
        (_arm(1.5), Verdict.DOES_NOT_HOLD),
        (_arm(1.55, noise=0.2), Verdict.INCONCLUSIVE),
    ],
    ids=["stalls", "costs", "narrows", "no effect", "within noise"],
)
def test_each_condition_is_judged_by_the_rule(unscaled, verdict):
    judgement = exp.judge(_measured(a=(_arm(1.5), unscaled)))
    assert judgement.verdict is verdict and [a.verdict for a in judgement.arms] == [verdict]


def test_the_claim_gets_the_least_supportive_conclusive_condition():
    judgement = exp.judge(_measured(a=(_arm(1.5), _arm(1.9)), b=(_arm(1.5), _arm(1.5)), c=(_arm(1.5), _arm(1.55, noise=0.2))))
    assert [a.verdict for a in judgement.arms] == [Verdict.HOLDS, Verdict.DOES_NOT_HOLD, Verdict.INCONCLUSIVE]
    assert judgement.verdict is Verdict.DOES_NOT_HOLD


def test_the_tiny_profile_runs_end_to_end(tmp_path):
    config = exp.Config.for_profile("tiny")
    measured = exp.run(config, 0, no_progress)
    again = exp.combine(config, 0, {p: exp.run_part(config, 0, p, no_progress) for p in exp.parts(config)})
    assert json.loads(json.dumps(measured)) == json.loads(json.dumps(again))  # deterministic, JSON-able
    condition = measured["conditions"]["d_k 64, PyTorch's default init"]
    assert set(condition["arms"]) == {"scaled", "unscaled"}
    for arm in condition["arms"].values():
        assert len(arm["runs"]) == 3 and all(len(runs) == config.seeds for runs in arm["runs"].values())
        assert arm["summary"]["seeds"] == config.seeds
    judgement = exp.judge(measured)
    assert [a.name for a in judgement.arms] == ["d_k 64, PyTorch's default init"] and judgement.arms[0].reason
    with_, without = (condition["arms"][a]["summary"]["best"]["centre"] for a in exp.JUDGED)
    assert measured["headline"]["centre"] == without - with_  # the headline condition's
    names = exp.plot(measured, tmp_path)
    assert set(names) == set(exp.captions(measured))
    for name in names:
        assert (tmp_path / f"{name}.svg").is_file() and (tmp_path / f"{name}.png").is_file()


def test_v6s_reason_is_what_its_pilot_measured():
    """v6 chose default's length and seed count from a pilot on model seeds no report trains: the
    numbers its reason cites, judged by the rule from results/real_text_pilot.json."""
    import itertools
    from pathlib import Path

    from attnscale.lab.lr_sweep import GRID, Effect, compare, summarise

    pilot = json.loads((Path(__file__).resolve().parents[2] / "results" / "real_text_pilot.json").read_text(encoding="utf-8"))
    runs = pilot["runs"]
    assert {r["seed"] for r in runs} == set(range(9000, 9006)) and {r["lr"] for r in runs} == set(GRID[2:7])
    assert all(r["seed"] // exp.SEED_STRIDE > 2 for r in runs)  # no model of the reports at seeds 0, 1, 2

    def judged(steps, seeds):
        def curve(arm):  # as combine records an arm: every rate's runs, each with its final and initial loss
            rs = [r for r in runs if (r["steps"], r["arm"]) == (steps, arm) and r["seed"] in seeds]
            c = exp._curve({"runs": {f"{lr:g}": [{"final": r["final"], "init": r["val_loss"][0]} for r in rs if r["lr"] == lr] for lr in GRID[2:7]}})
            s = summarise(c)
            return dataclasses.replace(s, best_losses=tuple(c.capped(s.best_lr)))  # v6's pairing: each seed at the median curve's best rate

        return compare(curve("scaled"), curve("unscaled"))

    seeds = range(9000, 9006)
    (why,) = [v.why for v in exp.CLAIM.rule_history if v.version == 6]
    effect, reason = judged(550, seeds)
    assert effect is Effect.STALLS and "0.357 +- 0.029 nats apart" in reason and "0.357 +- 0.029" in why
    subsets = [judged(550, sub)[0] for sub in itertools.combinations(seeds, 5)]
    assert subsets == [Effect.STALLS] * 6
    effect, reason = judged(700, seeds)
    assert effect is Effect.COSTS and "0.319 +- 0.1 nats apart" in reason and "0.319 +- 0.1 nats" in why
    assert [judged(700, sub)[0] for sub in itertools.combinations(seeds, 5)].count(Effect.INCONCLUSIVE) == 5
    escaped = [r["final"] for r in runs if (r["steps"], r["arm"], r["lr"]) == (700, "unscaled", GRID[5])]
    assert f"{min(escaped):.3f} to {max(escaped):.3f} nats at lr {GRID[5]:g}" in why
    default = exp.Config.for_profile("default")
    assert (default.steps, default.warmup, default.eval_every, default.seeds, default.rates) == (550, 55, 275, 5, GRID[2:7])


def test_the_pilot_trains_defaults_condition_as_the_report_does():
    """A pilot run (in its own process) is the report's run of default's condition at that length:
    the same model, batches and losses as train_lm in this process."""
    from attnscale.lab.gpt import GPTConfig, LMTrainConfig, train_lm
    from attnscale.lab.shakespeare import load

    got = exp.pilot([6], [1e-2], 1, jobs=1)
    assert [(r["steps"], r["arm"], r["lr"], r["seed"]) for r in got] == [(6, arm, 1e-2, 9000) for arm in exp.JUDGED]
    corpus = load()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the pilot's processes (and the report's job slots) run
    try:
        for r in got:
            model = GPTConfig(vocab=len(corpus.vocab), layers=2, width=64, heads=1, context=64, arm=r["arm"], init="torch")
            run = train_lm(model, LMTrainConfig(steps=6, batch=12, lr=1e-2, warmup=0, eval_every=3, eval_batches=8, seed=9000), corpus)
            assert r["val_loss"] == run.val_loss and r["final"] == run.final_loss
    finally:
        torch.set_num_threads(threads)


def test_v7s_reason_is_what_v6s_default_run_measured():
    """v7 flushes subnormals because v6's default report ran past the budget, its parts at high
    rates the slowest: the numbers its reason cites, from results/real_text_v6_seed0.json."""
    from pathlib import Path

    v6 = json.loads((Path(__file__).resolve().parents[2] / "results" / "real_text_v6_seed0.json").read_text(encoding="utf-8"))
    claim = v6["claim"]
    assert (v6["profile"], v6["seed"], claim["rule_version"]) == ("default", 0, 6)
    assert claim["rule_fingerprint"] == next(v.fingerprint for v in exp.CLAIM.rule_history if v.version == 6)
    (why,) = [v.why for v in exp.CLAIM.rule_history if v.version == 7]
    parts = {p["name"]: p["cpu_seconds"] for p in claim["parts"]}
    slow = [parts[f"torch 64 {arm} 0.03162"] for arm in exp.JUDGED]
    fast = [parts[f"torch 64 {arm} 0.001"] for arm in exp.JUDGED]
    assert f"took {v6['seconds'] / 60:.1f} min" in why and v6["seconds"] > 300
    assert f"{slow[0]:.1f} and {slow[1]:.1f} s of CPU against {fast[0]:.1f} and {fast[1]:.1f} at 1e-3" in why
    assert claim["verdict"] == "holds-approximately" and "costs: " in claim["arms"][0]["reason"]
    assert "0.258 +- 0.03 nats apart" in claim["arms"][0]["reason"] and "(costs, 0.258 +- 0.03 nats apart)" in why


def test_training_flushes_subnormals_and_restores_the_callers_mode():
    from attnscale.lab.gpt import subnormals_flushed

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush subnormals (torch.set_flush_denormal is unsupported)")
    tiny = torch.tensor(1e-38)
    with subnormals_flushed():
        assert float(tiny * 0.01) == 0.0
    assert float(tiny * 0.01) > 0.0
    torch.set_flush_denormal(True)
    try:
        with subnormals_flushed():
            pass
        assert float(tiny * 0.01) == 0.0  # the caller's mode, on
    finally:
        torch.set_flush_denormal(False)


def test_v8s_reason_is_what_v7s_three_default_runs_measured():
    """v8 takes a cost as holds because v7's default runs split between stalls and costs with the
    seed: the numbers its reason cites, from results/real_text_v7_seeds.json."""
    from pathlib import Path

    v7 = json.loads((Path(__file__).resolve().parents[2] / "results" / "real_text_v7_seeds.json").read_text(encoding="utf-8"))
    assert [r["seed"] for r in v7["runs"]] == [0, 1, 2] and all(r["commit"] == v7["commit"] for r in v7["runs"])
    (why,) = [v.why for v in exp.CLAIM.rule_history if v.version == 8]
    assert f"at {v7['commit'][:7]}" in why
    effects = []
    for run in v7["runs"]:
        claim = run["claim"]
        assert claim["rule_version"] == 7 and claim["rule_fingerprint"] == next(v.fingerprint for v in exp.CLAIM.rule_history if v.version == 7)
        (arm,) = claim["arms"]
        effect, gap = re.match(r"(\w+): .*?: ([0-9.]+ \+- [0-9.]+) nats apart seed by seed", arm["reason"]).groups()
        effects.append((claim["verdict"], effect))
        assert gap in why
    assert effects == [("holds-approximately", "costs"), ("holds", "stalls"), ("holds-approximately", "costs")]
    assert "seed 0 costs" in why and "seed 1 stalls" in why and "seed 2 costs" in why


def test_v8_at_the_seeds_it_was_written_before_is_what_the_lab_report_says():
    """docs/lab-report.md reports v8 at report seeds 3, 4 and 5, which it was written before:
    each run's gap and verdict, from results/real_text_v8_seeds345.json."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    runs = json.loads((root / "results" / "real_text_v8_seeds345.json").read_text(encoding="utf-8"))["runs"]
    report = " ".join((root / "docs" / "lab-report.md").read_text(encoding="utf-8").split())
    v8 = next(v.fingerprint for v in exp.CLAIM.rule_history if v.version == 8)
    assert [r["seed"] for r in runs] == [3, 4, 5] and all(r["claim"]["rule_fingerprint"] == v8 for r in runs)
    gaps = [re.search(r"([0-9.]+ \+- [0-9.]+) nats apart seed by seed", r["claim"]["arms"][0]["reason"]).group(1) for r in runs]
    assert f"({gaps[0]}, {gaps[1]} and {gaps[2]} nats)" in report
    assert [r["claim"]["verdict"] for r in runs] == ["inconclusive", "holds", "inconclusive"]
    assert "conclusive at seed 4 alone (holds, a cost)" in report
    assert runs[1]["claim"]["arms"][0]["reason"].startswith("costs: ")


def test_v9s_reason_is_what_v8_measured_at_seeds_3_to_5():
    """v9 takes each seed's own best loss because, at report seeds 3 and 5, v8 counted seeds that
    failed at the median curve's best rate as failed: every number its reason cites, from the
    finals recorded in results/real_text_v8_seeds345.json."""
    from pathlib import Path

    recorded = json.loads((Path(__file__).resolve().parents[2] / "results" / "real_text_v8_seeds345.json").read_text(encoding="utf-8"))
    (why,) = [v.why for v in exp.CLAIM.rule_history if v.version == 9]
    runs = {r["seed"]: r for r in recorded["runs"]}
    assert f"at {recorded['commit'][:7]}" in why
    for seed in (3, 5):
        claim = runs[seed]["claim"]
        assert claim["verdict"] == "inconclusive" and "(lr 0.03162): " in claim["arms"][0]["reason"]
        gap = re.search(r"([0-9.]+ \+- [0-9.]+) nats apart seed by seed", claim["arms"][0]["reason"]).group(1)
        assert gap in why
        at_best = sorted(runs[seed]["finals"]["scaled"]["0.03162"])
        assert f"seed {seed}: {at_best[0]:.3f} to {at_best[-2]:.3f}" in why and f"and {at_best[-1]:.3f}" in why
    worst = max(range(5), key=lambda i: runs[3]["finals"]["scaled"]["0.03162"][i])
    assert f"{runs[3]['finals']['scaled']['0.03162'][worst]:.3f} run: {runs[3]['finals']['scaled']['0.01'][worst]:.3f} there" in why
    flat = [statistics.median(runs[s]["finals"]["unscaled"][lr]) for s in (3, 4, 5) for lr in ("0.003162", "0.01", "0.03162")]
    assert all(abs(x - 2.48) < 0.02 for x in flat) and "flat near 2.48 nats from 3.2e-3 to 3.2e-2" in why


def test_each_seeds_best_is_its_own_lowest_loss():
    """v9: a seed that fails at the median curve's best rate counts at its own best rate."""
    from attnscale.lab.lr_sweep import Curve, summarise

    curve = Curve({1e-3: [2.6, 2.6, 2.6], 1e-2: [2.2, 2.2, 2.15], 3e-2: [2.1, 2.1, 2.9], 1e-1: [3.1, 3.1, 3.1]}, init_loss=4.3)
    s = summarise(curve)
    assert s.best_lr == 3e-2 and s.best_losses == (2.1, 2.1, 2.15)


def test_v9_at_report_seeds_3_to_8_is_what_the_lab_report_says():
    """docs/lab-report.md reports v9 at report seeds 6, 7 and 8, which it was written before, and at
    3, 4 and 5, which it was not: each run's verdict and gap, from results/real_text_v9_seeds.json;
    the runs at seeds 3 to 5 train what v8's did (its measurement unchanged), loss for loss."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    recorded = json.loads((root / "results" / "real_text_v9_seeds.json").read_text(encoding="utf-8"))
    v8 = {r["seed"]: r for r in json.loads((root / "results" / "real_text_v8_seeds345.json").read_text(encoding="utf-8"))["runs"]}
    report = " ".join((root / "docs" / "lab-report.md").read_text(encoding="utf-8").split())
    v9 = next(v for v in exp.CLAIM.rule_history if v.version == 9)
    runs = {r["seed"]: r for r in recorded["runs"]}
    assert sorted(runs) == [3, 4, 5, 6, 7, 8] and recorded["written_before"] == [6, 7, 8]
    assert all(r["claim"]["rule_fingerprint"] == v9.fingerprint and r["commit"] == recorded["commit"] for r in runs.values())
    assert "seeds 6, 7 and 8, which do" in v9.why
    for seed in (3, 4, 5):
        assert runs[seed]["finals"] == v8[seed]["finals"]
    said = []
    for seed in range(3, 9):
        claim = runs[seed]["claim"]
        effect, gap = re.match(r"(\w+): .*?: ([0-9.]+ \+- [0-9.]+) nats apart seed by seed", claim["arms"][0]["reason"]).groups()
        said.append(f"{'a stall' if effect == 'stalls' else 'a cost'}, {gap}")
        assert claim["verdict"] == "holds" and effect in ("stalls", "costs")
    assert f"report seeds 6, 7 and 8, which it was written before (`results/real_text_v9_seeds.json`), it holds at each ({said[3]}; {said[4]}; {said[5]} nats)" in report
    assert f"at seeds 3, 4 and 5 it holds too ({said[0]}; {said[1]}; {said[2]} nats)" in report
    published = [json.loads((root / "results" / name).read_text(encoding="utf-8")) for name in ("published.json", "default_seed1.json", "default_seed2.json")]
    claims = [next(c for c in p["claims"] if c["id"] == "real-text-training") for p in published]
    assert [p["seed"] for p in published] == [0, 1, 2] and all(c["rule_version"] == 9 and c["verdict"] == "holds" for c in claims)
    assert "The default profile holds at all nine seeds run under v9" in report
