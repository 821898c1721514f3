"""Run experiments (in parallel worker processes, cached, with progress) and assemble the results.

:func:`run_report` is what ``attnscale report`` does: it finds the experiments, takes finished ones
from ``OUT/cache``, runs the rest over ``jobs`` processes (each with one torch thread) or as Ray
tasks (:mod:`attnscale.lab.executors`), records an experiment that raises as ``inconclusive`` with
the error instead of stopping, and writes the report. :func:`run_single` runs one experiment in this
process. Running one experiment and building its record is :mod:`attnscale.lab.execute`'s job;
its names are re-exported here.
"""

from __future__ import annotations

import ctypes
import difflib
import json
import multiprocessing
import os
import platform
import queue as queue_module
import select as select_module
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from dataclasses import replace as replace_fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from .. import __version__
from .._validate import fail
from . import cache, executors, formatting, registry, report, schema, timings
from .base import PROFILES, Profile
from .execute import (
    Task,
    bare_fields,
    claim_fields,
    execute,
    execute_part,
    headline,
    inconclusive_record,
    keep,
    part_failure,
    rule_fields,
    throttled,
)
from .registry import DEFAULT_PACKAGE, Experiment
from .terminal import COLOURS, progress_columns

__all__ = [
    "Task",
    "check_outdir",
    "check_replaces",
    "claim_fields",
    "default_outdir",
    "claims_table",
    "execute",
    "headline",
    "keep",
    "record_renderables",
    "rule_fields",
    "run_report",
    "run_single",
    "select",
    "start_order",
    "source_commit",
    "summary_table",
    "throttled",
]

_WATCH_INTERVAL_S = 0.5
"""How often a worker without pidfds checks that the report's process is still there."""
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _figures_exist(record: dict[str, Any], outdir: Path) -> bool:
    return all((outdir / f[k]).is_file() for f in record["figures"] for k in ("svg", "png"))


def _end_with(driver: int) -> None:
    """Make this worker process end as soon as the report's process ``driver`` does, even by SIGKILL.

    Under forkserver the worker's parent is the fork server, which lives as long as its workers do
    (they hold its liveness pipe), so a watchdog thread watches ``driver`` itself: through a pidfd,
    readable once it has exited, where Linux has them; else by polling it and the parent pid.
    PR_SET_PDEATHSIG adds a kernel-sent SIGKILL when the direct parent dies (the driver under spawn).
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    threading.Thread(target=_watch, args=(driver, os.getppid()), name="attnscale-watchdog", daemon=True).start()


def _watch(driver: int, parent: int) -> None:
    """Wait until ``driver`` has exited, or this process has lost ``parent``; then end this process."""
    try:
        pidfd = os.pidfd_open(driver)
    except ProcessLookupError:  # the driver is gone already
        pass
    except (AttributeError, OSError):  # no pidfds here (not Linux, or a kernel before 5.3): poll
        while os.getppid() == parent and _alive(driver):
            time.sleep(_WATCH_INTERVAL_S)
    else:
        select_module.select([pidfd], [], [])  # readable once the driver has exited
    os._exit(1)  # nobody is left to read the result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        pass
    return True


def _child(task: Task, messages: Any, driver: int) -> None:
    """Body of an experiment's own process: run it, sending progress and then the record to ``messages``."""
    _end_with(driver)
    import torch

    torch.set_num_threads(1)  # experiments run side by side, one per core
    progress = throttled(lambda done, total: messages.put(("progress", task.key, (done, total))))
    try:
        messages.put(("done", task.key, (execute_part if task.part is not None else execute)(task, progress)))
    except KeyboardInterrupt:  # the report was interrupted; the parent says so
        pass


def _context() -> multiprocessing.context.BaseContext:
    # Never fork a process that may already run torch threads; forkserver also starts workers fast.
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["attnscale.lab.runner", "matplotlib.figure", "matplotlib.backends.backend_agg"])
        return ctx
    return multiprocessing.get_context("spawn")


def select(found: registry.Discovery, only: Sequence[str] | None) -> list[Experiment]:
    """The experiments to run: all of them, or those named in ``only`` (each must have an experiment)."""
    if not only:
        return list(found.experiments)
    by_id = found.by_id()
    broken_ids = {registry.module_claim_id(name) for name, _ in found.broken}
    unknown = [i for i in only if i not in by_id and i not in broken_ids]
    if unknown:
        without = [i for i in unknown if i in registry.CLAIM_IDS]
        hint = f"; no experiment yet for {', '.join(without)}" if without else ""
        raise ValueError(
            f"--only expects claim ids that have an experiment ({', '.join(by_id)}), got {', '.join(unknown)}{hint}"
        )
    return [e for e in found.experiments if e.id in only]


