"""The compiled CPU kernel (backend="fused") against torch's SDPA, case by case, at the default
thread count and at one thread.

Every ratio compares attnscale on a feature torch lacks (softcap, ALiBi, statistics, windows) with
torch's SDPA on the plain problem of the same shape (causal for the causal cases, non-causal for
the statistics case, the same decoding step), both timed in one process, interleaved (repeat 1 of
each, then repeat 2, ...), as the median of the per-repeat ratios. B = 1, H = 8, float32 unless
the case says bf16 or fp16 (torch then runs in the same dtype). The targets are the ones the kernel is built to meet; the table says which
cells meet them.

    python benchmarks/bench_fused.py                    # L 2048/4096/8192, D 64/128, both thread counts
    python benchmarks/bench_fused.py --quick            # L = 2048, D = 64
    python benchmarks/bench_fused.py --json out.json    # also write every time and ratio
    python benchmarks/bench_fused.py --tanh             # only the softcap's tanh against torch.tanh
    python benchmarks/bench_fused.py --varlen           # the tanh, then packed sequences only
    python benchmarks/bench_fused.py --markdown out.json  # the docs' table from a --json run
    python benchmarks/bench_fused.py --blocks           # the kernel's tile shapes compared
    python benchmarks/bench_fused.py --cases bf16 fp16  # only the cases whose name contains a word given
    python benchmarks/bench_fused.py --half-paths       # 16-bit forwards: float32 tiles vs 16-bit products
    python benchmarks/bench_fused.py --compare a1.json a2.json b1.json b2.json  # two commits' runs, cell by cell

Before any timing, every case's output is checked once per shape against the math backend (its
first and last 64 query rows): a wrong output fails the run (exit 1) and nothing is timed.

It also measures forward+backward memory at L = S = 16384 with softcap and a (1024, 0) window (a
fresh process), the kernel's GFLOP/s against this machine's single-thread GEMM peak, and the window
case: (1024, 0) at L = 8192 against torch's causal kernel, with the share of keys it skips.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from unittest import mock

import torch
import torch.nn.functional as F

import attnscale
from attnscale import kernels
from machine import describe

SCHEMA = "attnscale.bench_fused/1"
SOFTCAP = 30.0
WINDOW = (1024, 0)
TARGETS = {  # case -> the largest ratio to torch's SDPA on the plain problem
    "causal, no features (fused forced)": 1.05,
    "causal + softcap, forward": 1.10,
    "causal + ALiBi, forward": 1.20,
    "causal + softcap, forward+backward": 1.30,
    "non-causal with statistics, forward": 1.15,
    "decoding (L = 1, S = 4 L) with softcap": 1.10,
    "bf16 causal + softcap, forward": 1.0,
    "fp16 causal + softcap, forward": 1.0,
    "bf16 causal + softcap, forward+backward": 1.1,
    "bf16 non-causal with statistics, forward": 1.1,
}

MEMORY_PROBE = """
import json, sys, time, torch, attnscale
def status_mib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024
B, H, L, D, left, threads = (int(x) for x in sys.argv[1:7])
torch.set_num_threads(threads)
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(3))
opts = dict(is_causal=True, softcap=30.0, window=(left, 0), backend="fused")
warm = [t.detach()[..., :256, :].clone().requires_grad_() for t in (q, k, v)]
attnscale.scaled_dot_product_attention(*warm, **opts).sum().backward()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM)
before = status_mib("VmRSS:")
start = time.perf_counter()
attnscale.scaled_dot_product_attention(q, k, v, **opts).sum().backward()
seconds = time.perf_counter() - start
print(json.dumps({"growth_mib": status_mib("VmHWM:") - before, "seconds": seconds}))
"""


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of every run of each function, round-robin after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def ratio(times: dict[str, list[float]], name: str, base: str) -> float:
    return statistics.median(a / b for a, b in zip(times[name], times[base]))


def backward_of(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        leaves = [t.detach().requires_grad_() for t in inputs]
        torch.autograd.grad(fn(*leaves).sum(), leaves)

    return run


def _inputs(L: int, D: int, H: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=gen) for _ in range(3))  # (B, H, L, D)
    qd = torch.randn(1, H, 1, D, generator=gen)  # one query against S = 4 L keys
    kd, vd = (torch.randn(1, H, 4 * L, D, generator=gen) for _ in range(2))
    return dict(q=q, k=k, v=v, qd=qd, kd=kd, vd=vd, qb=q.bfloat16(), kb=k.bfloat16(), vb=v.bfloat16(), qh=q.half(), kh=k.half(), vh=v.half())


# case -> (the inputs it runs on, its options, the largest |error| allowed against the math backend)
CHECKED = {
    "causal, no features (fused forced)": ("qkv", dict(is_causal=True, backend="fused"), 1e-4),
    "causal + softcap, forward": ("qkv", dict(is_causal=True, softcap=SOFTCAP), 1e-4),
    "causal + ALiBi, forward": ("qkv", dict(is_causal=True, alibi=True), 1e-4),
    "causal + softcap, forward+backward": ("qkv", dict(is_causal=True, softcap=SOFTCAP), 1e-4),
    "non-causal with statistics, forward": ("qkv", dict(return_stats=True), 1e-4),
    "decoding (L = 1, S = 4 L) with softcap": ("qd,kd,vd", dict(softcap=SOFTCAP), 1e-4),
    "bf16 causal + softcap, forward": ("qb,kb,vb", dict(is_causal=True, softcap=SOFTCAP), 3e-2),
    "fp16 causal + softcap, forward": ("qh,kh,vh", dict(is_causal=True, softcap=SOFTCAP), 4e-3),
    "bf16 causal + softcap, forward+backward": ("qb,kb,vb", dict(is_causal=True, softcap=SOFTCAP), 3e-2),
    "bf16 non-causal with statistics, forward": ("qb,kb,vb", dict(return_stats=True), 3e-2),
}
CHECK_ROWS = 64  # query rows at each end of the sequence checked against the math backend


def output_errors(L: int, D: int, names: Sequence[str], H: int = 8) -> dict[str, float]:
    """Each case's largest |error| against the math backend (the same call on the first and last
    CHECK_ROWS query rows; causal ones against the keys up to the last of them, bottom-right
    aligned, so that each row sits at its own position and sees the keys it sees in the full call),
    so that a fast wrong kernel cannot pass the benchmark."""
    t = _inputs(L, D, H)
    ours = attnscale.scaled_dot_product_attention
    errors = {}
    with torch.no_grad():
        for name, (operands, options, _) in CHECKED.items():
            if name not in names:
                continue
            q, k, v = (t[n] for n in (("q", "k", "v") if operands == "qkv" else operands.split(",")))
            options = dict(options)
            if options.pop("alibi", False):
                options["alibi_slopes"] = attnscale.alibi_slopes(H)
            result = ours(q, k, v, **options)
            out = result[0] if isinstance(result, tuple) else result
            worst = 0.0
            rows = q.shape[-2]
            for lo, hi in ((0, min(CHECK_ROWS, rows)), (max(0, rows - CHECK_ROWS), rows)):
                keys = hi if options.get("is_causal") else k.shape[-2]  # the keys these rows can see
                reference = {**options, "backend": "math"}
                if options.get("is_causal"):
                    reference["causal_alignment"] = "bottom_right"
                want = ours(q[..., lo:hi, :], k[..., :keys, :], v[..., :keys, :], **reference)
                want = want[0] if isinstance(want, tuple) else want  # row j sits at position lo + j, as in the full call (ALiBi too)
                worst = max(worst, (out[..., lo:hi, :].float() - want.float()).abs().max().item())
            errors[name] = worst
    return errors


def cases(L: int, D: int, H: int = 8) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """case -> (torch on the plain problem, attnscale on the case)."""
    t = _inputs(L, D, H)
    q, k, v, qd, kd, vd, qb, kb, vb, qh, kh, vh = (t[n] for n in ("q", "k", "v", "qd", "kd", "vd", "qb", "kb", "vb", "qh", "kh", "vh"))
    slopes = attnscale.alibi_slopes(H)
    ours = attnscale.scaled_dot_product_attention
    torch_causal = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return {
        "causal, no features (fused forced)": (torch_causal, lambda: ours(q, k, v, is_causal=True, backend="fused")),
        "causal + softcap, forward": (torch_causal, lambda: ours(q, k, v, is_causal=True, softcap=SOFTCAP)),
        "causal + ALiBi, forward": (torch_causal, lambda: ours(q, k, v, is_causal=True, alibi_slopes=slopes)),
        "causal + softcap, forward+backward": (
            backward_of(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), (q, k, v)),
            backward_of(lambda a, b, c: ours(a, b, c, is_causal=True, softcap=SOFTCAP), (q, k, v)),
        ),
        "non-causal with statistics, forward": (
            lambda: F.scaled_dot_product_attention(q, k, v),
            lambda: ours(q, k, v, return_stats=True),
        ),
        "decoding (L = 1, S = 4 L) with softcap": (
            lambda: F.scaled_dot_product_attention(qd, kd, vd),
            lambda: ours(qd, kd, vd, softcap=SOFTCAP),
        ),
        "bf16 causal + softcap, forward": (
            lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True),
            lambda: ours(qb, kb, vb, is_causal=True, softcap=SOFTCAP),
        ),
        "fp16 causal + softcap, forward": (
            lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True),
            lambda: ours(qh, kh, vh, is_causal=True, softcap=SOFTCAP),
        ),
        "bf16 causal + softcap, forward+backward": (
            backward_of(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), (qb, kb, vb)),
            backward_of(lambda a, b, c: ours(a, b, c, is_causal=True, softcap=SOFTCAP), (qb, kb, vb)),
        ),
        "bf16 non-causal with statistics, forward": (
            lambda: F.scaled_dot_product_attention(qb, kb, vb),
            lambda: ours(qb, kb, vb, return_stats=True),
        ),
    }


def selected(words: Sequence[str] | None) -> list[str]:
    """The cases whose name contains one of ``words`` (all without words), in the table's order."""
    return [name for name in CHECKED if not words or any(w in name for w in words)]


