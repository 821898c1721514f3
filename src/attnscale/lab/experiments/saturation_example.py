"""The saturation example (docs/claims.md): d_k = 128, 64 keys, standard normal q and k, with and without the scale.

The claim quotes one draw ("unscaled max ~= 0.99, scaled max ~= 0.05"). One draw says little, so the
experiment measures the distribution of the largest attention probability over many draws, both
ways, and places the quoted numbers in it.

>>> m = run(Config.for_profile("tiny"), seed=0, progress=lambda done, total: None)
>>> m["unscaled_max_prob_median"] > 0.5 > m["scaled_max_prob_median"]
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnscale import scaled_dot_product_attention

from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="saturation-example",
    statement=(
        "For d_k = 128 and 64 keys with standard normal q and k, unscaled attention is near one-hot (a "
        "largest probability of about 0.99) while scaled attention stays soft (about 0.05)."
    ),
    sources=("Vaswani et al. 2017, sec. 3.2.1 and footnote 4",),
    method="Many independent draws of one query and 64 keys with iid N(0, 1) components at d_k = 128; "
    "attnscale.scaled_dot_product_attention with return_stats=True gives each draw's largest attention "
    "probability with scale 1 (unscaled) and the default 1/sqrt(d_k) (scaled). Reported: median, mean and "
    "quantiles of that maximum, a distribution-free 95% interval for each median, the share of near one-hot "
    "draws (max > 0.9), and the claim's quoted values beside them.",
    rule="inconclusive with fewer than 100 draws or non-finite results; does-not-hold unless the unscaled median "
    "of the largest probability is >= 0.9 (near one-hot in a typical draw) and the scaled median is <= 0.25 (soft); "
    "holds if in addition each quoted number lies inside the measured interquartile range of its own case (it is "
    "then a typical single draw); holds-approximately if the qualitative claim holds but a quoted number falls "
    "outside that range (the reason gives the factor between quoted and measured median).",
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "dc70b514ea9bfc13"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "0fffcf6a7aee809a"),
    ),
)
HEADLINE = Headline(
    "scaled_max_prob_median",
    "median largest attention probability with the scale (d_k 128, 64 keys)",
)

QUOTED = {"unscaled": 0.99, "scaled": 0.05}
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
ONE_HOT = 0.9
SOFT = 0.25
MIN_DRAWS = 100
BINS = 50


@dataclass(frozen=True)
class Config:
    d_k: int = 128
    keys: int = 64
    draws: int = 50_000
    chunk: int = 1000

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        draws = {"tiny": 200, "quick": 10_000, "default": 50_000, "full": 500_000}[profile]
        return cls(draws=draws)


def _median_interval(sorted_values: torch.Tensor) -> tuple[float, float]:
    """Distribution-free 95% interval for the median from order statistics (normal approximation)."""
    n = sorted_values.numel()
    half = 1.96 * math.sqrt(n) / 2
    lo = max(int(math.floor(n / 2 - half)), 0)
    hi = min(int(math.ceil(n / 2 + half)), n - 1)
    return sorted_values[lo].item(), sorted_values[hi].item()


def _summary(max_prob: torch.Tensor, prefix: str) -> dict[str, Any]:
    values = max_prob.double().sort().values
    qs = torch.quantile(values, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    lo, hi = _median_interval(values)
    return {
        f"{prefix}_max_prob_median": qs[2],
        f"{prefix}_max_prob_mean": values.mean().item(),
        f"{prefix}_max_prob_median_ci95": [lo, hi],
        f"{prefix}_max_prob_quantiles": {f"q{round(q * 100):02d}": v for q, v in zip(QUANTILES, qs, strict=True)},
        f"{prefix}_share_near_one_hot": (values > ONE_HOT).double().mean().item(),
    }


def run(config: Config, seed: int, progress: Progress) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    unscaled, scaled, score_sq = [], [], 0.0
    done = 0
    while done < config.draws:
        n = min(config.chunk, config.draws - done)
        q = torch.randn(n, 1, 1, config.d_k, generator=gen)  # (N, H=1, L=1, D)
        k = torch.randn(n, 1, config.keys, config.d_k, generator=gen)  # (N, H=1, S, D)
        v = torch.zeros(n, 1, config.keys, 1)  # (N, H=1, S, Dv=1): only the statistics are used
        _, raw = scaled_dot_product_attention(q, k, v, scale=1.0, return_stats=True)
        _, soft = scaled_dot_product_attention(q, k, v, return_stats=True)
        unscaled.append(raw.max_prob.flatten())
        scaled.append(soft.max_prob.flatten())
        score_sq += (q @ k.transpose(-1, -2)).square().sum().item()
        done += n
        progress(done, config.draws)
    unscaled_all, scaled_all = torch.cat(unscaled), torch.cat(scaled)
    return {
        "d_k": config.d_k,
        "keys": config.keys,
        "draws": config.draws,
        "unscaled_score_std": math.sqrt(score_sq / (config.draws * config.keys)),
        **_summary(unscaled_all, "unscaled"),
        **_summary(scaled_all, "scaled"),
        "uniform_max_prob": 1.0 / config.keys,
        "quoted": dict(QUOTED),
        "histogram": {
            "bins": BINS,
            "unscaled": torch.histc(unscaled_all, bins=BINS, min=0.0, max=1.0).long().tolist(),
            "scaled": torch.histc(scaled_all, bins=BINS, min=0.0, max=1.0).long().tolist(),
        },
    }


def judge(measured: dict[str, Any]) -> Judgement:
    medians = {case: measured[f"{case}_max_prob_median"] for case in ("unscaled", "scaled")}
    if measured["draws"] < MIN_DRAWS or not all(math.isfinite(m) for m in medians.values()):
        return Judgement(Verdict.INCONCLUSIVE, f"{measured['draws']} draws (needs >= {MIN_DRAWS}) or non-finite medians")
    shown = f"median largest probability {medians['unscaled']:.3g} unscaled, {medians['scaled']:.3g} scaled"
    if medians["unscaled"] < ONE_HOT or medians["scaled"] > SOFT:
        return Judgement(
            Verdict.DOES_NOT_HOLD,
            f"{shown}: needs >= {ONE_HOT} unscaled (near one-hot) and <= {SOFT} scaled (soft)",
        )
    outside = []
    for case, quoted in measured["quoted"].items():
        qs = measured[f"{case}_max_prob_quantiles"]
        if not qs["q25"] <= quoted <= qs["q75"]:
            factor = medians[case] / quoted
            outside.append(
                f"the quoted {case} {quoted} is outside the measured interquartile range "
                f"[{qs['q25']:.3g}, {qs['q75']:.3g}] (measured median = {factor:.2g} x quoted)"
            )
    if outside:
        return Judgement(Verdict.HOLDS_APPROXIMATELY, f"{shown}; but " + "; ".join(outside))
    return Judgement(Verdict.HOLDS, f"{shown}; both quoted numbers are typical draws (inside the interquartile range)")


def plot(measured: dict[str, Any], outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    hist = measured["histogram"]
    width = 1.0 / hist["bins"]
    lefts = [i * width for i in range(hist["bins"])]
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    cases = (("unscaled", "#c44e52", "upper left"), ("scaled", "#4c72b0", "upper right"))
    for ax, (case, colour, corner) in zip(axes, cases, strict=True):
        share = [c / measured["draws"] for c in hist[case]]
        ax.bar(lefts, share, width=width, align="edge", color=colour, alpha=0.8)
        median = measured[f"{case}_max_prob_median"]
        quoted = measured["quoted"][case]
        ax.axvline(median, color="black", lw=1.5, label=f"measured median {median:.3g}")
        ax.axvline(quoted, color="black", ls="--", label=f"claimed value {quoted}")
        ax.axvline(measured["uniform_max_prob"], color="grey", ls=":", label=f"uniform 1/{measured['keys']}")
        ax.set_xlim(0, 1)
        ax.set_xlabel("largest attention probability of a draw")
        divisor = "1 (unscaled)" if case == "unscaled" else "sqrt(d_k) (scaled)"
        ax.set_title(f"q.k / {divisor}")
        ax.legend(fontsize=8, loc=corner)
    axes[0].set_ylabel("share of draws")
    fig.suptitle(f"d_k = {measured['d_k']}, {measured['keys']} keys, {measured['draws']} draws", fontsize=10)
    return [save_figure(fig, outdir, "max_prob_histograms")]


def captions(measured: dict[str, Any]) -> dict[str, str]:
    return {
        "max_prob_histograms": (
            f"The largest attention probability in each of {measured['draws']} draws of d_k = {measured['d_k']}, "
            f"{measured['keys']} keys, unscaled (left) and scaled by 1/sqrt(d_k) (right). The solid line is the "
            f"measured median ({measured['unscaled_max_prob_median']:.3g} unscaled, "
            f"{measured['scaled_max_prob_median']:.3g} scaled), the dashed line the value the claim quotes: look at "
            "whether each dashed line falls inside its histogram's bulk."
        )
    }