def source_commit() -> str | None:
    """The git commit of the attnscale sources that ran, with ``+changes`` if they differ from it;
    ``None`` outside a git checkout (an installed wheel)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        changed = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or changed.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def _environment(jobs: int) -> dict[str, Any]:
    import numpy
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count() or 1,
        "jobs": jobs,
        "threads": 1,
        "commit": source_commit(),
    }


def _crash_record(task: Task, exitcode: int | None) -> dict[str, Any]:
    how = f"killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
    reason = f"the process running the experiment died ({how}) before it returned a result; rerun to retry"
    return inconclusive_record(bare_fields(task.claim_id), reason, reason)


def _broken_record(module_name: str, tb: str) -> dict[str, Any]:
    last = tb.strip().splitlines()[-1] if tb.strip() else "unknown error"
    reason = f"the experiment module {module_name} failed to import: {last}"
    return inconclusive_record(bare_fields(registry.module_claim_id(module_name)), reason, tb)


def check_outdir(outdir: Path | str, *, arg: str = "outdir") -> None:
    """Raise ``ValueError`` (naming ``arg``) unless ``outdir`` is a folder this process can write, or can create.

    Creates nothing. An existing folder is tried by creating and removing a temporary file in it, so
    that permissions, read-only mounts and access lists all count; a missing one needs its nearest
    existing parent to be a folder this process may write to.
    """
    path = Path(outdir)
    expected = "a folder to write the report into, or a path where one can be created"
    if not str(outdir).strip():  # an unset shell variable: Path("") would be the current folder
        fail(arg, expected, "an empty path", "pass a folder name, e.g. attnscale-report")
    if os.path.lexists(path) and not path.is_dir():
        fail(arg, expected, f"{str(path)!r}, which exists and is not a folder", "pass another path, or move that file away")
    if path.is_dir():
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            fail(arg, expected, f"{str(path)!r}, a folder this process cannot write to ({exc.strerror})", "pass a writable folder")
        return
    parent = path.absolute().parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not parent.is_dir():
        fail(arg, expected, f"{str(path)!r}, inside the file {str(parent)!r}", "pass a path that is not inside a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(arg, expected, f"{str(path)!r}, in {str(parent)!r}, which this process cannot write to", "pass a writable place")


def default_outdir(profile: str, only: Sequence[str] | None) -> str:
    """``attnscale-report`` for the whole default report; another folder for another profile or a
    subset (``attnscale-report-quick``, ``attnscale-report-default-only``), so that neither replaces it."""
    if profile == "default" and not only:
        return "attnscale-report"
    return f"attnscale-report-{profile}" + ("-only" if only else "")


def check_replaces(outdir: Path, profile: str, seed: int, claim_ids: Sequence[str], *, arg: str = "outdir", replace: str = "replace=True") -> None:
    """Raise ``ValueError`` (naming ``arg``, and ``replace`` as the way to overwrite) if ``outdir``
    holds a report of another profile, seed or set of claims, which this run would overwrite; a
    report of the same run (resumed) is fine."""
    try:
        old = json.loads((Path(outdir) / report.FILES["json"]).read_text(encoding="utf-8"))
        old_run = (old["profile"], old["seed"], sorted(c["id"] for c in old["claims"]))
    except (OSError, ValueError, KeyError, TypeError):  # no report there, or not one of ours
        return
    if old_run == (profile, seed, sorted(claim_ids)):
        return
    shown = f"{len(old_run[2])} claims" if len(old_run[2]) > 3 else ", ".join(old_run[2])
    fail(
        arg,
        f"a folder without a report, or with one of the same profile, seed and claims (profile {profile}, seed {seed})",
        f"{str(outdir)!r}, which holds the report of profile {old_run[0]}, seed {old_run[1]}, {shown}",
        f"pass another folder, or {replace} to overwrite that report",
    )


SEED_LIMIT = 2**32
"""Seeds run from 0 to 2**32 - 1: experiments derive their generators' seeds from the seed (times a
million and more), which must stay inside torch's 64-bit seeds, and NumPy takes no negative one."""


