"""Attention over an int8 KV cache (attnscale.quantize_kv, attnscale.quantized_attention) against
torch's SDPA over the same keys and values in bfloat16, in the same process.

Decoding: one query row a head, B 1, H 32 query heads over Hkv 8 key heads, D = Dv = 128, at S
= 4096, 16384 and 32768 cached keys (bfloat16 queries, whose q.k attnscale takes in integers over
q's rows rounded to int16; torch with ``enable_gqa``); and the same step with the query passed as
float32 (attnscale's q.k in float32, against the same bfloat16 call of torch's): what the
integer products buy. Prefill: L = S
= 4096, causal, the same heads. Each round times torch's call and attnscale's back to back
(``--calls`` each, the order swapped every other round) after one untimed call each; a case's
figure is the median over ``--rounds`` rounds of the time per call, at torch's default thread
count and at one thread. Before timing, each output is checked: attnscale's against the float64
reference over the record's dequantized K and V, torch's against it over the bfloat16 K and V.
Targets: decoding at least 1.5x faster than torch's bfloat16 call, prefill no slower; the
record's bytes at most 0.53x of the bfloat16 cache's.

    python benchmarks/bench_int8.py                       # every case, both thread counts
    python benchmarks/bench_int8.py --json benchmarks/recorded/int8.json
    python benchmarks/bench_int8.py --markdown benchmarks/recorded/int8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import attnscale
from machine import DEFAULT_THREADS, describe

SCHEMA = "attnscale.bench_int8/1"
DECODE_SPEEDUP = 1.5  # decoding: torch's time over attnscale's, at least
PREFILL_SPEEDUP = 1.0  # prefill: no slower than torch
BYTES_RATIO = 0.53  # the record's bytes over the bfloat16 cache's, at most
H, HKV, D = 32, 8, 128
DECODE_KEYS = (4096, 16384, 32768)
PREFILL_ROWS = 4096
# Output checks (largest |difference| from the float64 reference, less RTOL |reference|): attnscale's
# decoding rows are exact up to float32 rounding over the dequantized K and V, then rounded to the
# query's bfloat16 (half a unit in the last place, 2^-9 relative); its prefill takes bfloat16
# products (the dequantized K and V, and the weights, rounded to bfloat16), as torch's does
# throughout: both are held to ATOL_TORCH there.
ATOL_OURS, ATOL_TORCH, RTOL = 1e-4, 3e-2, 2.0**-8


def _inputs(L: int, S: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, L, D, generator=gen).bfloat16()
    k = (torch.randn(1, HKV, S, D, generator=gen) + torch.randn(1, 1, 1, D, generator=gen)).bfloat16()
    v = torch.randn(1, HKV, S, D, generator=gen).bfloat16()
    return q, k, v, attnscale.quantize_kv(k, v)


def _fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True)


def _check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    error = float(((got.double() - want).abs() - RTOL * want.abs()).max())
    if not error <= atol:
        sys.exit(f"bench_int8: {name}: output off the float64 reference by {error:.3g} beyond {RTOL:g} of it (allowed {atol:g}); not timed")


def _per_call_ms(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def time_case(name: str, L: int, S: int, causal: bool, threads: int, rounds: int, calls: int, float_q: bool = False) -> dict:
    torch.set_num_threads(threads)
    q, k, v, kv = _inputs(L, S)
    q_ours = q.float() if float_q else q
    ours = lambda: attnscale.quantized_attention(q_ours, kv, is_causal=causal, enable_gqa=True)  # noqa: E731
    theirs = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # noqa: E731
    k_back, v_back = kv.dequantize()
    _check(f"{name}, attnscale", ours(), _fp64(q, k_back, v_back, causal), ATOL_OURS if L == 1 else ATOL_TORCH)
    backend = attnscale.last_backend()
    _check(f"{name}, torch", theirs(), _fp64(q, k, v, causal), ATOL_TORCH)
    del k_back, v_back
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for r in range(rounds):
        order = (("ours", ours), ("theirs", theirs)) if r % 2 == 0 else (("theirs", theirs), ("ours", ours))
        for side, fn in order:
            times[side].append(_per_call_ms(fn, calls))
    ours_ms, torch_ms = statistics.median(times["ours"]), statistics.median(times["theirs"])
    target = None if float_q else PREFILL_SPEEDUP if L > 1 else DECODE_SPEEDUP  # (a float32 query: a comparison, no target)
    return {
        "case": name, "threads": threads, "L": L, "S": S, "attnscale_ms": ours_ms, "torch_ms": torch_ms, "speedup": torch_ms / ours_ms,
        "target": target, "met": None if target is None else torch_ms / ours_ms >= target, "backend": backend, "float_q": float_q,
    }  # fmt: skip


def cache_bytes() -> dict:
    _, k, v, kv = _inputs(1, 4096)
    bf16 = k.numel() * k.element_size() + v.numel() * v.element_size()
    return {"S": 4096, "int8_bytes": kv.nbytes, "bf16_bytes": bf16, "ratio": kv.nbytes / bf16, "met": kv.nbytes / bf16 <= BYTES_RATIO}


def _verdict(row: dict) -> str:
    if row["target"] is None:
        return "(none: what the integer products buy)"
    return f"{'met' if row['met'] else 'MISSED'} (>= {row['target']:g}x)"


def markdown(result: dict) -> str:
    """docs/performance.md's table of a ``--json`` run."""
    lines = [
        f"`python benchmarks/bench_int8.py --rounds {result['rounds']} --calls {result['calls']}` on {result['cpu']}, torch {result['torch']}, "
        f"commit {result['commit']}: milliseconds per call (median of {result['rounds']} rounds of {result['calls']} decoding calls or one prefill, "
        f"interleaved), B 1, H {H} over Hkv {HKV}, D {D}, bfloat16 queries (a float32 query where the case says so: attnscale's q.k then in "
        f"float32, not in integers); torch's SDPA over the bfloat16 cache, attnscale over the int8 record of it. Targets: decoding "
        f"{DECODE_SPEEDUP}x faster, prefill no slower.",
        "",
        "| case | threads | attnscale | torch (bf16) | speedup | backend | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["cases"]:
        lines.append(
            f"| {row['case']} | {row['threads']} | {row['attnscale_ms']:.2f} | {row['torch_ms']:.2f} | {row['speedup']:.2f}x | {row['backend']} | "
            f"{_verdict(row)} |"
        )
    b = result["bytes"]
    lines += ["", f"- Cache bytes at S {b['S']}: int8 record {b['int8_bytes']:,}, bfloat16 {b['bf16_bytes']:,}: {b['ratio']:.3f}x ({'met' if b['met'] else 'MISSED'}, target {BYTES_RATIO}x)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7; prefill takes a third as many, at least 3)")
    parser.add_argument("--calls", type=int, default=20, help="decoding calls a round (default 20; prefill: 1)")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts (default: torch's default and 1)")
    parser.add_argument("--quick", action="store_true", help="decoding at S 4096 only (a smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the run as JSON")
    parser.add_argument("--markdown", metavar="JSON", help="print the docs' table from a --json file and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as handle:
            print(markdown(json.load(handle)))
        return 0
    threads = args.threads or sorted({DEFAULT_THREADS, 1}, reverse=True)
    result = {"schema": SCHEMA, **describe(), "rounds": args.rounds, "calls": args.calls, "cases": [], "bytes": cache_bytes()}
    for count in threads:
        for S in DECODE_KEYS[:1] if args.quick else DECODE_KEYS:
            result["cases"].append(time_case(f"decoding, S {S}", 1, S, False, count, args.rounds, args.calls))
            print(result["cases"][-1], file=sys.stderr, flush=True)
            result["cases"].append(time_case(f"decoding, S {S}, float32 query", 1, S, False, count, args.rounds, args.calls, float_q=True))
            print(result["cases"][-1], file=sys.stderr, flush=True)
        if not args.quick:
            result["cases"].append(time_case(f"prefill, L = S = {PREFILL_ROWS}, causal", PREFILL_ROWS, PREFILL_ROWS, True, count, max(3, args.rounds // 3), 1))
            print(result["cases"][-1], file=sys.stderr, flush=True)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
