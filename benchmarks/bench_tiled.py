"""Tiled online-softmax attention against torch's SDPA on CPU: speed, block sizes and peak memory.

Speed: for each L in {2048, 4096, 8192} and D in {64, 128} (B = 1, H = 8, L = S), the tiled
backend with causal masking *and* softcap (a feature torch lacks) is timed against torch's fused
SDPA on the same problem without the softcap; the tiled backend without softcap is timed too, to
show what the feature costs. Forward alone (no grad) and forward + backward. Each time is the
median of ``--repeats`` runs made in the same process, interleaved, so that load from other
processes falls on both sides; each ratio is the median of the per-repeat ratios. Targets:
tiled / SDPA <= 1.5 (forward) and <= 2 (forward + backward).

Memory: peak RSS growth (VmHWM after a reset, minus VmRSS before) of forward + backward at B = 1,
H = 8, D = 64, L = S = 16384 with softcap and a sliding window, measured in a fresh subprocess
(target < 1 GiB; the (L, S) float32 score matrix of all heads would be 8 GiB).

    python benchmarks/bench_tiled.py --quick             # one small size, a few seconds
    python benchmarks/bench_tiled.py --json results.json # full table and memory
    python benchmarks/bench_tiled.py --sweep-blocks      # block-size exploration at L = 4096
    python benchmarks/bench_tiled.py --offset running-max  # the kernel without its static offset
    python benchmarks/bench_tiled.py --exp-probe         # ATen exp / exp2 throughput by argument range
    python benchmarks/bench_tiled.py --feature-probe     # causal ALiBi and saturated rows
    python benchmarks/bench_tiled.py --op-probe          # the single ops behind the kernel's design
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from attnscale import ScorePath, tiled
from attnscale.constants import EXP_FLOOR
from attnscale.tiled import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, tiled_attention

SCHEMA = "attnscale.bench_tiled/1"
SOFTCAP = 30.0
MEMORY_WINDOW = (1024, 0)

MEMORY_PROBE = """
import json, sys, time, torch
from attnscale import ScorePath
from attnscale.tiled import tiled_attention
def status_mib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024
B, H, L, D, left, threads = (int(x) for x in sys.argv[1:7])
torch.set_num_threads(threads)
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, H, L, D, generator=gen).requires_grad_() for _ in range(3))
path = ScorePath(scale=D ** -0.5, softcap=30.0, causal=True, window=(left, 0))
warm = [t.detach()[..., :256, :].clone().requires_grad_() for t in (q, k, v)]
tiled_attention(*warm, path=path)[0].sum().backward()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM): ru_maxrss would include the parent's peak, inherited over exec
before = status_mib("VmRSS:")
start = time.perf_counter()
out, _ = tiled_attention(q, k, v, path=path)
out.sum().backward()
seconds = time.perf_counter() - start
after = status_mib("VmHWM:")
print(json.dumps({"growth_mib": after - before, "peak_mib": after, "seconds": seconds}))
"""


def _interleaved_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of every run of each function, interleaved round-robin after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _median_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, runs interleaved round-robin after one warm-up each."""
    return {name: statistics.median(ts) for name, ts in _interleaved_times(fns, repeats).items()}


def _median_ratio(times: dict[str, list[float]], name: str, base: str) -> float:
    """Median of the per-repeat ratios: each compares two runs made moments apart, so a change in
    machine load between repeats cancels (as in bench_sdpa.py)."""
    return statistics.median(a / b for a, b in zip(times[name], times[base]))


def _inputs(L: int, D: int, H: int, *, grad: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=gen).requires_grad_(grad) for _ in range(3))  # (B, H, L, D)
    return q, k, v