def run_report(
    outdir: Path | str = "attnscale-report",
    *,
    profile: Profile = "default",
    seed: int = 0,
    only: Sequence[str] | None = None,
    jobs: int | None = None,
    force: bool = False,
    console: Console | None = None,
    package: str = DEFAULT_PACKAGE,
    executor: executors.Executor = "local",
    address: str | None = None,
    replace: bool = False,
    names: tuple[str, str] = ("outdir", "replace=True"),
) -> dict[str, Any]:
    """Run the lab and write ``outdir``/{index.html, report.md, results.json, figures/}; return results.json's data.

    Raises ``ValueError`` for a bad argument, an unusable ``outdir`` included (see
    :func:`check_outdir`), or an ``outdir`` that holds a report of another profile, seed or set of
    claims unless ``replace`` is true (see :func:`check_replaces`), before running anything. An experiment that raises, or whose process
    dies, is reported as ``inconclusive`` with the error. ``executor="ray"`` runs
    the experiments as Ray tasks, on a local Ray instance or on the cluster at ``address``
    (see :mod:`attnscale.lab.executors`); the cache and the results are the same. ``names``: what
    errors call ``outdir`` and ``replace`` (the command line's ``--out`` and ``--replace``).
    """
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    executors.validate(executor, address)
    jobs = (os.cpu_count() or 1) if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}; use 1 to run one experiment at a time")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed: expected an integer from 0 to 2**32 - 1, got {seed!r}. Fix: pass e.g. seed=1")
    check_outdir(outdir, arg=names[0])
    console = console or Console()
    outdir = Path(outdir)
    started = time.perf_counter()
    found = registry.discover(package)
    chosen = select(found, only)
    broken_ids = [registry.module_claim_id(n) for n, _ in found.broken]
    if not replace:
        will_hold = [e.id for e in chosen] + [i for i in broken_ids if not only or i in only]
        check_replaces(outdir, profile, seed, will_hold, arg=names[0], replace=names[1])
    library_hash = cache.library_source_hash()

    records: dict[str, dict[str, Any]] = {}
    for name, tb in found.broken:
        if not only or registry.module_claim_id(name) in only:
            records[registry.module_claim_id(name)] = _broken_record(name, tb)
    pending: list[Task] = []
    for exp in chosen:
        key = cache.cache_key(
            config=asdict(exp.config(profile)),
            seed=seed,
            version=__version__,
            module_source=Path(exp.module.__file__).read_bytes(),
            library_hash=library_hash,
        )
        path = cache.cache_path(outdir, exp.id, key)
        hit, unused = (None, "") if force else cache.read(path, exp.id)
        if unused:
            console.print(f"{exp.id}: the cache entry {path.name} {unused}: recomputed", highlight=False, markup=False)
        if hit is not None and _figures_exist(hit, outdir):
            records[exp.id] = {**hit, "cached": True}
        else:
            figdir = outdir / "figures" / exp.id
            if figdir.is_dir():  # an earlier run may have written figures under other names
                shutil.rmtree(figdir)
            task = Task(exp.module_name, exp.id, profile, seed, str(figdir), f"figures/{exp.id}", str(path))
            if executor == "local" and hasattr(exp.module, "parts"):  # side by side in the job slots
                pending += [replace_fields(task, part=name) for name in exp.module.parts(exp.config(profile))]
            else:
                pending.append(task)

    pending = start_order(pending, outdir)
    if executor == "ray":
        executors.run_ray(pending, records, jobs=jobs, address=address, console=console)
    else:
        _run_pending(pending, records, jobs, console)

    measured_ids = {e.id for e in found.experiments} | {registry.module_claim_id(n) for n, _ in found.broken}
    results = {
        "schema_version": schema.SCHEMA_VERSION,
        "attnscale_version": __version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "profile": profile,
        "seed": seed,
        "seconds": time.perf_counter() - started,
        "environment": {**_environment(jobs), "executor": executor},
        "not_measured": [{"id": cid, "statement": text} for cid, text in registry.CLAIMS if cid not in measured_ids],
        "claims": [records[i] for i in sorted(records, key=registry.order_key)],
    }
    report.write_report(results, outdir)
    return results


def start_order(pending: list[Task], outdir: Path) -> list[Task]:
    """``pending`` longest first, so that a long task does not start last while the other slots idle.

    A task's length is its last finished run in ``outdir``'s cache, else its time in the published
    run of its profile (:mod:`attnscale.lab.timings`: a fresh clone's report), else unknown; unknown
    ones go first (a new claim may be long), and ties keep claim order.
    """

    def seconds(t: Task) -> float:
        known = cache.last_seconds(outdir, t.claim_id, t.part)
        known = timings.expected(t.profile, t.claim_id, t.part) if known is None else known
        return float("inf") if known is None else known

    return sorted(pending, key=lambda t: -seconds(t))


