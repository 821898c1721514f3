"""How long each task of a published report took: the start order of a report with no timings of its own.

The runner starts the longest tasks first, so that no long one starts last and leaves the other job
slots idle while it runs (two slots on two cores: a 45-second claim started last adds up to 45 s to
the report). It knows a task's length from the report folder's cache, the last time the task
finished there; a fresh clone has no cache, and falls back on this table: each task's seconds
(a claim, or one part of a claim with parts, named ``claim/part``) in a report's ``results.json``,
per profile. The table orders tasks and nothing else: a stale or missing entry changes which task
starts when, never what one measures (the cache key does not hash this module or its table).

Written from reports run at a clean commit, one per profile::

    python -m attnscale.lab.timings attnscale-report/results.json attnscale-report-quick/results.json

The table is package data (``task_seconds.json`` beside this module), read once per process.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TABLE", "expected", "main", "table", "task_name"]

TABLE = Path(__file__).with_name("task_seconds.json")


def task_name(claim_id: str, part: str | None = None) -> str:
    """The table's name of a claim's task (``claim``), or of one of its parts (``claim/part``)."""
    return claim_id if part is None else f"{claim_id}/{part}"


def table(results: dict[str, Any]) -> dict[str, Any]:
    """One profile's entry from a report's results.json: the run it came from and each task's seconds."""
    seconds: dict[str, float] = {}
    for claim in results["claims"]:
        if claim.get("cached"):
            raise ValueError(f"claim {claim['id']!r} was read from the cache, not timed; run the report with --force")
        parts = claim.get("parts") or []
        for part in parts:
            seconds[task_name(claim["id"], part["name"])] = round(float(part["seconds"]), 1)
        if not parts:
            seconds[task_name(claim["id"])] = round(float(claim["seconds"]), 1)
    env = results["environment"]
    return {"commit": env.get("commit"), "cpu": env.get("cpu"), "seed": results["seed"], "seconds": seconds}


@functools.cache
def _profiles(path: Path = TABLE) -> dict[str, dict[str, float]]:
    """``{profile: {task: seconds}}`` from the table; empty where the file is missing or not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {
            profile: {str(name): float(s) for name, s in entry["seconds"].items() if math.isfinite(float(s)) and s >= 0}
            for profile, entry in data["profiles"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # only the start order depends on it: claim order, as with no table


def expected(profile: str, claim_id: str, part: str | None = None) -> float | None:
    """The task's seconds in the table's run of ``profile``; ``None`` where it has none."""
    return _profiles().get(profile, {}).get(task_name(claim_id, part))


def main(argv: Sequence[str] | None = None) -> int:
    """``RESULTS...``: write each report's profile into the table, keeping the other profiles."""
    parser = argparse.ArgumentParser(prog="python -m attnscale.lab.timings", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="a report's results.json (run with --force: every claim timed)")
    parser.add_argument("--table", default=str(TABLE), help="the table to update (default: the package's)")
    args = parser.parse_args(argv)
    path = Path(args.table)
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except ValueError as exc:
        raise SystemExit(f"--table {path}: expected the JSON table this command writes, got {exc}; fix: delete it and rerun") from None
    profiles = data.get("profiles", {}) if isinstance(data, dict) else {}
    for name in args.results:
        try:
            results = json.loads(Path(name).read_text(encoding="utf-8"))
            profiles[results["profile"]] = table(results)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{name}: expected a report's results.json, every claim timed; {type(exc).__name__}: {exc}") from None
    out = {"made_by": "python -m attnscale.lab.timings RESULTS...", "profiles": dict(sorted(profiles.items()))}
    path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