def _forward_backward(fn: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        out = fn()
        torch.autograd.grad(out.sum(), inputs)

    return run


def speed_row(L: int, D: int, H: int, repeats: int, block_q: int, block_k: int, flex: bool) -> dict:
    path_cap = ScorePath(scale=D**-0.5, softcap=SOFTCAP, causal=True)
    path_plain = ScorePath(scale=D**-0.5, causal=True)
    row: dict = {"L": L, "D": D, "H": H, "block_q": block_q, "block_k": block_k}
    for mode in ("forward", "forward_backward"):
        grad = mode == "forward_backward"
        q, k, v = _inputs(L, D, H, grad=grad)
        fns: dict[str, Callable[[], torch.Tensor]] = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "tiled_softcap": lambda: tiled_attention(q, k, v, path=path_cap, block_q=block_q, block_k=block_k)[0],
            "tiled_plain": lambda: tiled_attention(q, k, v, path=path_plain, block_q=block_q, block_k=block_k)[0],
        }
        if flex and not grad:  # torch 2.13 raises for flex_attention backward on CPU
            fns["flex_softcap"] = _flex_softcap(q, k, v, D)
        if grad:
            runs = {name: _forward_backward(fn, (q, k, v)) for name, fn in fns.items()}
            times = _interleaved_times(runs, repeats)
        else:
            with torch.no_grad():
                times = _interleaved_times(fns, repeats)
        for name, seconds in times.items():
            row[f"{mode}.{name}_s"] = statistics.median(seconds)
            row[f"{mode}.{name}_times_s"] = seconds
            if name != "sdpa":
                row[f"{mode}.{name}_ratio"] = _median_ratio(times, name, "sdpa")
    return row


def _flex_softcap(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, D: int) -> Callable[[], torch.Tensor]:
    """torch's flex_attention (eager) with the same causal softcap, as a score_mod and block mask.

    Forward only: on CPU, torch 2.13's flex_attention raises NotImplementedError for backward.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def score_mod(score, b, h, i, j):
        capped = torch.tanh(score / SOFTCAP) * SOFTCAP
        return torch.where(j <= i, capped, float("-inf"))

    L = q.shape[-2]
    block_mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, L, L, device="cpu")
    return lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=D**-0.5)


def compile_probe(repeats: int) -> dict:
    """One online-softmax tile update (softcap logits, max, exp, sum, rescale, P V) for H = 8,
    128 x 256 tiles, D = 64: eager against ``torch.compile`` (inductor), and the compile time."""
    path = ScorePath(scale=1.0, softcap=SOFTCAP)

    def step(q_blk, k_blk, v_blk, m, l, acc):
        s = path.logits(q_blk @ k_blk.transpose(-1, -2), q_pos=None, k_pos=None)  # (1, H, Lb, Sb)
        m_new = torch.maximum(m, s.amax(-1))
        m_ref = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha = torch.exp(m - m_ref)
        p = torch.exp(s - m_ref.unsqueeze(-1))
        return m_new, alpha * l + p.sum(-1), acc * alpha.unsqueeze(-1) + p @ v_blk

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, generator=gen) for n in (128, 256, 256))
    m, l, acc = torch.full((1, 8, 128), float("-inf")), torch.zeros(1, 8, 128), torch.zeros(1, 8, 128, 64)
    with torch.no_grad():
        start = time.perf_counter()
        compiled = torch.compile(step, dynamic=False)
        compiled(q, k, v, m, l, acc)
        compile_s = time.perf_counter() - start
        times = _median_times({"eager": lambda: step(q, k, v, m, l, acc), "compiled": lambda: compiled(q, k, v, m, l, acc)}, repeats)
    return {"compile_s": compile_s, "eager_tile_s": times["eager"], "compiled_tile_s": times["compiled"]}


EXP_RANGES = {  # name -> (low end of a uniform argument range, share of -inf entries)
    "[-60, 0]": (-60.0, 0.0),
    "[-87, 0]": (-87.0, 0.0),
    "[-100, 0]": (-100.0, 0.0),
    "[-125, 0]": (-125.0, 0.0),
    "[-200, 0]": (-200.0, 0.0),
    "[-60, 0], 1/3 -inf": (-60.0, 1 / 3),
}


def exp_probe(repeats: int) -> dict:
    """Elements per second of ``torch.exp`` and ``torch.exp2`` on 8 x 128 x 256 float32 (one score
    tile of 8 heads) by argument range: the measurement behind the tiled kernel's exp floor."""
    gen = torch.Generator().manual_seed(0)
    n = 8 * 128 * 256
    out = torch.empty(n)
    rows = {}
    for name, (low, share_inf) in EXP_RANGES.items():
        x = torch.rand(n, generator=gen) * low
        x[torch.rand(n, generator=gen) < share_inf] = float("-inf")
        times = _median_times({"exp": lambda: torch.exp(x, out=out), "exp2": lambda: torch.exp2(x, out=out)}, repeats)
        rows[name] = {fn: n / t / 1e9 for fn, t in times.items()}  # G elements / s
    return rows


