"""attnscale's flex backend on a CUDA GPU against FlexAttention with the same mods and torch's SDPA.

For each case, bf16, B = 1, H = 16 (GQA cases: 4 key/value heads), L = S in --lengths, D in --dims:

- ``flex``: ``attnscale.scaled_dot_product_attention(..., backend="flex")`` with the case's features;
- ``plain flex``: ``torch.compile(flex_attention)`` with the same score_mod / block mask written by
  hand (what a FlexAttention user writes), the target being flex / plain flex <= 1.1x;
- ``sdpa``: torch's SDPA on the plain problem (causal where the case is causal), FlashAttention's
  backend where it runs.

Statistics (``return_stats=True``) are timed against the plain flex call: target <= 1.3x.
Forward and forward+backward, medians of --repeats interleaved per-repeat ratios (CUDA events),
and peak memory of one forward+backward. Every timed output is first checked against the math
backend on the first 256 query rows (float32 of the bf16 inputs).

    python benchmarks/bench_flex.py --json benchmarks/recorded/flex_gpu.json
    python benchmarks/bench_flex.py --markdown benchmarks/recorded/flex_gpu.json

Without a CUDA GPU it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

import attnscale  # noqa: E402
from attnscale import flex  # noqa: E402

DTYPE = torch.bfloat16
CASES = ("causal", "causal+softcap", "causal+alibi", "window", "gqa+causal+softcap", "sinks", "statistics")
TARGETS = {"flex / plain flex": 1.1, "statistics / plain flex": 1.3}


def _inputs(L: int, D: int, case: str, grad: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, Hkv = 16, 4 if case.startswith("gqa") else 16
    q = torch.randn(1, H, L, D, device="cuda", dtype=DTYPE, generator=gen)  # (B, H, L, D)
    k = torch.randn(1, Hkv, L, D, device="cuda", dtype=DTYPE, generator=gen)  # (B, Hkv, S, D)
    v = torch.randn(1, Hkv, L, D, device="cuda", dtype=DTYPE, generator=gen)  # (B, Hkv, S, Dv)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _options(case: str, H: int) -> dict[str, object]:
    opts: dict[str, object] = {}
    if "causal" in case:
        opts["is_causal"] = True
    if "softcap" in case:
        opts["softcap"] = 30.0
    if "alibi" in case:
        opts["alibi_slopes"] = attnscale.alibi_slopes(H).cuda()
    if case == "window":
        opts["window"] = (1024, 0)
    if case == "sinks":
        opts["is_causal"] = True
        opts["sinks"] = torch.zeros(H, device="cuda")
    if case == "statistics":
        opts["return_stats"] = True
    return opts


def _plain_flex(q: torch.Tensor, k: torch.Tensor, opts: dict[str, object]) -> Callable[..., torch.Tensor]:
    """FlexAttention as a user writes it for the same semantics (sinks and statistics aside)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    L, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
    cap, slopes = opts.get("softcap"), opts.get("alibi_slopes")
    causal, window = bool(opts.get("is_causal")), opts.get("window")

    def score_mod(s, b, h, i, j):
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        if slopes is not None:
            s = s - slopes[h] * (i - j).abs()
        return s

    def mask_mod(b, h, i, j):
        keep = j <= i if causal or window is not None else i >= 0
        if window is not None:
            keep = keep & (j >= i - window[0])
        return keep

    masked = causal or window is not None
    block = create_block_mask(mask_mod, None, None, L, S, device="cuda") if masked else None
    # Each case's closures compile once more, into the cache of the function attnscale's backend
    # compiles too; past torch's recompile limit (8) FlexAttention would run eagerly (the whole
    # score matrix) and the baseline would be slow for the wrong reason: a limit no run reaches,
    # and a hard error if one does.
    torch._dynamo.config.recompile_limit = max(1024, torch._dynamo.config.recompile_limit)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    compiled = torch.compile(flex_attention)
    gqa = q.shape[-3] != k.shape[-3]
    return lambda q, k, v: compiled(q, k, v, score_mod=score_mod if cap or slopes is not None else None, block_mask=block, scale=D**-0.5, enable_gqa=gqa)


