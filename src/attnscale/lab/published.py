"""The published run: a committed summary of a report's verdicts, and the README table made from it.

``results/published.json`` is :func:`summarize` of the ``results.json`` of ``attnscale report``
(profile ``default``, seed 0); ``results/quick.json`` the same for ``--profile quick``, the snapshot
that a fresh quick report is compared with (:func:`compare`). A summary keeps what a reader checks
a verdict against: profile, seed, the commit that ran, and per claim the verdict, its reason, each
arm's verdict, the key number and the version and fingerprint of the rule that judged; the
measured data stay in the report's ``results.json``.

The README's verdict table is :func:`readme_table` of ``results/published.json``, between the
markers :data:`BEGIN` and :data:`END`; a test fails when the two disagree. Commands::

    python -m attnscale.lab.published summarize attnscale-report/results.json results/published.json
    python -m attnscale.lab.published readme results/published.json README.md
    python -m attnscale.lab.published compare results/quick.json attnscale-report-quick/results.json
    python -m attnscale.lab.published rejudge results/full_real_text_training.json

``rejudge`` judges the measurements a file records (a report's results.json, or a committed run
that keeps its claim's ``measured``) by the rules of the code that runs it, where a rule changed
since the run but the measurement did not: the same runs, the current verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import schema
from .formatting import headline_text, short_arm_name, short_reason

__all__ = ["BEGIN", "END", "compare", "main", "readme_table", "rejudge", "replace_table", "summarize"]

BEGIN = "<!-- verdict table: python -m attnscale.lab.published readme results/published.json README.md -->"
END = "<!-- end of verdict table -->"

_CLAIM_KEYS = ("id", "verdict", "reason", "arms", "headline", "rule_version", "rule_fingerprint")


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The summary of a report's results.json data (see the module docstring)."""
    env = results["environment"]
    return {
        "profile": results["profile"],
        "seed": results["seed"],
        "commit": env.get("commit"),
        "created": results["created"],
        "attnscale_version": results["attnscale_version"],
        "seconds": results["seconds"],
        "environment": {k: env[k] for k in ("python", "torch", "cpu", "cpu_count", "jobs", "threads") if k in env},
        "claims": [{k: rec[k] for k in _CLAIM_KEYS} for rec in results["claims"]],
    }


def _verdict_cell(claim: dict[str, Any]) -> str:
    text = f"**{claim['verdict']}**"
    if claim["arms"]:
        text += " (" + "; ".join(f"{short_arm_name(a['name'])}: {a['verdict']}" for a in claim["arms"]) + ")"
    return text


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _cpu(environment: dict[str, Any]) -> str:
    """The CPU a run was measured on, as its environment recorded it."""
    cpu = environment.get("cpu") or "an unrecorded CPU"
    return cpu if cpu.startswith("an ") else f"an {cpu}" if cpu[:1].upper() in "AEIOU" else f"a {cpu}"


def readme_table(summary: dict[str, Any]) -> str:
    """The README's verdict table: one row per claim, what was measured in plain words, its key number."""
    commit = summary["commit"] or "an unrecorded commit"
    lines = [
        BEGIN,
        "",
        f"Profile `{summary['profile']}`, seed {summary['seed']}, commit `{commit}`, "
        f"{summary['seconds'] / 60:.1f} min on {summary['environment'].get('cpu_count', '?')} CPUs of "
        f"{_cpu(summary['environment'])} (`results/published.json`):",
        "",
        "| claim | verdict | what was measured | key number | rule |",
        "|---|---|---|---|---|",
    ]
    for c in summary["claims"]:
        rule = f"v{c['rule_version']}" if c["rule_version"] is not None else "unversioned"
        cells = [
            f"[{c['id']}](docs/claims.md#{c['id']})",
            _verdict_cell(c),
            short_reason(c["reason"]),
            headline_text(c),
            rule,
        ]
        lines.append("| " + " | ".join(_escape(cell) for cell in cells) + " |")
    return "\n".join([*lines, "", END])