def feature_probe(repeats: int) -> dict:
    """Causal ALiBi (Press et al.'s slopes for 8 heads), and plain causal attention on saturated
    inputs (q and k times 4: logits of std 16), tiled against torch's SDPA on the same causal
    problem without ALiBi, L = 4096, D = 64, forward. Both run the running max (ALiBi has no
    static offset; the saturated rows' bounds are past its limit), and far keys hit the exp floor."""
    from attnscale import alibi_slopes

    L, D = 4096, 64
    q, k, v = _inputs(L, D, 8, grad=False)
    q4, k4 = q * 4, k * 4
    path = ScorePath(scale=D**-0.5, causal=True)
    slopes = alibi_slopes(8)
    fns = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "tiled_alibi": lambda: tiled_attention(q, k, v, path=path, alibi_slopes=slopes),
        "sdpa_saturated": lambda: F.scaled_dot_product_attention(q4, k4, v, is_causal=True),
        "tiled_saturated": lambda: tiled_attention(q4, k4, v, path=path),
    }
    with torch.no_grad():
        times = _interleaved_times(fns, repeats)
    return {
        "L": L,
        "D": D,
        "alibi_ratio": _median_ratio(times, "tiled_alibi", "sdpa"),
        "saturated_ratio": _median_ratio(times, "tiled_saturated", "sdpa_saturated"),
        **{f"{name}_s": statistics.median(ts) for name, ts in times.items()},
    }