def _run_pending(pending: list[Task], records: dict[str, dict[str, Any]], jobs: int, console: Console) -> None:
    """Run ``pending`` in up to ``jobs`` processes at once, one process per experiment, adding to ``records``.

    One process each, not a pool: an experiment that crashes its process (a segfault, an
    out-of-memory kill) loses only its own result. Workers end with this process, even when it
    is killed with SIGKILL and cannot stop them itself (see ``_end_with``).
    """
    claims = {t.claim_id for t in pending}
    expected: dict[str, list[str]] = {}
    for t in pending:
        if t.part is not None:
            expected.setdefault(t.claim_id, []).append(t.part)
    pieces: dict[str, dict[str, dict[str, Any]]] = {}
    with Progress(*progress_columns(), console=console) as bars:
        overall = bars.add_task("[bold]claims", total=len(records) + len(claims), completed=len(records))
        for rec in records.values():
            if rec["cached"]:
                bars.console.print(f"[dim]cached[/]  {rec['id']}: {rec['verdict']}")
        ctx = _context()
        messages = ctx.Queue()
        waiting = list(pending)
        running: dict[str, tuple[Any, Task, TaskID]] = {}

        def finish(key: str, payload: dict[str, Any]) -> None:
            proc, task, bar = running.pop(key)
            proc.join()
            bars.remove_task(bar)
            if task.part is not None:  # a part: once all are in, combine them first, before anything else starts
                got = pieces.setdefault(task.claim_id, {})
                got[task.part] = payload
                if len(got) == len(expected[task.claim_id]):
                    ordered = {name: got[name] for name in expected[task.claim_id]}
                    waiting.insert(0, replace_fields(task, part=None, pieces=ordered))
                return
            records[task.claim_id] = payload
            bars.advance(overall)
            colour = COLOURS[payload["verdict"]]
            bars.console.print(f"[{colour}]done[/]    {task.claim_id}: {payload['verdict']} ({payload['seconds']:.1f} s)")

        def read(block: bool) -> bool:
            try:
                kind, key, payload = messages.get(timeout=0.1) if block else messages.get_nowait()
            except queue_module.Empty:
                return False
            if key not in running:
                return True
            if kind == "progress":
                done, total = payload
                bars.update(running[key][2], completed=done, total=total)
            elif kind == "done":
                finish(key, payload)
            return True

        try:
            while waiting or running:
                while waiting and len(running) < jobs:
                    task = waiting.pop(0)
                    proc = ctx.Process(target=_child, args=(task, messages, os.getpid()), name=f"attnscale-{task.claim_id}")
                    proc.start()
                    running[task.key] = (proc, task, bars.add_task(task.key, total=None))
                read(block=True)
                for key, (proc, task, _) in list(running.items()):
                    if key in running and not proc.is_alive():
                        while key in running and read(block=False):  # its result may still be queued
                            pass
                        if key in running:
                            finish(key, part_failure(proc.exitcode) if task.part is not None else _crash_record(task, proc.exitcode))
        finally:
            for proc, _, _ in running.values():  # interrupted: stop what is still running
                proc.terminate()
            for proc, _, _ in running.values():
                proc.join()
            messages.close()


def summary_table(results: dict[str, Any]) -> Table:
    """The terminal summary: claim, verdict, key number, seconds."""
    table = Table(title=f"attnscale lab, profile {results['profile']}, seed {results['seed']}")
    table.add_column("claim")
    table.add_column("verdict")
    table.add_column("key number")
    table.add_column("seconds", justify="right")
    for rec in results["claims"]:
        key = formatting.headline_text(rec)
        seconds = f"{rec['seconds']:.1f}" + (" (cached)" if rec["cached"] else "")
        colour = COLOURS[rec["verdict"]]
        table.add_row(rec["id"], f"[{colour}]{rec['verdict']}[/]", key, seconds)
    return table