def speed(L: int, D: int, threads: int, repeats: int, names: Sequence[str]) -> list[dict]:
    torch.set_num_threads(threads)
    rows = []
    for name, (base, mine) in cases(L, D).items():
        if name not in names:
            continue
        grad = "backward" in name
        with torch.set_grad_enabled(grad):
            times = interleaved({"torch": base, "attnscale": mine}, repeats)
        ran = attnscale.last_backend()
        rows.append(
            {
                "case": name,
                "L": L,
                "D": D,
                "threads": threads,
                "backend": ran,
                "ratio": ratio(times, "attnscale", "torch"),
                "target": TARGETS[name],
                "torch_s": statistics.median(times["torch"]),
                "attnscale_s": statistics.median(times["attnscale"]),
                "times": times,
            }
        )
    return rows


def window_row(threads: int, repeats: int, L: int = 8192, D: int = 64) -> dict:
    """(1024, 0) window at L = 8192 against torch's causal kernel: the window sees ~1024 keys per row
    where causality sees ~L/2, so it should be faster in proportion."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, D, generator=gen) for _ in range(3))
    with torch.no_grad():
        times = interleaved(
            {
                "torch causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "attnscale window": lambda: attnscale.scaled_dot_product_attention(q, k, v, is_causal=True, window=WINDOW),
            },
            repeats,
        )
    left = WINDOW[0]
    seen_window = sum(min(i, left) + 1 for i in range(L))
    seen_causal = L * (L + 1) // 2
    return {
        "L": L,
        "D": D,
        "threads": threads,
        "ratio": ratio(times, "attnscale window", "torch causal"),
        "key_share": seen_window / seen_causal,
        "times": times,
    }


def gemm_peak(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a float32 n x n x n matmul, the machine's practical peak at this thread count."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_time(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memory_row(L: int, D: int, threads: int) -> dict:
    cmd = [sys.executable, "-c", MEMORY_PROBE, *map(str, (1, 8, L, D, WINDOW[0], threads))]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {"L": L, "D": D, "window": list(WINDOW), **json.loads(done.stdout.strip().splitlines()[-1])}


def tanh_row(repeats: int) -> dict:
    """Nanoseconds per element of the kernel's float32 tanh (the softcap's) and of torch.tanh, one
    thread, on 2^16 values inside |x| < 0.625 (the polynomial piece) and in [0.7, 3] (the exp piece)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    n, inner = 1 << 16, 200
    inputs = {"near": torch.rand(n, generator=gen) * 1.2 - 0.6, "far": torch.rand(n, generator=gen) * 2.3 + 0.7}
    ext = kernels.load()

    def loop(fn: Callable, x: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for _ in range(inner):
                fn(x)

        return run

    fns = {f"{name} {label}": loop(fn, x) for label, x in inputs.items() for name, fn in (("kernel", ext.tanh), ("torch", torch.tanh))}
    times = interleaved(fns, repeats)
    return {name: statistics.median(t) / inner / n * 1e9 for name, t in times.items()}


VARLEN_LENGTHS = (32, 1024)  # sequence lengths drawn uniformly in this range


VARLEN_ERROR = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # largest |error| against torch per sequence


def varlen_row(threads: int, repeats: int, n_seq: int = 32, dtype: torch.dtype = torch.float32) -> dict:
    """Packed causal attention over ``n_seq`` sequences of random lengths (H = 8, D = 64, forward,
    float32 or bfloat16): varlen_attention's one kernel call and its per-sequence path
    (backend="tiled", the eager fallback), against torch's SDPA called once per sequence (the plain
    problem, causal, same dtype)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(VARLEN_LENGTHS[0], VARLEN_LENGTHS[1] + 1, (n_seq,), generator=gen).tolist()
    total, H, D = sum(lengths), 8, 64
    q, k, v = (torch.randn(total, H, D, generator=gen).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def per_sequence_torch() -> None:
        for b in range(n_seq):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            F.scaled_dot_product_attention(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)

    with torch.no_grad():  # the packed kernel's output, checked against torch once per sequence first
        packed = attnscale.varlen_attention(q, k, v, cu, cu, is_causal=True)
        for b in range(n_seq):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            want = F.scaled_dot_product_attention(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)[0].transpose(0, 1)
            err = (packed[rows].float() - want.float()).abs().max().item()
            if not err <= VARLEN_ERROR[dtype]:
                raise SystemExit(f"bench_fused: wrong varlen output for sequence {b}: max |error| {err:.3g} > {VARLEN_ERROR[dtype]:g}; nothing timed")
    fns = {
        "packed kernel": lambda: attnscale.varlen_attention(q, k, v, cu, cu, is_causal=True),
        "per-sequence tiled": lambda: attnscale.varlen_attention(q, k, v, cu, cu, is_causal=True, backend="tiled"),
        "torch per sequence": per_sequence_torch,
    }
    times = {name: statistics.median(t) for name, t in interleaved(fns, repeats).items()}
    return {"threads": threads, "sequences": n_seq, "tokens": total, "dtype": str(dtype).removeprefix("torch."), "seconds": times,
            "ratio": {name: times[name] / times["torch per sequence"] for name in fns}}


HALF_CASES = ("bf16 causal + softcap, forward", "fp16 causal + softcap, forward", "bf16 non-causal with statistics, forward")
HALF_PATHS = {"float32 tiles": "0", "16-bit products": "1"}  # path -> ATTNSCALE_HALF_PRODUCTS


def _under(value: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn run with ATTNSCALE_HALF_PRODUCTS=value (read on every call), restored after."""
    def run() -> object:
        with mock.patch.dict(os.environ, {"ATTNSCALE_HALF_PRODUCTS": value}):
            return fn()

    return run


def half_paths() -> dict[str, str]:
    """HALF_PATHS less the 16-bit products where this torch lacks oneMKL's (bfloat16 and float16)."""
    ext = kernels.load()
    return {p: v for p, v in HALF_PATHS.items() if v == "0" or (ext.half_gemm(1) and ext.half_gemm(2))}


def half_paths_wrong(L: int, D: int, paths: dict[str, str]) -> list[str]:
    """The 16-bit forward cases whose output, taken each of ``paths``, is off the math backend."""
    wrong = []
    for path, value in paths.items():
        for name, err in _under(value, lambda: output_errors(L, D, HALF_CASES))().items():
            if not err <= CHECKED[name][2]:  # NaN fails too
                wrong.append(f"L={L} D={D} {name} with {path}: max |error| {err:.3g} > {CHECKED[name][2]:g}")
    return wrong


def half_paths_rows(L: int, D: int, threads: int, repeats: int, paths: dict[str, str]) -> list[dict]:
    """The 16-bit forward cases taken each way the kernel can take 16-bit inputs (float32 tiles;
    the inputs as they are, through brgemm or oneMKL's products), interleaved with torch's SDPA on
    the plain problem in the same dtype: which path is faster on this CPU (outputs checked first
    by :func:`half_paths_wrong`)."""
    torch.set_num_threads(threads)
    rows = []
    for name, (base, mine) in cases(L, D).items():
        if name not in HALF_CASES:
            continue
        with torch.no_grad():
            times = interleaved({"torch": base, **{p: _under(v, mine) for p, v in paths.items()}}, repeats)
        rows.append({"case": name, "L": L, "D": D, "threads": threads, "ratio": {p: ratio(times, p, "torch") for p in paths}})
    return rows


BLOCK_SHAPES = ((64, 256), (128, 256), (256, 256), (128, 512), (256, 512))


def blocks_rows(threads: int, repeats: int, dtype: torch.dtype = torch.float32) -> list[dict]:
    """The kernel's forward at several (query rows x keys) tile shapes, against torch's SDPA on the
    plain problem in the same dtype: causal at L = 8192, D = 128 and L = 4096, D = 64 (bfloat16:
    with softcap, as its target case); non-causal with statistics at L = 2048, D = 128 and
    L = 4096, D = 64."""
    from attnscale.kernels.fused import fused_attention
    from attnscale.score import ScorePath

    torch.set_num_threads(threads)
    rows = []
    for L, D, causal in ((8192, 128, True), (4096, 64, True), (2048, 128, False), (4096, 64, False)):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, L, D, generator=gen).to(dtype) for _ in range(3))
        softcap = SOFTCAP if causal and dtype != torch.float32 else None
        path = ScorePath(scale=D**-0.5, causal=causal, softcap=softcap)
        fns: dict[str, Callable[[], object]] = {"torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
        for bq, bk in BLOCK_SHAPES:
            fns[f"{bq}x{bk}"] = lambda bq=bq, bk=bk: fused_attention(q, k, v, path=path, return_stats=not causal, block_q=bq, block_k=bk)
        with torch.no_grad():
            # Every shape's output against the math backend in float32 first (CHECKED's bounds).
            want = attnscale.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, softcap=softcap, backend="math")
            for name, fn in fns.items():
                if name != "torch":
                    out = fn()
                    err = ((out[0] if isinstance(out, tuple) else out).float() - want).abs().max().item()
                    if not err <= (1e-4 if dtype == torch.float32 else 3e-2):
                        raise SystemExit(f"--blocks: {name} at L {L}, D {D} is off by {err:.3g}")
            times = interleaved(fns, repeats)
        rows.append({"threads": threads, "L": L, "D": D, "causal": causal, "dtype": str(dtype).removeprefix("torch."), "softcap": softcap,
                     "ratio": {name: ratio(times, name, "torch") for name in fns if name != "torch"}})
    return rows


