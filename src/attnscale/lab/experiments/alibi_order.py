"""ALiBi's bias added after the 1/sqrt(d_k) scale (attnscale's order) or inside the scaled term.

After:  logits = q.k / sqrt(d_k) - m (i - j)          effective slope m
Before: logits = (q.k - m (i - j)) / sqrt(d_k)        effective slope m / sqrt(d_k)

The "before" order is computed by attnscale too, with the bias folded into the dot product:
q' = [q, -m i, m] and k' = [k, 1, j] give q'.k' = q.k - m (i - j), exact under a causal mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

import attnscale

from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="alibi-order",
    statement=(
        "ALiBi's distance penalty belongs after the 1/sqrt(d_k) scale, in logit units; added before "
        "the scale it is divided too, so every head's slope shrinks by sqrt(d_k)."
    ),
    sources=("Press et al. 2022 (ALiBi), sec. 3",),
    method=(
        "Causal attention over S positions with the standard ALiBi slopes for H heads, for several "
        "d_k. After: attnscale.scaled_dot_product_attention with alibi_slopes. Before: attnscale on "
        "q' = [q, -m i, m], k' = [k, 1, j] with scale 1/sqrt(d_k), so the bias sits inside the scaled "
        "term. With one-hot values the output is the probability matrix p; the effective slope is "
        "minus the pooled within-row least-squares slope of log p_ij on the distance i - j. Fitted "
        "with zero q and k (the bias alone, so the fit is exact) and with iid N(0, 1) q and k (the "
        "content adds noise to the fit)."
    ),
    rule=(
        "On the zero-content fits, per d_k and head: ratio = slope after / slope before, compared "
        "with sqrt(d_k). Holds: within 1% for every d_k and head. Holds approximately: within 10%. "
        "Does not hold: otherwise. Inconclusive: fewer than 2 head sizes, or missing or non-finite "
        "slopes."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "a4ba6618cfbd101e"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "f10dc4f22f937bc1"),
    ),
)


HEADLINE = Headline(
    "worst_ratio_error",
    "largest |fitted slope ratio / sqrt(d_k) - 1| with the bias before the scale",
)
"""max |(slope after / slope before) / sqrt(d_k) - 1| over d_k and heads, zero content."""


@dataclass(frozen=True)
class Config:
    d_ks: tuple[int, ...] = (16, 64, 256)
    heads: int = 8
    length: int = 64
    batch: int = 8

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(d_ks=(16, 64), heads=4, length=32, batch=2)
        if profile == "quick":
            return cls()
        if profile == "default":
            return cls(d_ks=(16, 32, 64, 128, 256), length=128, batch=32)
        return cls(d_ks=(8, 16, 32, 64, 128, 256, 512), heads=16, length=256, batch=64)


def effective_slopes(p: torch.Tensor) -> torch.Tensor:
    """Minus the pooled within-row slope of log p_ij on distance i - j over visible keys j <= i.

    p: (B, H, L, L) causal probabilities; returns (H,). Rows with one visible key carry no slope.
    """
    L = p.shape[-1]
    i = torch.arange(L).unsqueeze(-1)
    j = torch.arange(L).unsqueeze(0)
    visible = (j <= i).to(p.dtype)  # (L, L)
    dist = (i - j).to(p.dtype)
    logp = torch.where(visible.bool(), p.clamp_min(torch.finfo(p.dtype).tiny).log(), torch.zeros_like(p))
    count = visible.sum(-1, keepdim=True)
    dc = (dist - (dist * visible).sum(-1, keepdim=True) / count) * visible  # (L, L)
    lc = (logp - (logp * visible).sum(-1, keepdim=True) / count) * visible  # (B, H, L, L)
    return -(dc * lc).sum(dim=(0, -1, -2)) / (dc**2).sum() / p.shape[0]


def probabilities(q: torch.Tensor, k: torch.Tensor, slopes: torch.Tensor, *, order: str) -> torch.Tensor:
    """Causal attention probabilities (B, H, L, L) with ALiBi after or before the 1/sqrt(D) scale."""
    B, H, L, D = q.shape
    eye = torch.eye(L, dtype=q.dtype).expand(1, H, L, L)  # one-hot values: the output is p
    if order == "after":
        return attnscale.scaled_dot_product_attention(q, k, eye, is_causal=True, alibi_slopes=slopes)
    pos = torch.arange(L, dtype=q.dtype).reshape(1, 1, L, 1)
    m = slopes.to(q.dtype).reshape(1, H, 1, 1)
    q_aug = torch.cat([q, (-m * pos).expand(B, H, L, 1), m.expand(B, H, L, 1)], dim=-1)  # (B, H, L, D + 2)
    k_aug = torch.cat([k, torch.ones(B, H, L, 1, dtype=q.dtype), pos.expand(B, H, L, 1)], dim=-1)
    return attnscale.scaled_dot_product_attention(q_aug, k_aug, eye, is_causal=True, scale=1.0 / math.sqrt(D))


def run(config: Config, seed: int, progress: Progress) -> dict:
    gen = torch.Generator().manual_seed(seed)
    slopes = attnscale.alibi_slopes(config.heads).double()
    B, H, L = config.batch, config.heads, config.length
    rows = []
    for done, d_k in enumerate(config.d_ks):
        zeros = torch.zeros(1, H, L, d_k, dtype=torch.float64)
        q = torch.randn(B, H, L, d_k, generator=gen, dtype=torch.float64)  # (B, H, L, D)
        k = torch.randn(B, H, L, d_k, generator=gen, dtype=torch.float64)  # (B, H, S = L, D)
        fits = {}
        for order in ("after", "before"):
            fits[order] = effective_slopes(probabilities(zeros, zeros, slopes, order=order))
            fits[f"{order}_noisy"] = effective_slopes(probabilities(q, k, slopes, order=order))
        for h in range(H):
            row = {"d_k": d_k, "head": h, "slope": float(slopes[h])}
            row |= {name: float(value[h]) for name, value in fits.items()}
            row["ratio"] = row["after"] / row["before"]
            rows.append(row)
        progress(done + 1, len(config.d_ks))
    worst = max(abs(r["ratio"] / math.sqrt(r["d_k"]) - 1.0) for r in rows)
    return {"heads": H, "length": L, "worst_ratio_error": worst, "rows": rows}


def judge(measured: dict) -> Judgement:
    try:
        rows = measured["rows"]
        errors = [(r["d_k"], r["head"], r["ratio"] / math.sqrt(r["d_k"]) - 1.0) for r in rows]
    except (KeyError, TypeError, ZeroDivisionError):
        return Judgement(Verdict.INCONCLUSIVE, "the measurement lacks fitted slopes")
    if len({d for d, _, _ in errors}) < 2:
        return Judgement(Verdict.INCONCLUSIVE, "fewer than 2 head sizes")
    if any(not math.isfinite(e) for _, _, e in errors):
        return Judgement(Verdict.INCONCLUSIVE, "non-finite fitted slopes")
    worst = max(abs(e) for _, _, e in errors)
    noisy = [abs(r["after_noisy"] / r["slope"] - 1.0) for r in rows if r.get("after_noisy") is not None]
    reason = (
        f"slope after / slope before = sqrt(d_k) within {worst:.2e} over d_k "
        f"{sorted({d for d, _, _ in errors})} and {measured.get('heads')} heads"
    )
    if noisy:
        median = sorted(noisy)[len(noisy) // 2]
        reason += f"; with random q, k the after-scale fit recovers m within a median {median:.1%}"
    if worst <= 0.01:
        return Judgement(Verdict.HOLDS, reason)
    if worst <= 0.1:
        return Judgement(Verdict.HOLDS_APPROXIMATELY, reason)
    return Judgement(Verdict.DOES_NOT_HOLD, reason)


def plot(measured: dict, outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5), layout="constrained")
    ax = fig.subplots()
    rows = measured["rows"]
    slopes = sorted({r["slope"] for r in rows})
    ax.plot(slopes, slopes, color="black", lw=1, label="after the scale (attnscale)")
    for d_k in sorted({r["d_k"] for r in rows}):
        mine = sorted((r for r in rows if r["d_k"] == d_k), key=lambda r: r["slope"])
        xs = [r["slope"] for r in mine]
        (line,) = ax.plot(xs, [r["before"] for r in mine], "-", label=f"before the scale, d_k={d_k}")
        for key, marker in (("before_noisy", "x"), ("after_noisy", "+")):
            pts = [(r["slope"], r[key]) for r in mine if r[key] > 0]  # noise can push a fit below 0
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("ALiBi slope m of the head")
    ax.set_ylabel("effective slope fitted from log p")
    ax.set_title("ALiBi before vs after the scale\nlines: q = k = 0; x (before), + (after): random q, k, positive fits")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return [save_figure(fig, outdir, "alibi_order")]


def captions(measured: dict) -> dict[str, str]:
    d_ks = ", ".join(str(d) for d in sorted({r["d_k"] for r in measured["rows"]}))
    return {
        "alibi_order": (
            "The slope fitted from each head's attention against the ALiBi slope m it was given, on log axes. "
            "The black diagonal is the penalty added after the scale: the head keeps its slope. Each coloured "
            f"line adds it before the scale (d_k = {d_ks}): a line parallel to the diagonal and lower by a factor "
            "sqrt(d_k) is the shrink the claim describes. The x and + marks repeat the fits with random q and k."
        )
    }
