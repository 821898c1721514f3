"""quant-folding: the softmax scale folded into q before INT8 quantisation; K smoothing.

Through ``attnscale.variants.quant`` (SageAttention-style per-block INT8):

1. Folding exactness: quantise ``q * scale`` and ``q`` and compare the INT8 values and block
   scales. For a power-of-two scale (D = 64, 256) the values must be identical and the block
   scales differ by exactly the scale. Absmax quantisation is scale-equivariant,
   ``round(c q / (c max|q| / 127)) = round(q / (max|q| / 127))``, so for any other scale
   (D = 128: 2^-3.5) a value can change only where float rounding of ``c q`` crosses a
   rounding boundary.
2. Folding is harmless: attention error against float64 with the scale folded into q versus
   applied to the dequantised logits afterwards.
3. Smoothing: subtracting the per-channel key mean leaves float attention unchanged, and
   reduces the INT8 error when keys share a large channel offset (an outlier channel).
4. Through attnscale's own int8 attention (:func:`attnscale.quantized_attention`: K and V in int8
   with per-key scales, q kept in float32, the compiled kernel where it builds): smoothing at each
   offset, and the scale folded into q against the scale the kernel applies to its products.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...dense import masked_softmax
from ...functional import last_backend, scaled_dot_product_attention
from ...quantized import quantize_kv, quantized_attention
from ...variants import int8_attention, int8_logits, quantize_int8, smooth_keys
from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="quant-folding",
    statement=(
        "Folding the softmax scale into q before INT8 quantisation is exact for power-of-two scales and harmless "
        "otherwise; smoothing K (subtracting its mean over keys) is exact under softmax and reduces INT8 error."
    ),
    sources=("Zhang et al. 2025 (SageAttention), smoothing K",),
    method=(
        "Per-block symmetric INT8 (128 query rows, 64 key rows per block), int32 accumulation. For D in "
        "{64, 128, 256}: share of INT8 values of q that change when the scale is folded in, and the block-scale "
        "ratio; attention error against float64 with the scale folded into q and with it applied after "
        "dequantisation. Keys with a shared channel offset of 0, 2, 10 (x noise std): float attention with and "
        "without smoothing, and INT8 attention error with and without smoothing. The same keys through "
        "attnscale.quantized_attention (int8 K and V, group scales per key for K, per vector for V, q in float32): "
        "its error with and without smoothing, and with the scale folded into q against the scale applied in the "
        "kernel's products. Several random draws."
    ),
    rule=(
        "inconclusive if INT8 error is not above float32 noise (1e-5), i.e. nothing was quantised. does-not-hold "
        "if folding a power-of-two scale changes any INT8 value, or smoothing changes float attention by more than "
        "1e-10, or smoothing does not reduce the INT8 error at the largest offset, in the per-block simulation or "
        "through attnscale.quantized_attention. holds if, in addition, folding a non-power-of-two scale changes the "
        "attention error by less than 25% relative, in the simulation and through quantized_attention (where q stays "
        "float32, so folding moves only float rounding); holds-approximately otherwise."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "d177ce7e3b8d2093"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "61988b6e2f6acf55"),
        RuleVersion(
            3,
            "2026-12-06",
            "attnscale now computes int8 attention itself (quantized_attention, a compiled kernel over int8 K and V): the "
            "claim is also measured through it, and its smoothing and folding judged by the same bars as the simulation's; "
            "written before any run of it",
            "3dbd1308273a082c",
        ),
    ),
)
HEADLINE = Headline(
    "smoothing_error_ratio_at_largest_offset",
    "INT8 attention error with K smoothed / without, at the largest key offset",
    "x",
)


@dataclass(frozen=True)
class Config:
    dims: tuple[int, ...] = (64, 128, 256)
    length: int = 256
    offsets: tuple[float, ...] = (0.0, 2.0, 10.0)
    draws: int = 4

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(dims=(64, 128), length=96, offsets=(0.0, 10.0), draws=1)
        if profile == "full":
            return cls(length=512, draws=16)
        return cls()


def _attention_from_logits(logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    p, _ = masked_softmax(logits, None, with_stats=False)
    return p @ v


def run(config: Config, seed: int, progress: Progress) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    L = config.length
    total = len(config.dims) + len(config.offsets)
    folding: dict[str, dict[str, float]] = {}
    for i, D in enumerate(config.dims):
        scale = D**-0.5
        changed, ratio_err, err_folded, err_after = [], [], [], []
        for _ in range(config.draws):
            q, k, v = (torch.randn(1, 2, L, D, generator=gen, dtype=torch.float64) for _ in range(3))
            q8, sq = quantize_int8(q.float(), block_size=128)
            f8, sf = quantize_int8((q * scale).float(), block_size=128)
            changed.append((q8 != f8).double().mean().item())
            ratio_err.append(((sf / sq) / scale - 1).abs().max().item())
            exact = scaled_dot_product_attention(q, k, v)  # float64 reference
            folded = int8_attention(q.float(), k.float(), v.float(), smooth_k=False).double()
            after = _attention_from_logits(int8_logits(q.float(), k.float(), scale=1.0, smooth_k=False) * scale, v.float()).double()
            err_folded.append((folded - exact).abs().mean().item())
            err_after.append((after - exact).abs().mean().item())
        folding[str(D)] = {
            "scale": scale,
            "power_of_two": math.log2(scale).is_integer(),
            "int8_values_changed": max(changed),
            "block_scale_ratio_error": max(ratio_err),
            "mean_abs_error_folded": sum(err_folded) / len(err_folded),
            "mean_abs_error_scale_after": sum(err_after) / len(err_after),
        }
        folding[str(D)]["relative_change"] = folding[str(D)]["mean_abs_error_folded"] / folding[str(D)]["mean_abs_error_scale_after"] - 1
        progress(i + 1, total)

    D = 64
    smoothing: dict[str, dict[str, float]] = {}
    for j, offset in enumerate(config.offsets):
        float_change, err_plain, err_smooth = [], [], []
        kernel: dict[str, list[Any]] = {}
        for _ in range(config.draws):
            q, k, v = (torch.randn(1, 2, L, D, generator=gen, dtype=torch.float64) for _ in range(3))
            channel = torch.randn(D, generator=gen, dtype=torch.float64)
            k = k + offset * channel  # every key shares the same channel offset
            exact = scaled_dot_product_attention(q, k, v)
            float_change.append((scaled_dot_product_attention(q, smooth_keys(k), v) - exact).abs().max().item())
            plain = int8_attention(q.float(), k.float(), v.float(), smooth_k=False).double()
            smooth = int8_attention(q.float(), k.float(), v.float(), smooth_k=True).double()
            err_plain.append((plain - exact).abs().mean().item())
            err_smooth.append((smooth - exact).abs().mean().item())
            for key, value in _through_kernel(q, k, v).items():
                kernel.setdefault(key, []).append(value)
        smoothing[f"{offset:g}"] = {
            "float_change": max(float_change),
            "mean_abs_error_int8": sum(err_plain) / len(err_plain),
            "mean_abs_error_int8_smoothed": sum(err_smooth) / len(err_smooth),
            **{f"kernel_{key}": sum(values) / len(values) for key, values in kernel.items() if key != "backend"},
            "kernel_backend": kernel["backend"][-1],
        }
        progress(len(config.dims) + j + 1, total)
    largest = smoothing[f"{max(config.offsets):g}"]
    return {
        "folding": folding,
        "smoothing": smoothing,
        "smoothing_error_ratio_at_largest_offset": largest["mean_abs_error_int8_smoothed"] / largest["mean_abs_error_int8"],
        "kernel_smoothing_error_ratio_at_largest_offset": largest["kernel_error_smoothed"] / largest["kernel_error"],
        "kernel_folding_relative_change": max(abs(row["kernel_error_folded"] / row["kernel_error_smoothed"] - 1) for row in smoothing.values()),
    }


def _through_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """Mean |error| against float64 of attnscale.quantized_attention over int8 K and V (float32 q):
    K raw, K smoothed, and K smoothed with the scale folded into q (scale 1 in the kernel)."""
    exact = scaled_dot_product_attention(q, k, v)
    scale = q.shape[-1] ** -0.5
    raw, smoothed = (quantize_kv(k.float(), v.float(), smooth=smooth) for smooth in (False, True))
    error = lambda out: (out.double() - exact).abs().mean().item()  # noqa: E731
    return {
        "error": error(quantized_attention(q.float(), raw)),
        "error_smoothed": error(quantized_attention(q.float(), smoothed)),
        "error_folded": error(quantized_attention((q * scale).float(), smoothed, scale=1.0)),
        "backend": last_backend(),
    }


def judge(measured: dict[str, Any]) -> Judgement:
    folding, smoothing = measured["folding"], measured["smoothing"]
    if min(row["mean_abs_error_folded"] for row in folding.values()) < 1e-5:
        return Judgement(Verdict.INCONCLUSIVE, "INT8 error is at float32 noise: nothing was quantised")
    for D, row in folding.items():
        if row["power_of_two"] and (row["int8_values_changed"] > 0 or row["block_scale_ratio_error"] > 1e-6):
            return Judgement(Verdict.DOES_NOT_HOLD, f"folding the power-of-two scale at D = {D} changed {row['int8_values_changed']:.2%} of INT8 values")
    float_change = max(row["float_change"] for row in smoothing.values())
    if float_change > 1e-10:
        return Judgement(Verdict.DOES_NOT_HOLD, f"smoothing changed float attention by {float_change:.3g}")
    ratio = measured["smoothing_error_ratio_at_largest_offset"]
    if ratio >= 1.0:
        return Judgement(Verdict.DOES_NOT_HOLD, f"smoothing did not reduce INT8 error at the largest offset (ratio {ratio:.3f})")
    kernel_ratio = measured["kernel_smoothing_error_ratio_at_largest_offset"]
    if kernel_ratio >= 1.0:
        return Judgement(Verdict.DOES_NOT_HOLD, f"through quantized_attention, smoothing did not reduce the int8 error at the largest offset (ratio {kernel_ratio:.3f})")
    odd = {D: row for D, row in folding.items() if not row["power_of_two"]}
    worst = max((abs(row["relative_change"]) for row in odd.values()), default=0.0)
    kernel_fold = measured["kernel_folding_relative_change"]
    summary = (
        f"power-of-two folding changed no INT8 value; smoothing changes float attention by {float_change:.1e} and "
        f"cuts INT8 error to {ratio:.2f}x at the largest key offset ({kernel_ratio:.2f}x through quantized_attention); "
        f"non-power-of-two folding changes the error by {worst:.1%} ({kernel_fold:.2%} through quantized_attention, q in float32)"
    )
    return Judgement(Verdict.HOLDS if worst < 0.25 and kernel_fold < 0.25 else Verdict.HOLDS_APPROXIMATELY, summary)


def plot(measured: dict[str, Any], outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.8), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    folding = measured["folding"]
    dims = list(folding)
    x = range(len(dims))
    ax1.bar([i - 0.2 for i in x], [folding[d]["mean_abs_error_folded"] for d in dims], width=0.4, label="scale folded into q")
    ax1.bar([i + 0.2 for i in x], [folding[d]["mean_abs_error_scale_after"] for d in dims], width=0.4, label="scale after dequantisation")
    ax1.set_xticks(list(x), [f"D={d}" + (" (2^k)" if folding[d]["power_of_two"] else "") for d in dims])
    ax1.set_ylabel("mean |INT8 attention - float64|")
    ax1.set_title("folding the scale into q")
    tallest = max(max(folding[d]["mean_abs_error_folded"], folding[d]["mean_abs_error_scale_after"]) for d in dims)
    ax1.set_ylim(0, 1.5 * tallest)  # headroom so the legend sits above the bars
    ax1.legend(fontsize=9, framealpha=0.8, loc="upper left")
    smoothing = measured["smoothing"]
    offsets = list(smoothing)
    ax2.plot([float(o) for o in offsets], [smoothing[o]["mean_abs_error_int8"] for o in offsets], marker="o", label="INT8")
    ax2.plot([float(o) for o in offsets], [smoothing[o]["mean_abs_error_int8_smoothed"] for o in offsets], marker="o", label="INT8, K smoothed")
    ax2.plot([float(o) for o in offsets], [smoothing[o]["kernel_error"] for o in offsets], marker="s", ls="--", label="quantized_attention")
    ax2.plot([float(o) for o in offsets], [smoothing[o]["kernel_error_smoothed"] for o in offsets], marker="s", ls="--", label="quantized_attention, K smoothed")
    ax2.set_xlabel("shared key channel offset (x noise std)")
    ax2.set_ylabel("mean |INT8 attention - float64|")
    ax2.set_yscale("log")
    ax2.set_title("smoothing K against a shared offset")
    ax2.legend(fontsize=9, framealpha=0.8)
    fig.suptitle("Folding the scale into q and smoothing K")
    return [save_figure(fig, outdir, "quant_folding")]


def captions(measured: dict[str, Any]) -> dict[str, str]:
    return {
        "quant_folding": (
            "Left: the mean error of INT8 attention against float64 for each head size D, with the scale folded into "
            "q before quantising and with the scale applied after dequantising; bars of equal height mean folding is "
            "harmless, and at the sizes marked 2^k (a power-of-two scale) it is exact. Right: the INT8 error as a "
            "shared offset is added to a key channel, with and without smoothing K (subtracting its mean over keys), "
            "in the per-block simulation (solid) and through attnscale's own int8 attention, quantized_attention "
            "(dashed: int8 K and V with per-key scales, q in float32): the smoothed lines should stay low as the "
            "offset grows."
        )
    }
