"""RoPE rotates q and k, so the variance argument for 1/sqrt(d_k) survives it, and the scale commutes.

``R(m) q . R(n) k = q . R(n - m) k``: for q, k with iid zero-mean unit-variance components the
rotated key ``R(n - m) k`` has the same distribution as ``k`` (an isotropic Gaussian is invariant
under rotation), so Var(q.k) = d_k at every offset. For correlated q and k (here k = q) the mean
of q.k is not preserved: it oscillates and decays with the offset, RoPE's long-range decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

import attnscale
from attnscale.variants import apply_rope

from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="rope-variance",
    statement=(
        "Rotary position embeddings are rotations, so they leave the variance of q.k at d_k for "
        "independent components, at any pair of positions, and the 1/sqrt(d_k) scale commutes with them."
    ),
    sources=("Su et al. 2021 (RoFormer), sec. 3",),
    method=(
        "For several d_k and relative offsets, draw iid N(0, 1) q and k, put q at a random position "
        "m and k at m + offset, rotate both with attnscale.variants.apply_rope (base 10000, half "
        "layout) and measure Var(q.k) / d_k with and without the rotation. Commutation: attnscale "
        "attention (float64) on (R q, R k) with scale 1/sqrt(d_k) against (R(q / sqrt(d_k)), R k) "
        "with scale 1, max abs difference. Also reported, not judged: the mean of q.k / d_k for k = q "
        "(fully correlated) against the offset."
    ),
    rule=(
        "Holds: Var(q.k) / d_k with RoPE lies in [0.8, 1.25] for every d_k and offset, and the "
        "commutation difference is at most 1e-12. Holds approximately: within [0.5, 2] and at most "
        "1e-6. Does not hold: otherwise. Inconclusive: fewer than 2 head sizes or 2 offsets, or "
        "missing values."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "4aa70b583a2f1755"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "d1ecb2d796a4bcd2"),
    ),
)


HEADLINE = Headline("worst_var_rope", "Var(q.k) / d_k with RoPE, farthest from 1")
"""Var(q.k) / d_k with RoPE, at the d_k and offset where it is farthest from 1 (in log)."""


@dataclass(frozen=True)
class Config:
    d_ks: tuple[int, ...] = (16, 64, 128, 256)
    offsets: tuple[int, ...] = (0, 1, 4, 16, 64, 256, 1024, 4096)
    samples: int = 4096
    max_position: int = 8192

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(d_ks=(16, 128), offsets=(0, 3, 100, 2000), samples=2048)
        if profile == "quick":
            return cls(samples=2048)
        if profile == "default":
            return cls(d_ks=(8, 16, 32, 64, 128, 256, 512), samples=8192)
        return cls(d_ks=(2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), samples=131072)


def rotate_at(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE for one vector per position: x (N, D) at positions (N,) -> (N, D)."""
    return apply_rope(x.unsqueeze(0), positions=positions).squeeze(0)  # the N samples on the L axis


def commutation_gap(gen: torch.Generator, d_k: int) -> float:
    """Max |attn(R q, R k; 1/sqrt(d_k)) - attn(R(q / sqrt(d_k)), R k; 1)| in float64."""
    q, k, v = (torch.randn(1, 2, 32, d_k, generator=gen, dtype=torch.float64) for _ in range(3))  # (B, H, L, D)
    c = 1.0 / math.sqrt(d_k)
    a = attnscale.scaled_dot_product_attention(apply_rope(q), apply_rope(k), v, is_causal=True, scale=c)
    b = attnscale.scaled_dot_product_attention(apply_rope(q * c), apply_rope(k), v, is_causal=True, scale=1.0)
    return float((a - b).abs().max())


