"""Run one experiment in the calling process and build its results.json record.

:func:`execute` is what every executor runs for one :class:`Task`: the local worker processes of
:mod:`attnscale.lab.runner` and the Ray tasks of :mod:`attnscale.lab.executors`. It never raises
for the experiment's own errors: they become an ``inconclusive`` record with the traceback.
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
    "headline",
    "inconclusive_record",
    "keep",
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
    try:
        measured = module.run(config, task.seed, progress)
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
    keep(task, record)
    return record


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