def op_probe(repeats: int) -> dict:
    """Milliseconds of the single ops behind the kernel's design, one thread, float32:

    * hiding keys of one 8 x 128 x 256 causal tile: ``masked_fill`` with a broadcast bool tile
      (causal, and random), against adding a 0/-inf tile and multiplying by a 1/0 tile;
    * ``p v`` of one such tile (``baddbmm_``, Dv = 64) with ordinary weights, every weight at the
      old exp floor 1.6e-38 (products below the normal range), and at the floor exp(EXP_FLOOR) = 1.1e-30;
    * the 272 q k^T tiles of a causal L = 4096, D = 64 call (128 x 256 tiles) reading k
      transposed, from one (n, D, S) copy of k^T, and from per-block copies.
    """
    gen = torch.Generator().manual_seed(0)
    H, Lb, Sb, D, L = 8, 128, 256, 64, 4096
    tile = torch.randn(H, Lb, Sb, generator=gen)
    work = torch.empty_like(tile)
    causal = torch.ones(Lb, Sb).tril().bool()
    random = torch.rand(Lb, Sb, generator=gen) > 0.5
    bias = torch.zeros(Lb, Sb).masked_fill(~causal, float("-inf"))
    weight = causal.float()
    v, acc = torch.randn(H, Sb, D, generator=gen), torch.zeros(H, Lb, D)
    weights = {"normal": torch.rand(H, Lb, Sb, generator=gen), "1.6e-38": torch.full((H, Lb, Sb), 1.6e-38)}
    floor = math.exp(EXP_FLOOR[torch.float32])
    weights[f"{floor:.1e}"] = torch.full((H, Lb, Sb), floor)
    q, k = (torch.randn(H, L, D, generator=gen) for _ in range(2))
    kt = k.transpose(1, 2).contiguous()
    kt_blocks = [kt[:, :, j : j + Sb].contiguous() for j in range(0, L, Sb)]
    buf = torch.empty(H, Lb, Sb)

    def qk_tiles(layout: str) -> None:
        for i0 in range(0, L, Lb):
            for b, j0 in enumerate(range(0, i0 + Lb, Sb)):
                rhs = {"transposed": lambda: k[:, j0 : j0 + Sb].transpose(1, 2), "one copy": lambda: kt[:, :, j0 : j0 + Sb]}
                torch.bmm(q[:, i0 : i0 + Lb], kt_blocks[b] if layout == "block copies" else rhs[layout](), out=buf)

    fns = {
        "hide: masked_fill causal": lambda: work.copy_(tile).masked_fill_(~causal, float("-inf")),
        "hide: masked_fill random": lambda: work.copy_(tile).masked_fill_(random, float("-inf")),
        "hide: add 0/-inf tile": lambda: work.copy_(tile).add_(bias),
        "hide: multiply 1/0 tile": lambda: work.copy_(tile).mul_(weight),
        "hide: copy alone": lambda: work.copy_(tile),
        **{f"p v: weights {name}": (lambda p=p: acc.baddbmm_(p, v)) for name, p in weights.items()},
        **{f"272 q k^T tiles: k {layout}": (lambda layout=layout: qk_tiles(layout)) for layout in ("transposed", "one copy", "block copies")},
    }
    with torch.no_grad():
        return {name: t * 1e3 for name, t in _median_times(fns, repeats).items()}


def memory_row(B: int, H: int, L: int, D: int, threads: int) -> dict:
    cmd = [sys.executable, "-c", MEMORY_PROBE, *map(str, (B, H, L, D, MEMORY_WINDOW[0], threads))]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    inputs_mib = 3 * B * H * L * D * 4 / 2**20
    return {
        "B": B,
        "H": H,
        "L": L,
        "D": D,
        "softcap": SOFTCAP,
        "window": list(MEMORY_WINDOW),
        "inputs_mib": inputs_mib,
        "score_matrix_mib": B * H * L * L * 4 / 2**20,
        **result,
    }


