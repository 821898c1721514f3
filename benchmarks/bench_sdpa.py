"""Time and memory of attnscale's attention beside torch's SDPA and a naive implementation.

Timing: every implementation runs in the same process, interleaved repeat by repeat (so that a
change in machine load hits all of them alike); the median of the repeats after warm-up is
reported with the median per-repeat ratio to ``torch.nn.functional.scaled_dot_product_attention``.
Memory: each (implementation, L) runs forward once in a fresh subprocess; the peak resident set
growth (peak RSS after minus before the call) is reported. Implementations whose estimated
(L x S) memory exceeds ``--memory-cap-gib`` are skipped, not run.

    python benchmarks/bench_sdpa.py --quick     # a smoke run, well under a minute
    python benchmarks/bench_sdpa.py             # L in {256, 1024, 2048, 4096}, memory up to 16384

Prints Markdown tables and writes JSON to benchmarks/results/ (schema ``SCHEMA`` below).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import attnscale
from machine import describe

SCHEMA = "attnscale.bench_sdpa/1"
RESULTS = Path(__file__).resolve().parent / "results"
REFERENCE_IMPL = "torch_sdpa"
AUTO_TARGET = 0.05  # backend="auto" should be within 5% of torch's SDPA where torch's kernel runs

# Score-sized (B, H, L, S) float32 tensors each implementation holds at its forward peak, as
# measured by this script at L = 2048 ... 8192; used only to skip runs that would not fit (the
# fused and tiled kernels hold none).
SCORE_COPIES = {"naive": 2, "math": 4}


def naive(q, k, v):
    """softmax(q k^T / sqrt(D)) v, three plain ops."""
    return torch.softmax((q @ k.transpose(-1, -2)) * q.size(-1) ** -0.5, dim=-1) @ v


def attnscale_backend(name: str) -> Callable:
    def run(q, k, v):
        return attnscale.scaled_dot_product_attention(q, k, v, backend=name)

    return run


def implementations() -> dict[str, Callable]:
    impls = {REFERENCE_IMPL: F.scaled_dot_product_attention, "naive": naive}
    for backend in attnscale.Backend:
        impls[f"attnscale_{backend.value}"] = attnscale_backend(backend.value)
    return impls


@dataclass(frozen=True)
class Timing:
    impl: str
    mode: str  # "fwd" or "fwd+bwd"
    L: int
    median_ms: float
    times_ms: list[float]
    ratio_vs_torch_sdpa: float | None
    backend_ran: str | None


@dataclass(frozen=True)
class Memory:
    impl: str
    L: int
    peak_growth_mib: float | None
    estimate_gib: float
    skipped: str | None


def make_inputs(L: int, *, B: int, H: int, D: int, requires_grad: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_(requires_grad) for _ in range(3))  # (B, H, L, D)
    return q, k, v


def run_once(fn: Callable, inputs, mode: str) -> float:
    q, k, v = inputs
    start = time.perf_counter()
    if mode == "fwd":
        with torch.no_grad():
            fn(q, k, v)
    else:
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
    elapsed = time.perf_counter() - start
    for t in inputs:
        t.grad = None
    return elapsed


def time_all(impls: dict[str, Callable], L: int, mode: str, args) -> list[Timing]:
    inputs = make_inputs(L, B=args.batch, H=args.heads, D=args.head_dim, requires_grad=mode != "fwd")
    ran = {}
    for name, fn in impls.items():
        for _ in range(args.warmup):
            run_once(fn, inputs, mode)
        ran[name] = attnscale.last_backend() if name.startswith("attnscale_") else None
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(args.repeats):
        for name, fn in impls.items():
            times[name].append(run_once(fn, inputs, mode) * 1e3)
    ref = times[REFERENCE_IMPL]
    return [
        Timing(
            impl=name,
            mode=mode,
            L=L,
            median_ms=statistics.median(ms),
            times_ms=[round(t, 4) for t in ms],
            # Median of per-repeat ratios: neighbouring calls share the machine's load of the moment.
            ratio_vs_torch_sdpa=statistics.median(a / b for a, b in zip(ms, ref)),
            backend_ran=ran[name],
        )
        for name, ms in times.items()
    ]


def memory_estimate_gib(impl: str, L: int, args) -> float:
    io = 4 * args.batch * args.heads * L * args.head_dim * 4  # q, k, v, out in float32
    scores = SCORE_COPIES.get(impl.removeprefix("attnscale_"), 0) * args.batch * args.heads * L * L * 4
    return (io + scores) / 2**30


def peak_rss_kib() -> int:
    """This process's peak RSS in KiB: VmHWM where Linux has it, else ``ru_maxrss``.

    ``ru_maxrss`` also counts the peak of the process this one was forked from (a subprocess of a
    large benchmark would inherit its parent's peak); VmHWM is this address space's own.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def reset_peak_rss() -> bool:
    """Lower the peak RSS to the current RSS (Linux), so that import-time peaks do not hide the call's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_child(impl: str, L: int, B: int, H: int, D: int) -> None:
    """Runs in the subprocess: one forward call, then print the RSS growth in MiB as JSON."""
    fn = implementations()[impl]
    inputs = make_inputs(L, B=B, H=H, D=D, requires_grad=False)
    reset = reset_peak_rss()
    before = peak_rss_kib()
    with torch.no_grad():
        out = fn(*inputs)
    after = peak_rss_kib()
    del out
    print(json.dumps({"peak_growth_mib": (after - before) / 1024, "peak_reset": reset}))


def measure_memory(impl: str, L: int, args) -> Memory:
    estimate = memory_estimate_gib(impl, L, args)
    if estimate > args.memory_cap_gib:
        return Memory(impl, L, None, estimate, f"skipped: needs ~{estimate:.0f} GiB")
    cmd = [sys.executable, __file__, "--memory-child", impl, str(L), str(args.batch), str(args.heads), str(args.head_dim)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return Memory(impl, L, None, estimate, f"failed: exit {done.returncode}")
    return Memory(impl, L, json.loads(done.stdout.strip().splitlines()[-1])["peak_growth_mib"], estimate, None)


def timing_table(timings: list[Timing], impls: list[str]) -> str:
    lines = [
        "| mode | L | " + " | ".join(impls) + " |",
        "|---|---:|" + "---:|" * len(impls),
    ]
    rows: dict[tuple[str, int], dict[str, Timing]] = {}
    for t in timings:
        rows.setdefault((t.mode, t.L), {})[t.impl] = t
    for (mode, L), by_impl in rows.items():
        cells = [f"{by_impl[i].median_ms:.2f} ms ({by_impl[i].ratio_vs_torch_sdpa:.2f}x)" for i in impls]
        lines.append(f"| {mode} | {L} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(memory: list[Memory], impls: list[str]) -> str:
    lines = ["| L | " + " | ".join(impls) + " |", "|---:|" + "---:|" * len(impls)]
    rows: dict[int, dict[str, Memory]] = {}
    for m in memory:
        rows.setdefault(m.L, {})[m.impl] = m
    for L, by_impl in rows.items():
        cells = [by_impl[i].skipped or f"{by_impl[i].peak_growth_mib:.0f} MiB" for i in impls]
        lines.append(f"| {L} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def auto_verdicts(timings: list[Timing]) -> list[str]:
    """Where torch's kernel ran under backend="auto" and L >= 1024: is auto within AUTO_TARGET?"""
    out = []
    for t in timings:
        if t.impl == "attnscale_auto" and t.backend_ran == "torch" and t.L >= 1024:
            ok = t.ratio_vs_torch_sdpa <= 1 + AUTO_TARGET
            out.append(f"auto {t.mode} L={t.L}: {t.ratio_vs_torch_sdpa:.3f}x torch SDPA ({'ok' if ok else 'over target'})")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: checks that the script works")
    parser.add_argument("--lengths", type=int, nargs="+", help="L = S for timing (default 256 1024 2048 4096)")
    parser.add_argument("--memory-lengths", type=int, nargs="+", help="L = S for memory (default 1024 ... 16384)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per implementation (>= 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--memory-cap-gib", type=float, default=12.0, help="skip runs estimated above this")
    parser.add_argument("--no-memory", action="store_true", help="timing only")
    parser.add_argument("--no-timing", action="store_true", help="memory only")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default benchmarks/results/bench_sdpa-<time>.json)")
    parser.add_argument("--markdown", metavar="JSON", help="print the memory table the docs show, from a recorded JSON file, and exit")
    parser.add_argument("--memory-child", nargs=5, metavar=("IMPL", "L", "B", "H", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (the median needs them)")
    if args.lengths is None:
        args.lengths = [64, 256] if args.quick else [256, 1024, 2048, 4096]
    if args.memory_lengths is None:
        args.memory_lengths = [1024] if args.quick else [1024, 2048, 4096, 8192, 16384]
    if args.quick:
        args.warmup = 1
    return args


def markdown(result: dict) -> str:
    """The docs' memory table from a recorded JSON file (what ran, where, and each cell)."""
    names = list(dict.fromkeys(m["impl"] for m in result["memory"]))
    config = result["config"]
    lengths = " ".join(str(L) for L in dict.fromkeys(m["L"] for m in result["memory"]))
    head = (
        f"Peak memory growth of one forward call (a fresh process per cell; `python benchmarks/bench_sdpa.py --no-timing "
        f"--memory-lengths {lengths} --output benchmarks/recorded/sdpa_memory.json`, one run at commit {result['commit']}, "
        f"{result['cpu']}; B = {config['batch']}, H = {config['heads']}, D = {config['head_dim']}, float32; cells whose "
        f"L x S tensors would pass {config['memory_cap_gib']:g} GiB are skipped, not run):"
    )
    return head + "\n\n" + memory_table([Memory(**m) for m in result["memory"]], names)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.memory_child:
        impl, *sizes = args.memory_child
        memory_child(impl, *map(int, sizes))
        return 0
    impls = implementations()
    names = list(impls)
    lengths = [] if args.no_timing else args.lengths
    timings = [t for mode in ("fwd", "fwd+bwd") for L in lengths for t in time_all(impls, L, mode, args)]
    memory = [] if args.no_memory else [measure_memory(i, L, args) for L in args.memory_lengths for i in names]

    if timings:
        print(f"## attention timing: B={args.batch}, H={args.heads}, D={args.head_dim}, float32, L = S: median of "
              f"{args.repeats} (ms), median per-repeat ratio to {REFERENCE_IMPL}\n")
        print(timing_table(timings, names))
    for line in auto_verdicts(timings):
        print(f"- {line}")
    if memory:
        print(f"\n## peak RSS growth of one forward call (fresh process per cell, cap {args.memory_cap_gib:g} GiB)\n")
        print(memory_table(memory, names))

    result = {
        "schema": SCHEMA,
        **describe(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"attnscale": attnscale.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_avg_1min": os.getloadavg()[0],
        },
        "config": {k: v for k, v in vars(args).items() if k not in ("output", "memory_child")},
        "timing": [asdict(t) for t in timings],
        "memory": [asdict(m) for m in memory],
    }
    path = args.output or RESULTS / f"bench_sdpa-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
