"""Run one experiment in the calling process and build its results.json record.

:func:`execute` is what every executor runs for one :class:`Task`: the local worker processes of
:mod:`attnscale.lab.runner` and the Ray tasks of :mod:`attnscale.lab.executors`. It never raises
for the experiment's own errors: they become an ``inconclusive`` record with the traceback.

An experiment with independent parts (``parts(config)``, ``run_part``, ``combine``; see
:mod:`attnscale.lab.base`) can run them as separate tasks, side by side: :func:`execute_part` runs
one, and :func:`execute` of a task holding every part's result (``Task.pieces``) combines them into
what ``run`` would have returned, then judges and plots as usual.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import cache, registry, schema
from .base import Claim, Headline, Profile, Verdict, rule_fingerprint
from .base import Progress as ProgressFn

__all__ = [
    "Task",
    "bare_fields",
    "claim_fields",
    "execute",
    "execute_part",
    "headline",
    "inconclusive_record",
    "keep",
    "part_failure",
    "rule_fields",
    "throttled",
]

_PROGRESS_INTERVAL_S = 0.2


@dataclass(frozen=True)
class Task:
    """One experiment to run; plain data, so it crosses into a worker process."""

    module_name: str
    claim_id: str
    profile: Profile
    seed: int
    figdir: str | None
    """Where ``plot`` writes; ``None`` skips the figures."""
    fig_prefix: str
    """The figures' folder as results.json names it, relative to the report (``figures/<id>``)."""
    cache_file: str | None
    """Where to store the record once it succeeds; ``None`` stores nothing."""
    part: str | None = None
    """Run only this part of an experiment that has parts (``parts(config)``); :func:`execute`
    then returns the part's result (see :func:`execute_part`), not a record."""
    pieces: dict[str, dict[str, Any]] | None = None
    """Every part's result (from :func:`execute_part`), for the task that combines, judges and plots them."""

    @property
    def key(self) -> str:
        """The task's name among the running ones: the claim id, with the part after a colon."""
        return self.claim_id if self.part is None else f"{self.claim_id}:{self.part}"


def claim_fields(claim: Claim) -> dict[str, Any]:
    return {
        "id": claim.id,
        "statement": claim.statement,
        "sources": list(claim.sources),
        "method": claim.method,
        "rule": claim.rule,
        "rule_history": [asdict(v) for v in claim.rule_history],
    }


def rule_fields(claim: Claim, module: Any) -> dict[str, Any]:
    """The rule's fingerprint as the code stands, and the version it is: the latest one of the
    claim's history whose fingerprint matches, or ``None`` if the code matches no recorded version."""
    found = rule_fingerprint(module)
    version = next((v.version for v in reversed(claim.rule_history) if v.fingerprint == found), None)
    return {"rule_version": version, "rule_fingerprint": found}