def markdown(result: dict) -> str:
    """The docs' table from a ``--json`` file: per case, the range of the ratios over the cells
    and how many meet the target, at one thread and at the default thread count; then the window,
    varlen, memory and GFLOP/s lines."""
    default = result["default_threads"]
    counts = sorted({r["threads"] for r in result["rows"]})
    label = {t: ("one thread" if t == 1 else f"{t} threads") + (" (the default)" if t == default else "") for t in counts}
    shapes = f"L {'/'.join(str(x) for x in sorted({r['L'] for r in result['rows']}))} x D {'/'.join(str(x) for x in sorted({r['D'] for r in result['rows']}))}"
    repeats = len(result["rows"][0]["times"]["torch"]) if result["rows"] else 0
    lines = [
        f"One run of `{result.get('command', 'python benchmarks/bench_fused.py --json benchmarks/recorded/fused.json')}` at commit {result.get('commit', 'unknown')} "
        f"on {result.get('cpu', 'an unrecorded CPU')}: B = 1, H = 8, fp32 unless stated, {shapes}, each cell the median of {repeats} "
        "interleaved per-repeat ratios to torch's SDPA on the plain problem of the same shape. Range over the cells, and how many meet "
        "the kernel's target:",
        "",
        "| case | target | " + " | ".join(label[t] for t in counts) + " |",
        "|---|---|" + "---|" * len(counts),
    ]
    for case, target in TARGETS.items():
        if not any(r["case"] == case for r in result["rows"]):
            continue  # a case the recorded run did not have
        cells = []
        for t in counts:
            ratios = [r["ratio"] for r in result["rows"] if r["case"] == case and r["threads"] == t]
            met = sum(x <= target for x in ratios)
            span = f"{min(ratios):.2f}x" if len(ratios) == 1 else f"{min(ratios):.2f}-{max(ratios):.2f}x"
            cells.append(f"{span} ({met} of {len(ratios)})")
        lines.append(f"| {case} | {target:.2f}x | " + " | ".join(cells) + " |")
    out = ["\n".join(lines), ""]
    for w in result.get("windows", []):
        out.append(f"- window {tuple(w['window'] if 'window' in w else WINDOW)} at L = {w['L']}, {w['threads']} thread{'s' * (w['threads'] != 1)}: "
                   f"{w['ratio']:.2f}x torch's causal time, seeing {w['key_share']:.2f} of its keys")
    for r in result.get("varlen", []):
        dtype = "" if r.get("dtype", "float32") == "float32" else f" {r['dtype']}"  # runs before bfloat16's row had float32 only
        out.append(f"- varlen{dtype}, {r['threads']} thread{'s' * (r['threads'] != 1)}, {r['sequences']} causal sequences ({r['tokens']} tokens): packed kernel "
                   f"{r['ratio']['packed kernel']:.2f}x torch's SDPA once per sequence, per-sequence tiled path {r['ratio']['per-sequence tiled']:.2f}x")
    for t in counts:
        g = [r for r in result["rows"] if r["threads"] == t and "gflops" in r]
        if g:
            out.append(f"- causal GFLOP/s at {t} thread{'s' * (t != 1)}: fused {min(r['gflops'] for r in g):.0f}-{max(r['gflops'] for r in g):.0f}, "
                       f"torch {min(r['torch_gflops'] for r in g):.0f}-{max(r['torch_gflops'] for r in g):.0f}, GEMM peak {result['peaks'][str(t)] if str(t) in result['peaks'] else result['peaks'][t]:.0f}")
    if "memory" in result:
        m = result["memory"]
        out.append(f"- memory: forward+backward at L = S = {m['L']}, D = {m['D']}, softcap, window {tuple(m['window'])}: {m['growth_mib']:.0f} MiB")
    if "tanh" in result:
        r = result["tanh"]
        out.append(f"- tanh, one thread, ns per float32: |x| < 0.625 {r['kernel near']:.2f} (torch.tanh {r['torch near']:.2f}), "
                   f"|x| in [0.7, 3] {r['kernel far']:.2f} (torch.tanh {r['torch far']:.2f})")
    return "\n".join(out)