def run(config: Config, seed: int, progress: Progress) -> dict:
    gen = torch.Generator().manual_seed(seed)
    N = config.samples
    rows = []
    gaps = {}
    total = len(config.d_ks)
    for done, d_k in enumerate(config.d_ks):
        for offset in config.offsets:
            m = torch.randint(0, config.max_position, (N,), generator=gen)
            q = torch.randn(N, d_k, generator=gen)
            k = torch.randn(N, d_k, generator=gen)
            plain = (q * k).sum(-1)  # float32 samples; the commutation check below runs in float64
            rotated = (rotate_at(q, m) * rotate_at(k, m + offset)).sum(-1)
            self_rotated = (rotate_at(q, m) * rotate_at(q, m + offset)).sum(-1)
            rows.append(
                {
                    "d_k": d_k,
                    "offset": offset,
                    "var_plain": float(plain.var() / d_k),
                    "var_rope": float(rotated.var() / d_k),
                    "mean_self_rope": float(self_rotated.mean() / d_k),
                }
            )
        gaps[str(d_k)] = commutation_gap(gen, d_k)
        progress(done + 1, total)
    worst = max((r["var_rope"] for r in rows), key=lambda x: abs(math.log(x)))
    return {"worst_var_rope": worst, "rows": rows, "commutation_max_abs_diff": gaps, "samples": N}


def judge(measured: dict) -> Judgement:
    try:
        rows = measured["rows"]
        ratios = [r["var_rope"] for r in rows]
        gap = max(measured["commutation_max_abs_diff"].values())
        d_ks, offsets = {r["d_k"] for r in rows}, {r["offset"] for r in rows}
    except (KeyError, TypeError, ValueError):
        return Judgement(Verdict.INCONCLUSIVE, "the measurement lacks variances or commutation differences")
    if len(d_ks) < 2 or len(offsets) < 2 or any(x is None for x in ratios) or gap is None:
        return Judgement(Verdict.INCONCLUSIVE, "too few head sizes or offsets, or missing values")
    plain = [r["var_plain"] for r in rows]
    reason = (
        f"Var(q.k)/d_k with RoPE {min(ratios):.3f}..{max(ratios):.3f} (without {min(plain):.3f}..{max(plain):.3f}) "
        f"over d_k {sorted(d_ks)} and offsets {min(offsets)}..{max(offsets)}; scale and rotation commute "
        f"to {gap:.1e}"
    )
    if all(0.8 <= x <= 1.25 for x in ratios) and gap <= 1e-12:
        return Judgement(Verdict.HOLDS, reason)
    if all(0.5 <= x <= 2.0 for x in ratios) and gap <= 1e-6:
        return Judgement(Verdict.HOLDS_APPROXIMATELY, reason)
    return Judgement(Verdict.DOES_NOT_HOLD, reason)


def plot(measured: dict, outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.4), layout="constrained")
    axes = fig.subplots(1, 2)
    rows = measured["rows"]
    for d_k in sorted({r["d_k"] for r in rows}):
        mine = sorted((r for r in rows if r["d_k"] == d_k), key=lambda r: r["offset"])
        xs = [r["offset"] + 1 for r in mine]
        (line,) = axes[0].plot(xs, [r["var_rope"] for r in mine], "o-", ms=3, label=f"d_k={d_k}, RoPE")
        axes[0].plot(xs, [r["var_plain"] for r in mine], "x:", color=line.get_color(), label=f"d_k={d_k}, no RoPE")
        axes[1].plot(xs, [r["mean_self_rope"] for r in mine], "o-", ms=3, color=line.get_color(), label=f"d_k={d_k}")
    axes[0].axhspan(0.8, 1.25, color="green", alpha=0.1)
    axes[0].set_ylabel("Var(q.k) / d_k, iid q and k")
    axes[1].axhline(0.0, color="gray", lw=0.8)
    axes[1].set_ylabel("mean q.k / d_k for k = q (correlated)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("relative offset n - m, plus 1")
        ax.grid(True, alpha=0.3)
    axes[0].set_title("independent q and k")
    axes[1].set_title("correlated: k = q")
    axes[0].legend(fontsize=9, ncol=2, framealpha=0.8)
    axes[1].legend(fontsize=9, framealpha=0.8)
    fig.suptitle("RoPE keeps the variance law for independent q, k; it reshapes correlated ones")
    return [save_figure(fig, outdir, "rope_variance")]


def captions(measured: dict) -> dict[str, str]:
    return {
        "rope_variance": (
            "Left: Var(q.k) / d_k for independent q and k at each relative offset, with RoPE (circles) and without "
            "(crosses), one colour per d_k; points inside the green band mean RoPE keeps the variance law at every "
            "offset. Right: the mean of q.k / d_k when k = q: for correlated q and k, RoPE makes the score depend "
            "on the offset."
        )
    }
