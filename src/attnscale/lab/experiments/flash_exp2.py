"""FlashAttention's exp2 form of the scale, written out, against the plain formula.

FlashAttention-2 multiplies the raw q.k by one constant ``c = scale * log2(e)`` and uses base-2
exponentials in its online softmax, since ``exp(scale * s) = 2^(c * s)``::

    for each key block j:   t = c * (q @ k_j^T)                  base-2 logits
                            m' = max(m, rowmax(t))
                            p = 2^(t - m'),  alpha = 2^(m - m')
                            l = alpha * l + rowsum(p);  acc = alpha * acc + p @ v_j;  m = m'
    out = acc / l

This module implements that loop (it is the subject of the claim) and measures its error and
attnscale's error against a float64 reference, in units of the working dtype's epsilon.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

import attnscale
from attnscale import reference

from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="flash-exp2",
    statement=(
        "FlashAttention folds the softmax scale into a base-2 exponential, exp(scale * s) = "
        "2^(scale * log2(e) * s), inside its blockwise online softmax, and gets the same result as "
        "the plain formula up to rounding."
    ),
    sources=(
        "Dao 2023 (FlashAttention-2), sec. 3.1",
        "flash-attention source: scale_softmax_log2 = softmax_scale * log2(e)",
        "Triton tutorial 06-fused-attention: qk_scale = sm_scale * 1.44269504",
    ),
    method=(
        "The exp2 online-softmax loop above, in float32 and float64, over key blocks, for several "
        "head sizes, key lengths (one not a multiple of the block) and scales (1/sqrt(d_k) and the "
        "unscaled 1, whose larger logits stress the folded constant). Reference: attnscale.reference "
        "in float64 on the same inputs. Error: max |out - reference| / max |reference|, in units of "
        "the working dtype's epsilon, for the exp2 loop and for attnscale.scaled_dot_product_attention "
        "in the same dtype (the plain same-precision baseline)."
    ),
    rule=(
        "For every case and dtype, with e = exp2-loop error and b = attnscale's error (in eps). "
        "Holds: e <= max(2 b, 64). Holds approximately: e <= max(8 b, 4096). Does not hold: "
        "otherwise. Inconclusive: missing or non-finite errors."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "4509e1a74130d5ac"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "d8bd7e9f73d16965"),
    ),
)

HEADLINE = Headline("worst_exp2_fp32_eps", "largest error of the exp2-folded loop in float32", "eps")
"""The exp2 loop's largest float32 error, in float32 eps."""

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class Config:
    d_ks: tuple[int, ...] = (64, 128)
    lengths: tuple[int, ...] = (1000, 4096)
    queries: int = 64
    heads: int = 2
    block: int = 128

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(d_ks=(64,), lengths=(300,), queries=16, heads=1, block=64)
        if profile == "quick":
            return cls()
        if profile == "default":
            return cls(d_ks=(32, 64, 128, 256), lengths=(1000, 4096, 8192), queries=128)
        return cls(d_ks=(32, 59, 64, 128, 256), lengths=(1000, 4096, 16384, 65536), queries=256, heads=4)


def exp2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, block: int) -> torch.Tensor:
    """FlashAttention-2's forward with the scale folded into exp2; q (..., L, D), k (..., S, D), v (..., S, Dv)."""
    c = torch.tensor(scale * LOG2E, dtype=q.dtype)
    L = q.shape[-2]
    m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype)  # (..., L, 1) running max, base 2
    l = torch.zeros_like(m)  # (..., L, 1) running sum
    acc = torch.zeros(*q.shape[:-2], L, v.shape[-1], dtype=q.dtype)  # (..., L, Dv)
    for start in range(0, k.shape[-2], block):
        t = (q @ k[..., start : start + block, :].transpose(-1, -2)) * c  # (..., L, Sb)
        m_new = torch.maximum(m, t.amax(dim=-1, keepdim=True))
        p = torch.exp2(t - m_new)
        alpha = torch.exp2(m - m_new)
        l = alpha * l + p.sum(dim=-1, keepdim=True)
        acc = alpha * acc + p @ v[..., start : start + block, :]
        m = m_new
    return acc / l