def replace_table(text: str, table: str) -> str:
    """``text`` with the block between :data:`BEGIN` and :data:`END` replaced by ``table``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README: expected one verdict table between {BEGIN!r} and {END!r}, found none")
    return text[:start] + table + text[end + len(END) :]


def compare(snapshot: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """How the verdicts of ``results`` (a summary or results.json data) depart from ``snapshot``'s,
    one line per claim and arm; ``[]`` when every verdict is the same."""
    lines = []
    if snapshot["profile"] != results["profile"] or snapshot["seed"] != results["seed"]:
        lines.append(
            f"profile/seed: snapshot {snapshot['profile']}/{snapshot['seed']}, "
            f"results {results['profile']}/{results['seed']}"
        )
    now = {c["id"]: c for c in results["claims"]}
    for old in snapshot["claims"]:
        new = now.get(old["id"])
        if new is None:
            lines.append(f"{old['id']}: in the snapshot, not in the results")
            continue
        if new["verdict"] != old["verdict"]:
            lines.append(f"{old['id']}: {old['verdict']} -> {new['verdict']}: {new['reason']}")
        arms = {a["name"]: a["verdict"] for a in new["arms"]}
        for arm in old["arms"]:
            if arms.get(arm["name"]) != arm["verdict"]:
                lines.append(f"{old['id']}, {arm['name']}: {arm['verdict']} -> {arms.get(arm['name'])}")
    lines += [f"{cid}: not in the snapshot" for cid in now if cid not in {c["id"] for c in snapshot["claims"]}]
    return lines


def rejudge(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each claim of ``results`` that records its measurement, judged by the current rule: its id,
    the rule version that judged it then and its verdict, the current rule version, verdict, reason
    and arms. Claims without a recorded measurement, or whose experiment is not in the lab, are
    refused with a ValueError that names them."""
    from .registry import discover  # (the lab's experiments: imported only by this command)

    experiments = discover().by_id()
    found = []
    for claim in results.get("claims", []):
        cid = claim.get("id")
        if cid not in experiments:
            raise ValueError(f"claim {cid!r}: expected a claim of the lab ({', '.join(experiments)}), got one it does not have")
        if not isinstance(claim.get("measured"), dict):
            raise ValueError(f"claim {cid!r}: expected its recorded measurement ('measured'), got none; only a run that keeps it can be judged again")
        exp = experiments[cid]
        judgement = exp.module.judge(claim["measured"])
        found.append({
            "id": cid, "then": {"rule_version": claim.get("rule_version"), "verdict": claim.get("verdict")},
            "rule_version": exp.claim.rule_history[-1].version, "verdict": judgement.verdict.value, "reason": judgement.reason,
            "arms": [{"name": a.name, "verdict": a.verdict.value, "reason": a.reason} for a in judgement.arms],
        })  # fmt: skip
    if not found:
        raise ValueError("results: expected at least one claim with its recorded measurement, got none")
    return found


def _read(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: expected a JSON file written by attnscale, got {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a JSON object written by attnscale, got a {type(data).__name__}")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    """``summarize RESULTS OUT``, ``readme SUMMARY README``, ``compare SNAPSHOT RESULTS`` (exit 1 on a
    change) or ``rejudge RESULTS``."""
    parser = argparse.ArgumentParser(prog="python -m attnscale.lab.published", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summarize", help="write the summary of a report's results.json")
    p.add_argument("results")
    p.add_argument("out")
    p = sub.add_parser("readme", help="render the README's verdict table from a summary")
    p.add_argument("summary")
    p.add_argument("readme")
    p = sub.add_parser("compare", help="compare a report's verdicts with a snapshot; exit 1 if any differs")
    p.add_argument("snapshot")
    p.add_argument("results")
    p = sub.add_parser("rejudge", help="judge the measurements a results file records by the current rules (the same runs)")
    p.add_argument("results")
    args = parser.parse_args(argv)
    if args.command == "summarize":
        Path(args.out).write_text(schema.dumps(summarize(_read(args.results))), encoding="utf-8")
        return 0
    if args.command == "readme":
        readme = Path(args.readme)
        readme.write_text(replace_table(readme.read_text(encoding="utf-8"), readme_table(_read(args.summary))), encoding="utf-8")
        return 0
    if args.command == "rejudge":
        try:
            claims = rejudge(_read(args.results))
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:  # a file not laid out as attnscale writes it
            raise SystemExit(f"{args.results}: expected a results file written by attnscale; {type(exc).__name__}: {exc}") from None
        for c in claims:
            print(f"{c['id']}: v{c['then']['rule_version']} judged {c['then']['verdict']}; v{c['rule_version']} judges {c['verdict']} ({c['reason']})")
            for arm in c["arms"]:
                print(f"  {arm['name']}: {arm['verdict']} ({arm['reason']})")
        return 0
    changes = compare(_read(args.snapshot), _read(args.results))
    for line in changes:
        print(line)
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main())
