"""Where gradients through softmax vanish, compared with where fp16 overflows, in logit units.

Three thresholds on one axis, the standard deviation of the logits:

* gradient vanishing: the logit std at which the gradient reaching the off-peak logits falls below
  a fraction (1e-3) of its value at unit-variance logits (fp32, through attnscale);
* fp16 product overflow: the logit std at which a raw fp16 ``q @ k^T`` first holds an inf
  (|q.k| > 65504), with unscaled logits = q.k;
* naive exp overflow: the logit std at which ``exp(logit)`` without max subtraction first overflows
  (fp16 above ~11.09, fp32 above ~88.72). Softmax implementations subtract the row max, so this
  one only concerns hand-written softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

import attnscale

from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="fp16-secondary",
    statement=(
        "Unscaled attention fails through gradient flow, not through fp16 overflow: the gradients "
        "that could move attention vanish at logit magnitudes far below those at which an fp16 q.k "
        "product overflows."
    ),
    sources=(
        "Vaswani et al. 2017, sec. 3.2.1 and footnote 4",
        "IEEE 754-2008, binary16 (largest finite value 65504)",
    ),
    method=(
        "Gradient side (fp32): logits sigma * z, z ~ N(0, 1) over S keys, formed by "
        "attnscale.scaled_dot_product_attention with identity keys (so logits = scale * q); random "
        "values and a random upstream gradient are backpropagated, and per row the norm of the "
        "gradient on the logits of every key except the argmax is taken. Its median and mean over "
        "rows, relative to sigma = 1, give the logit std at which each falls below the threshold "
        "(log-log interpolation on the grid). Overflow side: q, k with iid N(0, a^2) components of "
        "head size d_k in fp16; the smallest a whose raw fp16 q @ k^T holds an inf, converted to the "
        "logit std of the unscaled logits (a^2 sqrt(d_k), measured); attnscale on the same fp16 "
        "inputs is checked to stay finite. Naive exp: the smallest sigma at which exp of the logits "
        "overflows in fp16 and fp32 on the same draws, and the dtype thresholds log(max float)."
    ),
    rule=(
        "gap = (logit std at fp16 product overflow) / (logit std at which the off-peak gradient "
        "falls below 1e-3 of its unit-variance value). Holds: gap >= 10 for both the median and the "
        "mean over rows. Holds approximately: gap >= 10 for the median only, or 2 <= gap < 10 for the "
        "median. Does not hold: gap < 2 for the median. Inconclusive: a threshold not reached on the "
        "grid for the median, no overflow found, or attnscale not finite on the fp16 inputs."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "11348c77e3aa4e8f"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "a658c3d79138f984"),
    ),
)


HEADLINE = Headline(
    "gap.median",
    "logit std where fp16 q.k overflows / where a typical row's off-peak gradient vanishes",
    "x",
)
"""fp16 product overflow / off-peak gradient vanishing, in logit std, for the median row."""


@dataclass(frozen=True)
class Config:
    d_k: int = 128
    keys: int = 64
    rows: int = 256
    value_dim: int = 16
    sigmas: int = 40
    sigma_max: float = 1e5
    activation_scales: int = 40
    threshold: float = 1e-3

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(rows=64, sigmas=20, activation_scales=20)
        if profile == "quick":
            return cls()
        if profile == "default":
            return cls(rows=2048, sigmas=80, activation_scales=80)
        return cls(rows=16384, sigmas=120, activation_scales=120)


def off_peak_gradients(z: torch.Tensor, v: torch.Tensor, upstream: torch.Tensor, sigma: float) -> torch.Tensor:
    """Per row of z (R, S): norm of dLoss/dlogit over all keys but the argmax, logits = sigma * z."""
    R, S = z.shape
    eye = torch.eye(S).reshape(1, 1, S, S)  # keys = identity, so q.k = q
    q = z.reshape(1, 1, R, S).clone().requires_grad_(True)  # (B, H, L, D = S)
    out = attnscale.scaled_dot_product_attention(q, eye, v.reshape(1, 1, S, -1), scale=sigma)
    (out.reshape(R, -1) * upstream).sum().backward()
    grad_logits = q.grad.reshape(R, S) / sigma  # logits = sigma * q
    off = torch.ones_like(z, dtype=torch.bool).scatter(-1, z.argmax(-1, keepdim=True), False)
    return (grad_logits * off).norm(dim=-1)


def crossing(xs: list[float], ys: list[float | None], level: float) -> float | None:
    """First x at which y falls to ``level``, interpolated in log-log; None if it never does."""
    for i in range(1, len(xs)):
        y0, y1 = ys[i - 1], ys[i]
        if y1 is None or y1 > level:
            continue
        if y1 <= 0.0 or y0 is None or y0 <= 0.0 or y0 <= level:
            return xs[i]
        t = (math.log(y0) - math.log(level)) / (math.log(y0) - math.log(y1))
        return math.exp(math.log(xs[i - 1]) + t * (math.log(xs[i]) - math.log(xs[i - 1])))
    return None


def exp_overflow_point(dtype: torch.dtype) -> float:
    """Smallest x (to bisection precision) at which torch.exp(x) in ``dtype`` is inf."""
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if torch.isinf(torch.exp(torch.tensor(mid, dtype=dtype))):
            hi = mid
        else:
            lo = mid
    return hi


def run(config: Config, seed: int, progress: Progress) -> dict:
    gen = torch.Generator().manual_seed(seed)
    R, S, D = config.rows, config.keys, config.d_k
    total = config.sigmas + config.activation_scales
    z = torch.randn(R, S, generator=gen)
    v = torch.randn(S, config.value_dim, generator=gen)
    upstream = torch.randn(R, config.value_dim, generator=gen)
    sigmas = torch.logspace(-1, math.log10(config.sigma_max), config.sigmas, dtype=torch.float64).tolist()
    sigmas = sorted({*sigmas, 1.0})
    gradient_rows = []
    for i, sigma in enumerate(sigmas):
        g = off_peak_gradients(z, v, upstream, sigma)
        gradient_rows.append({"logit_std": sigma, "median": float(g.median()), "mean": float(g.mean())})
        progress(min(i + 1, config.sigmas), total)
    unit = next(r for r in gradient_rows if r["logit_std"] == 1.0)
    for r in gradient_rows:
        r["median_rel"] = r["median"] / unit["median"]
        r["mean_rel"] = r["mean"] / unit["mean"]
    xs = [r["logit_std"] for r in gradient_rows]
    vanish_median = crossing(xs, [r["median_rel"] for r in gradient_rows], config.threshold)
    vanish_mean = crossing(xs, [r["mean_rel"] for r in gradient_rows], config.threshold)

    naive = {}
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        first = next((s for s in sigmas if torch.isinf(torch.exp((s * z).to(dtype))).any()), None)
        naive[name] = {"exp_overflow_at": exp_overflow_point(dtype), "first_logit_std": first}

    overflow = None
    attnscale_finite = True
    q0 = torch.randn(1, 1, S, D, generator=gen)  # (B, H, L, D)
    k0 = torch.randn(1, 1, S, D, generator=gen)  # (B, Hkv, S, D)
    v0 = torch.randn(1, 1, S, D, generator=gen)
    for i, a in enumerate(torch.logspace(0, 3, config.activation_scales, dtype=torch.float64).tolist()):
        q16, k16 = (a * q0).half(), (a * k0).half()
        raw16 = q16 @ k16.transpose(-1, -2)  # fp16 products and sums, as a naive fp16 kernel does
        progress(config.sigmas + i + 1, total)
        if torch.isinf(raw16).any():
            out = attnscale.scaled_dot_product_attention(q16, k16, v0.half(), scale=1.0)
            attnscale_finite = bool(torch.isfinite(out).all())
            raw32 = q16.float() @ k16.float().transpose(-1, -2)
            overflow = {
                "activation_std": a,
                "logit_std": float(raw32.std()),
                "max_abs_logit": float(raw32.abs().max()),
                "attnscale_fp16_finite": attnscale_finite,
            }
            break
    progress(total, total)

    def gap(vanish: float | None) -> float | None:
        return overflow["logit_std"] / vanish if overflow and vanish else None

    return {
        "d_k": D,
        "keys": S,
        "threshold": config.threshold,
        "gradients": gradient_rows,
        "vanish_logit_std": {"median": vanish_median, "mean": vanish_mean},
        "fp16_product_overflow": overflow,
        "naive_exp_overflow": naive,
        "gap": {"median": gap(vanish_median), "mean": gap(vanish_mean)},
    }


def judge(measured: dict) -> Judgement:
    try:
        gap, overflow = measured["gap"], measured["fp16_product_overflow"]
        vanish = measured["vanish_logit_std"]
        naive16 = measured["naive_exp_overflow"]["fp16"]["first_logit_std"]
    except (KeyError, TypeError):
        return Judgement(Verdict.INCONCLUSIVE, "the measurement lacks thresholds")
    if overflow is None:
        return Judgement(Verdict.INCONCLUSIVE, "no fp16 product overflow on the activation grid")
    if not overflow.get("attnscale_fp16_finite", False):
        return Judgement(Verdict.INCONCLUSIVE, "attnscale was not finite on the overflowing fp16 inputs")
    if gap.get("median") is None:
        return Judgement(Verdict.INCONCLUSIVE, "the median off-peak gradient never fell below the threshold")
    g_med, g_mean = gap["median"], gap.get("mean")
    mean_gap = f"{g_mean:.3g}x" if g_mean is not None else "none"
    mean_std = f"{vanish['mean']:.3g}" if vanish.get("mean") is not None else "not reached"
    reason = (
        f"off-peak gradient below {measured.get('threshold')} of its unit-variance value at logit std "
        f"{vanish['median']:.3g} (median row) / {mean_std} (mean over rows); fp16 q.k overflows at logit "
        f"std {overflow['logit_std']:.3g}: gap {g_med:.3g}x (median), {mean_gap} (mean)"
    )
    if naive16 is not None:
        reason += f"; a naive fp16 exp (no max subtraction) already overflows at logit std {naive16:.3g}"
    if g_med >= 10 and g_mean is not None and g_mean >= 10:
        return Judgement(Verdict.HOLDS, reason)
    if g_med >= 2:
        return Judgement(Verdict.HOLDS_APPROXIMATELY, reason)
    return Judgement(Verdict.DOES_NOT_HOLD, reason)


def plot(measured: dict, outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.subplots()
    rows = measured["gradients"]
    xs = [r["logit_std"] for r in rows]
    for key, label in (("median_rel", "median row"), ("mean_rel", "mean over rows")):
        pts = [(x, r[key]) for x, r in zip(xs, rows, strict=True) if r[key] is not None and r[key] > 0]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"off-peak gradient, {label}")
    ax.axhline(measured["threshold"], color="gray", ls=":", lw=1, label="threshold")
    lines = []
    overflow = measured["fp16_product_overflow"]
    if overflow:
        lines.append((overflow["logit_std"], "fp16 q.k overflows", "red"))
    for name, color in (("fp16", "orange"), ("fp32", "purple")):
        first = measured["naive_exp_overflow"][name]["first_logit_std"]
        if first is not None:
            lines.append((first, f"naive {name} exp overflows", color))
    for x, label, color in lines:
        ax.axvline(x, color=color, ls="--", lw=1, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("logit std (unscaled logits = q.k)")
    ax.set_ylabel("off-peak gradient / its value at logit std 1")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"Gradient vanishing vs overflow, d_k = {measured['d_k']}, {measured['keys']} keys")
    return [save_figure(fig, outdir, "fp16_secondary")]


def captions(measured: dict) -> dict[str, str]:
    overflow = (
        "the red dashed line is where an fp16 q.k product overflows"
        if measured["fp16_product_overflow"]
        else "no fp16 q.k product overflowed on the measured grid"
    )
    return {
        "fp16_secondary": (
            "How the gradient that could move attention off its peak shrinks as the unscaled logits grow (log axes), "
            f"relative to its value at unit logit std; the dotted line is the rule's threshold ({measured['threshold']:g}), "
            f"and {overflow} (the other dashed lines: a naive exp overflowing). Look at the distance along the x axis "
            "between where the curves cross the dotted line and the overflow line: the claim needs the gradient to "
            "vanish far to the left of the overflow."
        )
    }
