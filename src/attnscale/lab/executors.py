"""Where the report's experiments run: ``local`` worker processes (the default) or ``ray`` tasks.

``local`` is :func:`attnscale.lab.runner.run_report`'s own process pool: one process per
experiment, ``jobs`` at once. ``ray`` (:func:`run_ray`) makes each experiment a Ray task with one
CPU and one torch thread, on a local Ray instance of ``jobs`` CPUs or on the cluster at ``address``.

With Ray the driver, not the workers, writes the results: a task sends back the experiment's record
and its figure files as bytes, and the driver writes the figures under ``OUT/figures`` and the
record into ``OUT/cache`` (atomically, through :func:`attnscale.lab.execute.keep`) as soon as the
task finishes. Workers therefore need no shared file system, an interrupted or partly failed sweep
resumes without recomputing what finished, and a cache entry written by one executor is reused by
the other. A task that fails (its worker dies, it is cancelled, its node is lost) becomes an
``inconclusive`` record, like a process that dies under ``local``; tasks are not retried: rerun the
report, and only what did not finish runs again. Each task streams its progress back to the
driver (a Ray streaming generator), so the progress bars are those of ``local``.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from rich.console import Console
from rich.progress import Progress, TaskID

from .execute import Task, bare_fields, execute, inconclusive_record, keep, throttled
from .terminal import COLOURS, progress_columns

__all__ = ["EXECUTORS", "Executor", "require_ray", "run_ray", "validate"]

Executor = Literal["local", "ray"]
EXECUTORS: tuple[Executor, ...] = ("local", "ray")

_WAIT_S = 0.5
"""How long the driver blocks in ``ray.wait`` at a time, so that Ctrl-C is seen promptly."""


def require_ray() -> ModuleType:
    """The ``ray`` module; a ``ValueError`` naming the extra to install if it is missing."""
    try:
        import ray
    except ImportError as exc:
        raise ValueError(
            f"executor 'ray' needs Ray, which is not installed ({exc}); install it with: pip install 'attnscale[ray]'"
        ) from exc
    return ray


def validate(executor: str, address: str | None) -> None:
    """Check the executor options before anything runs; ``ValueError`` says what to change."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if address is not None and executor != "ray":
        raise ValueError(f"address {address!r} is a Ray cluster's address; use it with executor 'ray'")
    if executor == "ray":
        require_ray()


def run_ray(
    pending: list[Task],
    records: dict[str, dict[str, Any]],
    *,
    jobs: int,
    address: str | None,
    console: Console,
) -> None:
    """Run ``pending`` as Ray tasks (one CPU each), adding each finished record to ``records``.

    If Ray is already initialised in this process it is used as it is. Otherwise this connects to
    ``address`` (``ray.init(address=...)``: the cluster's CPUs decide how many run at once), or,
    without one, starts a local Ray instance with ``jobs`` CPUs; either is shut down on return.
    """
    ray = require_ray()
    started_here = not ray.is_initialized()
    if started_here:
        if address is None:
            ray.init(num_cpus=jobs, include_dashboard=False, logging_level=logging.ERROR)
        else:
            ray.init(address=address, logging_level=logging.ERROR)
    try:
        # No retries: experiments are deterministic, and a rerun of the report retries what failed.
        # Workers are reused between experiments, which run() allows (it depends only on its config
        # and seed); a fresh process per task nearly tripled the tiny report's wall time.
        # A streaming generator task sends progress without an extra actor or queue process.
        remote = ray.remote(num_cpus=1, max_retries=0, num_returns="streaming")(_run_in_worker)
        with Progress(*progress_columns(), console=console) as bars:
            overall = bars.add_task("[bold]claims", total=len(records) + len(pending), completed=len(records))
            for rec in records.values():
                if rec["cached"]:
                    bars.console.print(f"[dim]cached[/]  {rec['id']}: {rec['verdict']}")
            # Submitted longest first (run_report's order); Ray starts them in that order as CPUs free up.
            running = {remote.remote(task): task for task in pending}
            shown: dict[str, TaskID] = {}
            try:
                while running:
                    ready, _ = ray.wait(list(running), num_returns=1, timeout=_WAIT_S)
                    for stream in ready:
                        task = running[stream]
                        kind, payload = _next_message(ray, stream, task)
                        if kind == "started":
                            shown[task.claim_id] = bars.add_task(task.claim_id, total=None)
                        elif kind == "progress":
                            done, total = payload
                            bars.update(shown[task.claim_id], completed=done, total=total)
                        else:
                            del running[stream]
                            if task.claim_id in shown:
                                bars.remove_task(shown.pop(task.claim_id))
                            records[task.claim_id] = payload
                            _announce(bars, payload)
                            bars.advance(overall)
            finally:
                for stream in running:  # interrupted: stop what is still queued or running
                    ray.cancel(stream, force=True)
    finally:
        if started_here:
            ray.shutdown()


def _announce(bars: Progress, record: dict[str, Any]) -> None:
    colour = COLOURS[record["verdict"]]
    bars.console.print(f"[{colour}]done[/]    {record['id']}: {record['verdict']} ({record['seconds']:.1f} s)")


def _next_message(ray: ModuleType, stream: Any, task: Task) -> tuple[str, Any]:
    """The task's next message; for ``"done"``, its record, with figures written and the cache entry stored.

    A task that failed, or ended without a result, gives ``("done", inconclusive record)``.
    """
    try:
        kind, payload = ray.get(next(stream))
    except (ray.exceptions.RayError, StopIteration) as exc:
        reason = (
            f"the Ray task running the experiment failed before it returned a result ({type(exc).__name__}); "
            "rerun to retry"
        )
        return "done", inconclusive_record(bare_fields(task.claim_id), reason, str(exc) or reason)
    if kind != "done":
        return kind, payload
    record, figures = payload
    if task.figdir is not None:
        figdir = Path(task.figdir)
        figdir.mkdir(parents=True, exist_ok=True)
        for name, data in figures.items():
            (figdir / name).write_bytes(data)
    keep(task, record)
    return "done", record


def _run_in_worker(task: Task) -> Iterator[tuple[str, Any]]:
    """Body of an experiment's Ray task, a generator of messages for the driver.

    ``("started", None)``, then ``("progress", (done, total))`` as the experiment reports it, then
    ``("done", (record, figures))`` with its figure files as ``{file name: bytes}``. Figures go to a
    temporary folder on the worker's node and travel back with the record; the cache entry is the
    driver's to write, so ``cache_file`` is dropped here. The experiment runs in a thread so that
    its progress calls can be yielded while it runs.
    """
    import torch

    torch.set_num_threads(1)  # experiments run side by side, one per CPU
    yield "started", None
    messages: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix=f"attnscale-{task.claim_id}-") as tmp:
        here = dataclasses.replace(task, figdir=None if task.figdir is None else tmp, cache_file=None)

        def body() -> None:
            try:
                record = execute(here, throttled(lambda d, t: messages.put(("progress", (d, t)))))
                figures = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
                messages.put(("done", (record, figures)))
            except BaseException as exc:  # execute() catches the experiment's errors; this is anything else
                messages.put(("raised", exc))

        thread = threading.Thread(target=body, name=f"attnscale-{task.claim_id}", daemon=True)
        thread.start()
        while True:
            kind, payload = messages.get()
            if kind == "raised":
                raise payload
            yield kind, payload
            if kind == "done":
                break
        thread.join()
