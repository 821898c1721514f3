"""Run checks on a gloo group of forked ranks; a rank that raises, dies or hangs fails the test."""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, checks, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for check in checks:
            check(rank, world_size)
    finally:
        dist.destroy_process_group()


def launch(world_size: int, checks, *, limit_s: float = 180.0, timeout_s: float = 60.0) -> None:
    """Run every check on every rank, in order, in one process group.

    A rank that raises fails the launch with ``mp.ProcessRaisedException``, one killed by a signal
    (an abort inside gloo) with ``mp.ProcessExitedException``; ranks still running after
    ``limit_s`` seconds are killed and the test fails, so that a hang cannot block the suite.
    """
    # fork: the children inherit the checks (closures and all) without importing this module again.
    context = mp.start_processes(
        _entry, args=(world_size, _free_port(), checks, timeout_s), nprocs=world_size, start_method="fork", join=False
    )
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=0.2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
                process.join()
            pytest.fail(f"ranks still running after {limit_s:.0f} s: a collective hangs")
