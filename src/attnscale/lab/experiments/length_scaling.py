"""Does a fixed logit gap stay decisive as the number of keys grows?

One key sits ``g`` logits above ``n - 1`` equal keys. With a fixed scale its probability is

    p(n) = 1 / (1 + (n - 1) exp(-g))            -> 0 as n grows,

while Scalable-Softmax multiplies the logits by ``s log n``:

    p(n) = 1 / (1 + (n - 1) n^(-s g))           -> 1 if s g > 1, 1/2 if s g = 1, 0 if s g < 1.

So log-n scaling keeps a gap decisive only when the gap exceeds 1/s.

Equal distractors are the claim's setting. With N(0, 1) distractor logits instead (reported, not
judged) the largest distractor grows like sqrt(2 log n), so for any fixed gap one of them overtakes
the leading key as n grows, and s log n amplifies whichever key is largest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

import attnscale
from attnscale.variants import ssmax_qk, visible_key_counts

from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="length-scaling",
    statement=(
        "With a fixed scale, the attention paid to a key that leads the others by a fixed logit gap "
        "fades as the number of keys grows; multiplying the logits by s log n keeps that key decisive."
    ),
    sources=("Chiang and Cholak 2022 (log n scaling of the logits)", "Nakanishi 2025 (Scalable-Softmax)"),
    method=(
        "For n from 2 to n_max keys and several gaps g, attnscale.scaled_dot_product_attention runs "
        "on one query and n keys built so that q.k is g for one key and 0 for the others (D = 2), "
        "with values that are 1 on that key and 0 elsewhere, so the output is its probability. "
        "The scale is 1 (fixed), or the query is multiplied by s log n with "
        "attnscale.variants.ssmax_qk (Scalable-Softmax) and the scale is 1. Both are compared with "
        "the closed forms 1 / (1 + (n - 1) e^-g) and 1 / (1 + (n - 1) n^-sg)."
    ),
    rule=(
        "Spread: with the fixed scale the probability falls and is below 0.1 at n_max for every gap. "
        "Decisive: with s log n it is at least 0.5 at n_max. Holds: spread, and every measured gap "
        "stays decisive. Holds approximately: spread, and every gap with s g > 1 stays decisive "
        "while some smaller gap does not. Does not hold: the fixed scale does not spread, or a gap "
        "with s g > 1 is not decisive. Inconclusive: measurement and closed form differ by more than "
        "1e-5, n_max / n_min < 100, or missing values."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "1699a479954510e9"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "dcc750c737562d4c"),
    ),
)


HEADLINE = Headline("smallest_decisive_gap", "smallest logit gap that s log n keeps decisive")
"""The smallest measured gap whose key keeps probability >= 0.5 at n_max under s log n."""


@dataclass(frozen=True)
class Config:
    gaps: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    s: float = 1.0
    max_log2_n: int = 16
    points: int = 30
    draws: int = 16
    noisy_max_log2_n: int = 16

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(max_log2_n=12, points=12, draws=4, noisy_max_log2_n=12)
        if profile == "quick":
            return cls(draws=8)
        if profile == "default":
            return cls(max_log2_n=20, points=60, draws=32)
        return cls(
            gaps=(0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0), max_log2_n=22, points=100, draws=128, noisy_max_log2_n=20
        )


def closed_form(n: int, gap: float, scale: float) -> float:
    """Probability of the leading key: 1 / (1 + (n - 1) exp(-gap * scale))."""
    return 1.0 / (1.0 + (n - 1) * math.exp(-gap * scale))


def leading_probability(n: int, gap: float, *, s: float | None, distractors: torch.Tensor | None = None) -> float:
    """attnscale's probability of the key whose q.k is ``gap`` among n - 1 other keys, mean over rows.

    The other keys have q.k = 0, or the logits ``distractors`` (R, n - 1), one row per draw.
    ``s = None``: fixed scale 1. Otherwise Scalable-Softmax: the query rows are multiplied by
    ``s log n`` (``attnscale.variants.ssmax_qk``) and attention runs with scale 1.
    """
    z = torch.zeros(1, n - 1, dtype=torch.float64) if distractors is None else distractors
    R = z.shape[0]
    q = torch.tensor([gap, 1.0], dtype=torch.float64).expand(R, 1, 1, 2)  # (B = R, H, L, D = 2)
    k = torch.zeros(R, 1, n, 2, dtype=torch.float64)  # (B, Hkv, S = n, D): q.k = gap, then z
    k[:, 0, 0, 0] = 1.0
    k[:, 0, 1:, 1] = z
    v = torch.zeros(1, 1, n, 1, dtype=torch.float64).expand(R, 1, n, 1).clone()  # 1 on the leading key
    v[:, 0, 0, 0] = 1.0
    if s is not None:
        q, k = ssmax_qk(q, k, s, n=visible_key_counts(1, n))
    return float(attnscale.scaled_dot_product_attention(q, k, v, scale=1.0).mean())


def run(config: Config, seed: int, progress: Progress) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ns = sorted({round(2**x) for x in torch.linspace(1, config.max_log2_n, config.points).tolist()})
    curves = []
    total = len(config.gaps)
    for done, gap in enumerate(config.gaps):
        points = []
        for n in ns:
            point: dict = {"n": n}
            point["fixed"] = leading_probability(n, gap, s=None)
            point["fixed_closed_form"] = closed_form(n, gap, 1.0)
            point["log_n"] = leading_probability(n, gap, s=config.s)
            point["log_n_closed_form"] = closed_form(n, gap, config.s * math.log(n))
            point["fixed_noisy"] = point["log_n_noisy"] = None
            if n <= 2**config.noisy_max_log2_n:
                z = torch.randn(config.draws, n - 1, generator=gen, dtype=torch.float64)
                point["fixed_noisy"] = leading_probability(n, gap, s=None, distractors=z)
                point["log_n_noisy"] = leading_probability(n, gap, s=config.s, distractors=z)
            points.append(point)
        curves.append({"gap": gap, "s_times_gap": config.s * gap, "points": points})
        progress(done + 1, total)
    worst = max(
        abs(p[name] - p[f"{name}_closed_form"]) for c in curves for p in c["points"] for name in ("fixed", "log_n")
    )
    decisive = [c["gap"] for c in curves if c["points"][-1]["log_n"] >= 0.5]
    return {
        "s": config.s,
        "n_min": ns[0],
        "n_max": ns[-1],
        "smallest_decisive_gap": min(decisive) if decisive else None,
        "curves": curves,
        "max_abs_closed_form_error": worst,
    }


def judge(measured: dict) -> Judgement:
    try:
        curves, err = measured["curves"], measured["max_abs_closed_form_error"]
        n_min, n_max = measured["n_min"], measured["n_max"]
        summary = []
        for c in curves:
            first, last = c["points"][0], c["points"][-1]
            summary.append((c["gap"], c["s_times_gap"], first["fixed"], last["fixed"], last["log_n"]))
    except (KeyError, TypeError, IndexError):
        return Judgement(Verdict.INCONCLUSIVE, "the measurement lacks the probability curves")
    if err is None or err > 1e-5:
        return Judgement(Verdict.INCONCLUSIVE, f"measurement and closed form differ by {err}")
    if not summary or n_max / n_min < 100:
        return Judgement(Verdict.INCONCLUSIVE, f"key counts {n_min}..{n_max} are too narrow")
    text = "; ".join(f"g={g:g}: fixed {f0:.3g} -> {f1:.3g}, s log n {l1:.3g}" for g, _, f0, f1, l1 in summary)
    reason = f"leading-key probability from n={n_min} to n={n_max}: {text}"
    spread = all(f1 < f0 and f1 < 0.1 for _, _, f0, f1, _ in summary)
    decisive = {g: l1 >= 0.5 for g, _, _, _, l1 in summary}
    above = [g for g, sg, *_ in summary if sg > 1]
    if not spread or not all(decisive[g] for g in above):
        return Judgement(Verdict.DOES_NOT_HOLD, reason + noisy_note(measured))
    if all(decisive.values()):
        return Judgement(Verdict.HOLDS, reason + noisy_note(measured))
    reason += noisy_note(measured)
    return Judgement(Verdict.HOLDS_APPROXIMATELY, reason + "; s log n keeps a gap decisive only when s g > 1")


def noisy_note(measured: dict) -> str:
    """The largest gap's probability at the largest n measured among N(0, 1) distractors, if any."""
    last = max(measured["curves"], key=lambda c: c["gap"])
    points = [p for p in last["points"] if p.get("log_n_noisy") is not None]
    if not points:
        return ""
    point = points[-1]
    return (
        f"; among N(0, 1) distractors instead of equal ones (not judged), g={last['gap']:g} keeps "
        f"{point['fixed_noisy']:.3g} (fixed) and {point['log_n_noisy']:.3g} (s log n) at n={point['n']}"
    )