def run_single(
    claim_id: str,
    *,
    profile: Profile = "default",
    seed: int = 0,
    figures: Path | str | None = None,
    console: Console | None = None,
    package: str = DEFAULT_PACKAGE,
) -> dict[str, Any]:
    """Run one experiment in this process (no cache, one torch thread as in the report) and return
    its results.json record.

    ``figures``: a folder for its figures; ``None`` skips them. Raises ``ValueError`` for an
    unknown claim id (suggesting the nearest one), a claim without an experiment or whose module
    fails to import, and an unknown profile.
    """
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    found = registry.discover(package)
    exp = _runnable(found, claim_id)
    figdir = None if figures is None else Path(figures)
    figdir_text = None if figdir is None else str(figdir)
    task = Task(exp.module_name, exp.id, profile, seed, figdir_text, figdir_text or "", None)
    console = console or Console()
    import torch

    # One torch thread, as in the report's workers: these experiments are many small ops, which
    # a thread pool slows down several times over, and the numbers then match the report's.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Progress(*progress_columns(), console=console, transient=True) as bars:
            bar = bars.add_task(claim_id, total=None)
            return execute(task, lambda done, total: bars.update(bar, completed=done, total=total))
    finally:
        torch.set_num_threads(threads)


def _runnable(found: registry.Discovery, claim_id: str) -> Experiment:
    """The experiment of ``claim_id``, or a ``ValueError`` saying why there is none and what to run instead."""
    by_id = found.by_id()
    if claim_id in by_id:
        return by_id[claim_id]
    expected = "the id of a claim with an experiment, as 'attnscale list' shows them"
    broken = [(name, tb) for name, tb in found.broken if registry.module_claim_id(name) == claim_id]
    if broken:
        name, tb = broken[0]
        last = tb.strip().splitlines()[-1] if tb.strip() else "unknown error"
        fail("claim_id", expected, f"{claim_id!r}, whose module {name} failed to import: {last}", f"fix {name}")
    if claim_id in registry.CLAIM_IDS:
        fail("claim_id", expected, f"{claim_id!r}: no experiment yet for {claim_id}", "pick a claim that 'attnscale list' shows with an experiment")
    near = difflib.get_close_matches(claim_id, list(by_id), n=1)
    fix = f"did you mean {near[0]!r}?" if near else "pick an id from 'attnscale list'"
    fail("claim_id", expected, repr(claim_id), fix)


def _value_renderable(value: Any) -> Any:
    grid = formatting.grid_columns(value)
    if grid is not None:
        table = Table(show_edge=False, pad_edge=False)
        table.add_column("")
        for c in grid:
            table.add_column(c, justify="right")
        for k, row in value.items():
            table.add_row(k, *(formatting.format_value(row.get(c, "")) for c in grid))
        return table
    columns = formatting.record_columns(value)
    if columns is not None:
        table = Table(show_edge=False, pad_edge=False)
        for c in columns:
            table.add_column(c)
        for row in value:
            table.add_row(*(formatting.format_value(row.get(c, "")) for c in columns))
        return table
    if isinstance(value, dict):
        table = Table(show_header=False, show_edge=False, pad_edge=False)
        table.add_column("quantity", style="bold")
        table.add_column("value")
        for k, v in value.items():
            table.add_row(str(k), _value_renderable(v))
        return table
    return formatting.format_value(value)


def record_renderables(record: dict[str, Any]) -> list[Any]:
    """What ``attnscale run`` prints: the measured table, then the verdict and its reason."""
    colour = COLOURS[record["verdict"]]
    parts: list[Any] = [Table(title=f"{record['id']}: measured", show_header=False)]
    parts[0].add_column("quantity", style="bold")
    parts[0].add_column("value")
    for k, v in record["measured"].items():
        parts[0].add_row(k, _value_renderable(v))
    parts.append(f"[bold {colour}]{record['verdict']}[/]: {record['reason']}")
    if record["rule"]:
        parts.append(f"[dim]rule: {record['rule']}[/]")
    if record["error"]:
        parts.append(f"[red]{record['error']}[/]")
    parts.append(f"[dim]{record['seconds']:.1f} s[/]")
    return parts


def claims_table(found: registry.Discovery) -> Table:
    """Every claim of CLAIMS.md, with its experiment module or the lack of one."""
    by_id = found.by_id()
    broken = {registry.module_claim_id(name): name for name, _ in found.broken}
    table = Table(title="claims the lab measures (attnscale report --only ID ...)")
    table.add_column("claim")
    table.add_column("experiment")
    table.add_column("statement")
    extra = [e.id for e in found.experiments if e.id not in registry.CLAIM_IDS]
    for cid in [*registry.CLAIM_IDS, *extra]:
        if cid in by_id:
            status = "[green]" + by_id[cid].module_name.rsplit(".", 1)[-1] + "[/]"
        elif cid in broken:
            status = "[red]import fails[/]"
        else:
            status = "[dim]none yet[/]"
        text = registry.statement(cid) or by_id[cid].claim.statement
        table.add_row(cid, status, text)
    return table