def _time(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _step(run: Callable[..., object], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool) -> Callable[[], object]:
    def go() -> object:
        out = run(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        if backward:
            out.float().square().mean().backward()
        return out

    return go


def _check(case: str, got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: dict[str, object]) -> float:
    """Largest error of the first 256 query rows against the math backend in float32, which must
    be within the bf16 rounding of the output (0.02 at |out| <= 1)."""
    rows = slice(0, min(256, q.shape[-2]))
    wide = {n: (t.float() if isinstance(t, torch.Tensor) else t) for n, t in opts.items() if n != "return_stats"}
    want = attnscale.scaled_dot_product_attention(
        q[..., rows, :].detach().float(), k.detach().float(), v.detach().float(), enable_gqa=True, backend="math", **wide
    )
    err = float((got[..., rows, :].float() - want).abs().max())
    if not err <= 0.02:
        raise SystemExit(f"{case}: flex output differs from the math backend by {err:.3g} (limit 0.02)")
    return err


def measure(lengths: Sequence[int], dims: Sequence[int], repeats: int, *, deadline: float = math.inf, done: Callable[[list[dict[str, object]]], None] = lambda rows: None) -> list[dict[str, object]]:
    """Every cell, or those started before ``deadline`` (time.monotonic()); ``done`` is given the
    rows after each cell, so that a run cut short keeps what it measured."""
    rows: list[dict[str, object]] = []
    for L in lengths:
        for D in dims:
            for case in CASES:
                for backward in (False, True):
                    if time.monotonic() > deadline:
                        return rows
                    q, k, v = _inputs(L, D, case, backward)
                    opts = _options(case, q.shape[-3])
                    ours = _step(lambda q, k, v: attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="flex", **opts), q, k, v, backward)
                    plain = _step(_plain_flex(q, k, opts), q, k, v, backward)
                    causal = bool(opts.get("is_causal")) or "window" in opts
                    sdpa = _step(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), q, k, v, backward)
                    with torch.no_grad():
                        first = attnscale.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend="flex", **opts)
                    err = _check(case, first[0] if isinstance(first, tuple) else first, q, k, v, opts)
                    for fn in (ours, plain, sdpa):  # compile and warm up
                        fn(), fn()
                    times: dict[str, list[float]] = {"flex": [], "plain flex": [], "sdpa": []}
                    for _ in range(repeats):  # interleaved
                        for name, fn in (("flex", ours), ("plain flex", plain), ("sdpa", sdpa)):
                            times[name].append(_time(fn))
                    torch.cuda.reset_peak_memory_stats()
                    ours()
                    peak = torch.cuda.max_memory_allocated() / 2**20
                    rows.append(
                        {
                            "L": L, "D": D, "case": case, "backward": backward, "max_error": err, "peak_mib": round(peak, 1),
                            "ms": {name: statistics.median(t) for name, t in times.items()},
                            "vs_plain_flex": statistics.median(a / b for a, b in zip(times["flex"], times["plain flex"])),
                            "vs_sdpa": statistics.median(a / b for a, b in zip(times["flex"], times["sdpa"])),
                        }
                    )  # fmt: skip
                    done(rows)
                    print(f"L={L} D={D} {case:20s} {'fwd+bwd' if backward else 'fwd    '} flex/plain {rows[-1]['vs_plain_flex']:.2f}x  flex/sdpa {rows[-1]['vs_sdpa']:.2f}x  {peak:.0f} MiB", flush=True)
    return rows


def markdown(result: dict[str, object]) -> str:
    rows = result["rows"]
    planned = result.get("cells_planned", len(rows))
    ran = f" ({len(rows)} of the {planned} cells it planned)" if len(rows) < planned else ""
    met = sum(r["vs_plain_flex"] <= _target(r) for r in rows)
    lines = [
        f"`python {result['command']}` at commit {result['commit']} on an {result['gpu']} (torch {result['torch']}; host CPU {result['cpu']}){ran}, bf16, B = 1, H = 16, "
        f"medians of {result['repeats']} interleaved per-repeat ratios: attnscale's flex backend / FlexAttention with the same mods "
        f"(target 1.1x; statistics 1.3x): {met} of {len(rows)} cells met; and / torch's SDPA on the plain problem.",
        "",
        "| case | pass | L | D | / plain flex | target | / SDPA | peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        verdict = "met" if r["vs_plain_flex"] <= _target(r) else "missed"
        lines.append(
            f"| {r['case']} | {'fwd+bwd' if r['backward'] else 'fwd'} | {r['L']} | {r['D']} | {r['vs_plain_flex']:.2f}x | {_target(r):.1f}x {verdict} | {r['vs_sdpa']:.2f}x | {r['peak_mib']:.0f} |"
        )
    return "\n".join(lines)


def _target(row: dict[str, object]) -> float:
    return TARGETS["statistics / plain flex" if row["case"] == "statistics" else "flex / plain flex"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="L = 2048 and 8192, D = 64, 3 repeats")
    parser.add_argument("--json", metavar="PATH", help="write the recording here (after every cell, so a run cut short keeps its cells)")
    parser.add_argument("--max-minutes", type=float, default=math.inf, help="start no new cell after this many minutes (the recording says which cells ran)")
    parser.add_argument("--markdown", metavar="JSON", help="print the docs' table from a --json file and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text(encoding="utf-8"))))
        return 0
    if not torch.cuda.is_available() or not flex.available():
        print("bench_flex: needs a CUDA GPU and a torch with FlexAttention; found neither here", file=sys.stderr)
        return 2
    if args.quick:
        args.lengths, args.dims, args.repeats = [2048, 8192], [64], 3
    head = {**machine.describe(), "gpu": torch.cuda.get_device_name(), "repeats": args.repeats, "command": " ".join(sys.argv)}
    planned = len(args.lengths) * len(args.dims) * len(CASES) * 2

    def record(rows: list[dict[str, object]]) -> dict[str, object]:
        result = {**head, "cells_planned": planned, "rows": rows}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        return result

    rows = measure(args.lengths, args.dims, args.repeats, deadline=time.monotonic() + 60 * args.max_minutes, done=record)
    result = record(rows)
    print(markdown(result))
    missed = [r for r in rows if r["vs_plain_flex"] > _target(r)]
    print(f"cells over target: {len(missed)} of {len(rows)} ({planned - len(rows)} of {planned} not run: --max-minutes)" if len(rows) < planned else f"cells over target: {len(missed)} of {len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
