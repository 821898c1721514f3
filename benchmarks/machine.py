"""Where and at which commit a benchmark ran: recorded in its JSON, named beside its figures."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# torch's default thread count, read before a benchmark sets its own: the cores a run used.
DEFAULT_THREADS = torch.get_num_threads()


# Variables that hold torch, oneMKL, oneDNN or the kernel to other code than the CPU's best: a run
# under any of them is named with them, so that its figures are not read as the CPU's own.
HOLDS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATTNSCALE_KERNEL_ISA", "ATTNSCALE_HALF_PRODUCTS")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), with the vector extensions that matter here, and
    the variables of HOLDS the run was under."""
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [label for flag, label in (("avx512f", "AVX-512"), ("amx_bf16", "AMX"), ("avx2", "AVX2")) if flag in flags]
    if "AVX-512" in isa:
        isa.remove("AVX2")
    held = [f"{var}={os.environ[var]}" for var in HOLDS if os.environ.get(var, "").strip()]
    if held:
        isa.append("run with " + " ".join(held))
    return f"{name} ({', '.join(isa)})" if isa else name


def commit() -> str:
    """The checkout's commit (``+dirty`` where the measured code, src/ or benchmarks/, has
    uncommitted changes), or "unknown" outside git; ``$BENCH_COMMIT`` names it for a copy of the
    checkout (a machine the tree was sent to)."""
    named = os.environ.get("BENCH_COMMIT", "").strip()
    if named:
        return named
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def describe() -> dict[str, object]:
    """The fields every recorded benchmark JSON carries about its run."""
    return {"cpu": cpu_name(), "cores": DEFAULT_THREADS, "torch": torch.__version__, "commit": commit()}