def run(config: Config, seed: int, progress: Progress) -> dict:
    gen = torch.Generator().manual_seed(seed)
    cases = []
    grid = [(d, S, s) for d in config.d_ks for S in config.lengths for s in ("1/sqrt(d_k)", "1")]
    for done, (d_k, S, scale_name) in enumerate(grid):
        shape = (1, config.heads)
        q = torch.randn(*shape, config.queries, d_k, generator=gen, dtype=torch.float64)  # (B, H, L, D)
        k = torch.randn(*shape, S, d_k, generator=gen, dtype=torch.float64)  # (B, H, S, D)
        v = torch.randn(*shape, S, d_k, generator=gen, dtype=torch.float64)  # (B, H, S, Dv)
        scale = 1.0 / math.sqrt(d_k) if scale_name == "1/sqrt(d_k)" else 1.0
        ref = torch.from_numpy(reference.attention(q.numpy(), k.numpy(), v.numpy(), scale=scale))
        size = float(ref.abs().max())
        case: dict = {"d_k": d_k, "keys": S, "scale": scale_name}
        for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
            eps = torch.finfo(dtype).eps
            qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
            outs = {
                "exp2": exp2_attention(qd, kd, vd, scale=scale, block=config.block),
                "attnscale": attnscale.scaled_dot_product_attention(qd, kd, vd, scale=scale),
            }
            for impl, out in outs.items():
                err = float((out.double() - ref).abs().max()) / size
                case[f"{impl}_{name}_eps"] = err / eps if math.isfinite(err) else None
        cases.append(case)
        progress(done + 1, len(grid))
    worst = [c["exp2_fp32_eps"] for c in cases if c["exp2_fp32_eps"] is not None]
    return {"block": config.block, "worst_exp2_fp32_eps": max(worst) if worst else None, "cases": cases}


def judge(measured: dict) -> Judgement:
    try:
        pairs = [
            (c, dtype, c[f"exp2_{dtype}_eps"], c[f"attnscale_{dtype}_eps"])
            for c in measured["cases"]
            for dtype in ("fp32", "fp64")
        ]
    except (KeyError, TypeError):
        return Judgement(Verdict.INCONCLUSIVE, "the measurement lacks per-case errors")
    if not pairs or any(e is None or b is None for _, _, e, b in pairs):
        return Judgement(Verdict.INCONCLUSIVE, "missing or non-finite errors")
    worst = {dtype: max(e for _, d, e, _ in pairs if d == dtype) for dtype in ("fp32", "fp64")}
    base = {dtype: max(b for _, d, _, b in pairs if d == dtype) for dtype in ("fp32", "fp64")}
    reason = (
        f"largest error of the exp2 loop: {worst['fp32']:.3g} eps (fp32), {worst['fp64']:.3g} eps (fp64); "
        f"attnscale's own: {base['fp32']:.3g} eps (fp32), {base['fp64']:.3g} eps (fp64)"
    )
    if all(e <= max(2 * b, 64) for _, _, e, b in pairs):
        return Judgement(Verdict.HOLDS, reason)
    if all(e <= max(8 * b, 4096) for _, _, e, b in pairs):
        return Judgement(Verdict.HOLDS_APPROXIMATELY, reason)
    return Judgement(Verdict.DOES_NOT_HOLD, reason)


def plot(measured: dict, outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    cases = measured["cases"]
    # a fixed size: a figure that widens with the cases is shrunk by the page until its text is unreadable
    fig = Figure(figsize=(10, 5.8), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    labels = [f"d{c['d_k']} S{c['keys']} {c['scale']}" for c in cases]
    xs = range(len(cases))
    width = 0.38
    for ax, dtype in zip(axes, ("fp32", "fp64"), strict=True):
        for offset, impl in ((-width / 2, "exp2"), (width / 2, "attnscale")):
            heights = [c[f"{impl}_{dtype}_eps"] or 0.0 for c in cases]
            label = "exp2 online softmax" if impl == "exp2" else "attnscale (plain)"
            ax.bar([x + offset for x in xs], heights, width, label=label)
        ax.set_xticks(list(xs), labels, rotation=90, fontsize=9)
        ax.set_ylabel(f"max rel. error ({dtype} eps)")
        ax.set_title(f"{dtype}: max |out - fp64 reference| / max |reference|")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=9, framealpha=0.8)
    fig.suptitle(f"Scale folded into exp2 (block {measured['block']}) vs the plain formula")
    return [save_figure(fig, outdir, "flash_exp2")]


def captions(measured: dict) -> dict[str, str]:
    return {
        "flash_exp2": (
            "The largest error against a float64 reference of each case (head size d, key count S, scale), in units "
            "of the dtype's machine epsilon: float32 on top, float64 below. In each pair of bars, the left one is the "
            f"blockwise online softmax with the scale folded into exp2 (blocks of {measured['block']} keys), the right "
            "one attnscale's plain formula. Bars of like height mean the folding costs no more than rounding."
        )
    }