def headline(measured: dict[str, Any], spec: Headline | str | None) -> dict[str, Any] | None:
    """``{"key", "value", "label", "unit"}`` for the summary, from the experiment's ``HEADLINE``.

    ``spec``: a :class:`Headline` (a dotted path into measured, its label and unit) or a bare key,
    labelled by itself. ``None`` when the experiment names no headline or the path is not in ``measured``.

    >>> headline({"a": {"b": 2.0}}, Headline("a.b", "the b of a", "x"))
    {'key': 'a.b', 'value': 2.0, 'label': 'the b of a', 'unit': 'x'}
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = Headline(spec, spec)

    def find(key: str) -> Any:
        value: Any = measured
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value

    value = find(spec.key)
    if value is None:
        return None
    head = {"key": spec.key, "value": value, "label": spec.label, "unit": spec.unit}
    if spec.spread is not None:
        head["spread"] = find(spec.spread)
    return head


def bare_fields(claim_id: str) -> dict[str, Any]:
    """Claim fields for a claim whose module could not tell us more."""
    return {
        "id": claim_id,
        "statement": registry.statement(claim_id),
        "sources": [],
        "method": "",
        "rule": "",
        "rule_history": [],
        "rule_version": None,
        "rule_fingerprint": "",
    }


def inconclusive_record(
    fields: dict[str, Any], reason: str, error: str, seconds: float = 0.0, cpu: float = 0.0, config: Any = None
) -> dict[str, Any]:
    return {
        **fields,
        "verdict": Verdict.INCONCLUSIVE.value,
        "reason": reason,
        "arms": [],
        "headline": None,
        "measured": {},
        "figures": [],
        "config": config if config is not None else {},
        "seconds": seconds,
        "cpu_seconds": cpu,
        "cached": False,
        "error": error,
    }


def _failure(fields: dict[str, Any], stage: str, clock: tuple[float, float], config: Any) -> dict[str, Any]:
    """The record of an experiment that raised; call it inside the ``except`` block."""
    exc = sys.exc_info()[1]
    reason = f"the experiment failed in {stage}: {type(exc).__name__}: {exc}"
    wall, cpu = _elapsed(clock)
    return inconclusive_record(fields, reason, traceback.format_exc(), wall, cpu, config)


def _elapsed(clock: tuple[float, float]) -> tuple[float, float]:
    """Wall and CPU seconds since ``clock = (perf_counter(), process_time())``."""
    return time.perf_counter() - clock[0], time.process_time() - clock[1]


def execute(task: Task, progress: ProgressFn) -> dict[str, Any]:
    """Run, judge and plot one experiment; the claim's results.json record, stored in the cache on success.

    Any exception from the experiment becomes an ``inconclusive`` record with the error; a failure
    in ``plot`` keeps the verdict and records the error. Failed records are not cached.
    """
    start = (time.perf_counter(), time.process_time())
    fields = bare_fields(task.claim_id)
    config_json: Any = None
    try:
        module = importlib.import_module(task.module_name)
        fields = {**claim_fields(module.CLAIM), **rule_fields(module.CLAIM, module)}
        config = module.Config.for_profile(task.profile)
        config_json = schema.to_jsonable(asdict(config))
    except Exception:
        return _failure(fields, "set-up", start, config_json)
    parts: list[dict[str, Any]] = []
    try:
        if task.pieces is None:
            measured = module.run(config, task.seed, progress)
        else:
            parts = [{"name": name, "seconds": p["seconds"], "cpu_seconds": p["cpu_seconds"]} for name, p in task.pieces.items()]
            failed = next((name for name, p in task.pieces.items() if p["error"] is not None), None)
            if failed is not None:
                piece = task.pieces[failed]
                wall, cpu = _elapsed(start)
                spent = sum(p["seconds"] for p in parts), sum(p["cpu_seconds"] for p in parts)
                reason = f"the experiment failed in run (part {failed!r}): {piece['reason']}"
                return {**inconclusive_record(fields, reason, piece["error"], wall + spent[0], cpu + spent[1], config_json), "parts": parts}
            measured = module.combine(config, task.seed, {name: p["result"] for name, p in task.pieces.items()})
    except Exception:
        return _failure(fields, "run", start, config_json)
    try:
        judgement = module.judge(measured)
        stored = schema.to_jsonable(measured)
    except Exception:
        return _failure(fields, "judge", start, config_json)
    record = {
        **fields,
        "verdict": Verdict(judgement.verdict).value,
        "reason": judgement.reason,
        "arms": [{"name": a.name, "verdict": Verdict(a.verdict).value, "reason": a.reason} for a in judgement.arms],
        "headline": schema.to_jsonable(headline(stored, getattr(module, "HEADLINE", None))),
        "measured": stored,
        "figures": [],
        "config": config_json,
        "seconds": 0.0,
        "cpu_seconds": 0.0,
        "cached": False,
        "error": None,
    }
    try:
        if task.figdir is not None:
            record["figures"] = _plot(module, measured, Path(task.figdir), task.fig_prefix)
    except Exception as exc:
        record["figures"] = []
        record["reason"] += f" (figures failed: {type(exc).__name__}: {exc})"
        record["error"] = traceback.format_exc()
    record["seconds"], record["cpu_seconds"] = _elapsed(start)
    if parts:  # the experiment's own time: its parts' (which ran side by side) and this step's
        record["seconds"] += sum(p["seconds"] for p in parts)
        record["cpu_seconds"] += sum(p["cpu_seconds"] for p in parts)
        record["parts"] = parts
    keep(task, record)
    return record


def execute_part(task: Task, progress: ProgressFn) -> dict[str, Any]:
    """Run part ``task.part`` of an experiment: ``{"result": run_part(...), "seconds", "cpu_seconds",
    "error": None, "reason": ""}``, or with ``result`` None, the traceback in ``error`` and the
    exception in ``reason`` when it raised. The record comes from the task that combines the parts."""
    start = (time.perf_counter(), time.process_time())
    result, error, reason = None, None, ""
    try:
        module = importlib.import_module(task.module_name)
        config = module.Config.for_profile(task.profile)
        result = module.run_part(config, task.seed, task.part, progress)
    except Exception as exc:
        error, reason = traceback.format_exc(), f"{type(exc).__name__}: {exc}"
    wall, cpu = _elapsed(start)
    return {"result": result, "seconds": wall, "cpu_seconds": cpu, "error": error, "reason": reason}


def part_failure(exitcode: int | None) -> dict[str, Any]:
    """:func:`execute_part`'s answer for a part whose process died before it returned one."""
    how = f"killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
    reason = f"the process running the part died ({how}) before it returned a result; rerun to retry"
    return {"result": None, "seconds": 0.0, "cpu_seconds": 0.0, "error": reason, "reason": reason}


def keep(task: Task, record: dict[str, Any]) -> None:
    """Store ``record`` as the task's cache entry if the experiment succeeded; a failure is retried next run."""
    if task.cache_file is not None and record["error"] is None:
        cache.store(Path(task.cache_file), record)


def _plot(module: Any, measured: dict[str, Any], figdir: Path, prefix: str) -> list[dict[str, str]]:
    """The figures ``plot`` wrote, each with its caption from ``captions`` (``""`` where it gives none)."""
    entries = []
    names = module.plot(measured, figdir)
    captions = module.captions(measured) if hasattr(module, "captions") else {}
    for name in names:
        missing = [f"{name}.{ext}" for ext in ("svg", "png") if not (figdir / f"{name}.{ext}").is_file()]
        if missing:
            wrote = " or ".join(missing)
            raise FileNotFoundError(f"plot() returned {name!r} but wrote no {wrote}; write figures with base.save_figure")
        entries.append(
            {"name": name, "svg": f"{prefix}/{name}.svg", "png": f"{prefix}/{name}.png", "caption": captions.get(name, "")}
        )
    return entries


def throttled(send: ProgressFn) -> ProgressFn:
    """A ``Progress`` that passes ``(done, total)`` on to ``send`` at most every 0.2 s, and always the last one."""
    last = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= _PROGRESS_INTERVAL_S or done >= total:
            last = now
            send(done, total)

    return progress