def plot(measured: dict, outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5.0), layout="constrained")
    axes = fig.subplots(1, 2)
    panels = ((axes[0], "", "n - 1 equal distractors"), (axes[1], "_noisy", "n - 1 distractors with N(0, 1) logits"))
    for ax, suffix, title in panels:
        for c in measured["curves"]:
            pts = [p for p in c["points"] if p.get(f"fixed{suffix}") is not None]
            ns = [p["n"] for p in pts]
            (line,) = ax.plot(ns, [p[f"fixed{suffix}"] for p in pts], "--", label=f"g={c['gap']:g}, fixed scale")
            ax.plot(ns, [p[f"log_n{suffix}"] for p in pts], "-", color=line.get_color(), label=f"g={c['gap']:g}, s log n")
        ax.axhline(0.5, color="gray", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("number of keys n")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.set_ylabel("probability of the leading key (mean)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=9)
    fig.suptitle(f"One key g logits above the others (s = {measured['s']:g})")
    return [save_figure(fig, outdir, "length_scaling")]


def captions(measured: dict) -> dict[str, str]:
    return {
        "length_scaling": (
            "The probability of a key that leads the others by g logits as the number of keys n grows from "
            f"{measured['n_min']} to {measured['n_max']}, one colour per gap g: dashed with the fixed scale, solid "
            f"with the logits multiplied by s log n (s = {measured['s']:g}); left with equal distractors, right with "
            "noisy ones. Look for dashed lines that fall as n grows and solid lines that stay above the dotted line, "
            "where the leading key holds half the mass."
        )
    }