def _print_speed(rows: list[dict], offset: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tiled (causal + softcap, offset {offset}) vs torch SDPA (causal), medians, seconds and ratios")
    for col in ("L", "D", "mode", "sdpa", "tiled softcap", "ratio", "tiled plain", "ratio", "flex softcap", "ratio", "target"):
        table.add_column(col, justify="right")
    for row in rows:
        for mode, target in (("forward", 1.5), ("forward_backward", 2.0)):
            cells = [str(row["L"]), str(row["D"]), mode, f"{row[f'{mode}.sdpa_s']:.3f}"]
            for name in ("tiled_softcap", "tiled_plain", "flex_softcap"):
                if f"{mode}.{name}_s" in row:
                    cells += [f"{row[f'{mode}.{name}_s']:.3f}", f"{row[f'{mode}.{name}_ratio']:.2f}x"]
                else:
                    cells += ["-", "-"]
            met = row[f"{mode}.tiled_softcap_ratio"] <= target
            cells.append(f"<= {target}x: {'met' if met else 'not met'}")
            table.add_row(*cells)
    Console(width=200).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small size (L = 1024, D = 64), 3 repeats, no memory run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every timing")
    parser.add_argument("--block-q", type=int, default=DEFAULT_BLOCK_Q)
    parser.add_argument("--block-k", type=int, default=DEFAULT_BLOCK_K)
    parser.add_argument("--flex", action="store_true", help="also time torch's flex_attention (eager, forward only) with the same softcap")
    parser.add_argument("--sweep-blocks", action="store_true", help="forward ratios over block sizes at L = 4096, D = 64")
    parser.add_argument("--compile-probe", action="store_true", help="time one tile update eager vs torch.compile")
    parser.add_argument("--exp-probe", action="store_true", help="throughput of torch.exp and torch.exp2 by argument range")
    parser.add_argument("--op-probe", action="store_true", help="time the single ops behind the kernel's design (masking, weight floor, k^T layout)")
    parser.add_argument(
        "--feature-probe",
        action="store_true",
        help="forward ratios of causal ALiBi and of saturated causal attention (logits of std 16) at L = 4096, D = 64",
    )
    parser.add_argument(
        "--offset",
        choices=("auto", "running-max"),
        default="auto",
        help="auto: the kernel's choice (a static softmax offset where |logits| are bounded under 34.5, as for "
        "these standard-normal inputs); running-max: the online max everywhere, the path that inputs with larger "
        "norms (and ALiBi, float masks, statistics) take",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the L = 16384 memory run")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.offset == "running-max":
        tiled._OFFSET_LIMIT = {}  # no dtype qualifies: every query block keeps a running max

    result: dict = {
        "schema": SCHEMA,
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "offset": args.offset,
    }
    if args.exp_probe:
        result["exp_probe"] = exp_probe(max(args.repeats, 20))
        for name, row in result["exp_probe"].items():
            print(f"arguments {name:>20}: exp {row['exp']:.2f}, exp2 {row['exp2']:.2f} G elements/s")
    elif args.op_probe:
        result["op_probe"] = op_probe(max(args.repeats, 9))
        for name, ms in result["op_probe"].items():
            print(f"{name:>34}: {ms:8.3f} ms")
    elif args.feature_probe:
        probe = feature_probe(args.repeats)
        result["feature_probe"] = probe
        print(f"L = {probe['L']}, D = {probe['D']}, forward vs torch SDPA: causal ALiBi {probe['alibi_ratio']:.2f}x, "
              f"saturated causal {probe['saturated_ratio']:.2f}x")
    elif args.compile_probe:
        probe = compile_probe(max(args.repeats, 20))
        result["compile_probe"] = probe
        print(f"torch.compile of one tile update: compile {probe['compile_s']:.0f} s, tile "
              f"{probe['eager_tile_s'] * 1e3:.2f} ms eager vs {probe['compiled_tile_s'] * 1e3:.2f} ms compiled")
    elif args.sweep_blocks:
        sweep = []
        for bq, bk in ((64, 256), (128, 128), (128, 256), (128, 512), (256, 256), (256, 512), (512, 512)):
            row = speed_row(4096, 64, 8, args.repeats, bq, bk, flex=False)
            sweep.append(row)
            print(f"block_q={bq:4d} block_k={bk:4d}  forward ratio {row['forward.tiled_softcap_ratio']:.2f}x  "
                  f"forward+backward ratio {row['forward_backward.tiled_softcap_ratio']:.2f}x", flush=True)
        result["block_sweep"] = sweep
    else:
        sizes = [(1024, 64)] if args.quick else [(L, D) for L in (2048, 4096, 8192) for D in (64, 128)]
        repeats = 3 if args.quick else args.repeats
        rows = [speed_row(L, D, 8, repeats, args.block_q, args.block_k, args.flex) for L, D in sizes]
        result["speed"] = rows
        _print_speed(rows, args.offset)
        if not (args.quick or args.no_memory):
            mem = memory_row(1, 8, 16384, 64, args.threads)
            result["memory"] = mem
            print(
                f"memory: forward+backward at B=1 H=8 L=S=16384 D=64, softcap {SOFTCAP}, window {MEMORY_WINDOW}: "
                f"peak RSS growth {mem['growth_mib']:.0f} MiB (inputs {mem['inputs_mib']:.0f} MiB; the score "
                f"matrix would be {mem['score_matrix_mib']:.0f} MiB), {mem['seconds']:.1f} s"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