def _cells(result: dict) -> dict[str, float]:
    """Every timed ratio of a ``--json`` run by a name that is the same in every run of the bench."""
    cells = {f"{r['threads']}t L={r['L']} D={r['D']} {r['case']}": r["ratio"] for r in result.get("rows", [])}
    cells.update({f"{w['threads']}t window at L={w['L']}": w["ratio"] for w in result.get("windows", [])})
    for r in result.get("varlen", []):
        cells[f"{r['threads']}t varlen {r.get('dtype', 'float32')}, packed kernel"] = r["ratio"]["packed kernel"]
    if "tanh" in result:
        cells["1t tanh, abs(x) < 0.625, kernel / torch.tanh"] = result["tanh"]["kernel near"] / result["tanh"]["torch near"]
        cells["1t tanh, abs(x) in [0.7, 3], kernel / torch.tanh"] = result["tanh"]["kernel far"] / result["tanh"]["torch far"]
    return cells


def compare(results: Sequence[dict]) -> str:
    """Two commits' ``--json`` runs, cell by cell (the first commit named is "before"): each cell's
    ratios to torch on each side, and whether the two sides' ranges over their runs overlap (within
    run-to-run noise) or not, with the change of the medians. Runs of one commit are grouped."""
    by_commit: dict[str, list[dict[str, float]]] = {}
    cpus = {r.get("cpu", "an unrecorded CPU") for r in results}
    for r in results:
        by_commit.setdefault(r.get("commit", "unknown"), []).append(_cells(r))
    if len(by_commit) != 2:
        raise SystemExit(f"--compare: expected runs of exactly two commits, got {len(by_commit)} ({', '.join(by_commit)})")
    (before, old), (after, new) = by_commit.items()
    names = [n for n in old[0] if all(n in c for c in old + new)]
    lines = [
        f"{len(old)} run(s) at {before} against {len(new)} at {after} on {', '.join(sorted(cpus))}: each cell's ratios to torch "
        "(lower is faster); 'overlap' when the two sides' ranges meet (within run-to-run noise), else the change of the medians.",
        "",
        f"| cell | {before} | {after} | |",
        "|---|---|---|---|",
    ]
    apart = []
    for n in names:
        a, b = [c[n] for c in old], [c[n] for c in new]
        fmt = lambda xs: "/".join(f"{x:.3f}" for x in xs)  # noqa: E731
        if max(a) < min(b) or max(b) < min(a):
            change = statistics.median(b) / statistics.median(a) - 1
            verdict = f"{'slower' if change > 0 else 'faster'} by {abs(change):.1%}"
            apart.append(f"{n}: {verdict}")
        else:
            verdict = "overlap"
        lines.append(f"| {n} | {fmt(a)} | {fmt(b)} | {verdict} |")
    changes = sorted(statistics.median(c[n] for c in new) / statistics.median(c[n] for c in old) - 1 for n in names)
    lines += [
        "",
        f"{len(names) - len(apart)} of {len(names)} cells overlap" + (": apart, " + "; ".join(apart) if apart else "."),
        f"Change of the medians over the cells: median {statistics.median(changes):+.1%}, from {changes[0]:+.1%} to {changes[-1]:+.1%}"
        + ("" if min(len(old), len(new)) > 1 else " (one run a side: no run-to-run range, so every cell reads as apart)."),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 2048, D = 64 only, 3 repeats, no memory run")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts (default: torch's default and 1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    mode = parser.add_mutually_exclusive_group()  # each runs alone: none is silently dropped for another
    mode.add_argument("--tanh", action="store_true", help="only time the kernel's tanh against torch.tanh")
    mode.add_argument("--varlen", action="store_true", help="only time packed sequences (varlen_attention)")
    mode.add_argument("--markdown", metavar="JSON", help="print the docs' table from a --json file and exit")
    mode.add_argument("--compare", nargs="+", metavar="JSON", help="compare --json runs of two commits cell by cell (the first commit named is 'before') and exit")
    mode.add_argument("--blocks", action="store_true", help="only compare the kernel's tile shapes (float32, and bfloat16 with a softcapped causal case)")
    mode.add_argument("--half-paths", action="store_true", help="only the 16-bit forward cases, float32 tiles against 16-bit products (ATTNSCALE_HALF_PRODUCTS=0 / 1)")
    mode.add_argument("--cases", nargs="+", metavar="WORD", help="only the cases whose name contains one of these words (e.g. bf16 decoding); no tanh, varlen, window or memory rows")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return 0
    if args.compare:
        runs = []
        for path in args.compare:
            with open(path) as f:
                runs.append(json.load(f))
        print(compare(runs))
        return 0
    names = selected(args.cases)
    if not names:
        parser.error(f"--cases: expected words found in a case's name, got {args.cases}; the cases: {'; '.join(CHECKED)}")
    if not kernels.available():
        print(f"bench_fused: the compiled kernel is unavailable ({kernels.unavailable_reason()})", file=sys.stderr)
        return 1
    default_threads = torch.get_num_threads()
    threads = args.threads or sorted({default_threads, 1}, reverse=True)
    lengths, dims, repeats = ([2048], [64], 3) if args.quick else (args.lengths, args.dims, args.repeats)
    result: dict = {"schema": SCHEMA, "default_threads": default_threads, "rows": [], "windows": [], "peaks": {}}
    result["command"] = " ".join(["python benchmarks/bench_fused.py", *(sys.argv[1:] if argv is None else argv)])
    if args.half_paths:
        result.update(describe())
        result["half_paths"] = []
        print(f"CPU: {result['cpu']}, torch {result['torch']}, commit {result['commit']}", flush=True)
        paths = half_paths()
        wrong = [line for L in lengths for D in dims for line in half_paths_wrong(L, D, paths)]
        if wrong:
            print("bench_fused: wrong outputs, nothing timed:\n  " + "\n  ".join(wrong), file=sys.stderr)
            return 1
        for t in threads:
            for L in lengths:
                for D in dims:
                    for r in half_paths_rows(L, D, t, repeats, paths):
                        result["half_paths"].append(r)
                        cells = ", ".join(f"{path} {x:.2f}x" for path, x in r["ratio"].items())
                        print(f"threads={t} L={L:5d} D={D:3d}  {r['case']:40s} {cells}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if args.blocks:
        for t, dtype in itertools.product(threads, (torch.float32, torch.bfloat16)):
            for r in blocks_rows(t, repeats, dtype):
                what = ("causal" + (" + softcap" if r["softcap"] else "")) if r["causal"] else "non-causal + statistics"
                cells = ", ".join(f"{name} {x:.2f}x" for name, x in r["ratio"].items())
                print(f"threads={t} {r['dtype']:8s} L={r['L']:5d} D={r['D']:3d} {what}: {cells}", flush=True)
        return 0
    if not args.cases:  # the tanh and packed sequences: with --cases, only the cases chosen
        r = result["tanh"] = tanh_row(repeats)
        print(f"threads=1 tanh, ns per float32: |x| < 0.625 kernel {r['kernel near']:.2f}, torch {r['torch near']:.2f}; "
              f"|x| in [0.7, 3] kernel {r['kernel far']:.2f}, torch {r['torch far']:.2f}", flush=True)
        if args.tanh:
            return 0
        result["varlen"] = []
        for t, dtype in itertools.product(threads, (torch.float32, torch.bfloat16)):
            r = varlen_row(t, repeats, dtype=dtype)
            result["varlen"].append(r)
            print(f"threads={t} varlen {r['dtype']}, {r['sequences']} causal sequences of {VARLEN_LENGTHS[0]}-{VARLEN_LENGTHS[1]} tokens ({r['tokens']} in all), "
                  f"against torch's SDPA once per sequence: packed kernel {r['ratio']['packed kernel']:.2f}x, "
                  f"per-sequence tiled path {r['ratio']['per-sequence tiled']:.2f}x", flush=True)
        if args.varlen:
            return 0
    run = describe()
    result.update(run)
    print(f"CPU: {run['cpu']}, torch {run['torch']}, commit {run['commit']}", flush=True)
    result["output_errors"], wrong = {}, []
    for L in lengths:  # every timed case's output, once per shape, against the math backend
        for D in dims:
            for name, err in output_errors(L, D, names).items():
                result["output_errors"][f"L={L} D={D} {name}"] = err
                if not err <= CHECKED[name][2]:  # NaN fails too
                    wrong.append(f"L={L} D={D} {name}: max |error| {err:.3g} > {CHECKED[name][2]:g}")
    if wrong:
        print("bench_fused: wrong outputs, nothing timed:\n  " + "\n  ".join(wrong), file=sys.stderr)
        return 1
    print(f"outputs checked against the math backend: largest |error| {max(result['output_errors'].values()):.2g}", flush=True)
    for t in threads:
        result["peaks"][t] = gemm_peak(t)
        for L in lengths:
            for D in dims:
                for row in speed(L, D, t, repeats, names):
                    result["rows"].append(row)
                    met = "met" if row["ratio"] <= row["target"] else "MISSED"
                    print(f"threads={t} L={L:5d} D={D:3d}  {row['case']:40s} {row['ratio']:5.2f}x (target {row['target']:.2f}x, {met}; ran {row['backend']})", flush=True)
        causal = [r for r in result["rows"] if r["threads"] == t and r["case"] == "causal, no features (fused forced)"]
        for r in causal:  # causal attention: L (L + 1) / 2 visible pairs per head, 2 D flops each for q.k and for p v
            flops = 8 * (r["L"] * (r["L"] + 1) // 2) * 4 * r["D"]
            r["gflops"] = flops / r["attnscale_s"] / 1e9
            r["torch_gflops"] = flops / r["torch_s"] / 1e9
            print(f"threads={t} L={r['L']:5d} D={r['D']:3d}  causal GFLOP/s: fused {r['gflops']:.1f}, torch {r['torch_gflops']:.1f}, GEMM peak {result['peaks'][t]:.1f}")
        if not (args.quick or args.cases):
            w = window_row(t, repeats)
            result["windows"].append(w)
            print(f"threads={t} window {WINDOW} at L = {w['L']}: {w['ratio']:.2f}x torch's causal time, seeing {w['key_share']:.2f} of its keys")
    if args.json:  # before the memory run, which a crash of its subprocess must not cost
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not (args.quick or args.no_memory or args.cases):
        m = memory_row(16384, 64, default_threads)
        result["memory"] = m
        print(f"memory: forward+backward at L = S = 16384, D = 64, softcap, window {WINDOW}: {m['growth_mib']:.0f} MiB in {m['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
