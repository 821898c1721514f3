"""Which divisor of q.k keeps the scores at unit variance for every head size?

Candidates: 1, sqrt(d_k), d_k, sqrt(d_model) with d_model = d_k * num_heads, sqrt(num_heads),
log d_k, and a learned temperature. For each divisor and d_k the experiment draws iid standard
normal queries and keys (the regime the 1/sqrt(d_k) derivation assumes) and measures what softmax
does with the scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

import attnscale

from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="divisor-table",
    statement=(
        "Of the divisors 1, sqrt(d_k), d_k, sqrt(d_model), sqrt(num_heads) and log d_k, only sqrt(d_k) "
        "keeps the variance of the scores near 1 for every head size d_k: no division saturates "
        "softmax, d_k flattens it, and sqrt(d_model) is off by the number of heads."
    ),
    sources=("Vaswani et al. 2017, sec. 3.2.1 and footnote 4",),
    method=(
        "For d_k in a range of head sizes, draw iid N(0, 1) queries and keys, divide q.k by each "
        "candidate divisor (d_model = d_k * num_heads) and run attnscale.scaled_dot_product_attention. "
        "Per divisor and d_k: variance of the divided scores, mean maximum probability, mean entropy "
        "divided by log S, mean off-peak Jacobian mass (sum of |J_ij| over i, j both off the row's "
        "argmax, J = diag(p) - p p^T) and the mean norm, per query row, of the gradient into q when a "
        "random upstream gradient is backpropagated through attention with random values. The learned "
        "temperature is a scalar divisor exp(tau) fitted by gradient descent on a separate batch to "
        "minimise (log Var(q.k / exp(tau)))^2, i.e. the temperature that keeps score variance 1; it "
        "is reported beside the fixed divisors, not judged."
    ),
    rule=(
        "A divisor keeps the variance within the band when 0.8 <= Var <= 1.25 at every measured d_k. "
        "Holds: sqrt(d_k) does, and every other fixed divisor leaves the band at some d_k. "
        "Holds approximately: sqrt(d_k) stays within the wider band 0.5..2 at every d_k but leaves "
        "the narrow one somewhere, and every other fixed divisor leaves the narrow band somewhere. "
        "Does not hold: sqrt(d_k) leaves the wide band at some d_k, or another fixed divisor stays "
        "in the narrow band at every d_k. Inconclusive: fewer than 3 head sizes, a d_k span below a "
        "factor 4, or missing values."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "fe0c117da0697e5d"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "fb009239089b2d3a"),
    ),
)

HEADLINE = Headline("worst_sqrt_dk_var", "score variance with 1/sqrt(d_k), farthest from 1 over d_k")
"""Var of the scores divided by sqrt(d_k), at the d_k where it is farthest from 1 (in log)."""

BAND = (0.8, 1.25)
WIDE_BAND = (0.5, 2.0)
FIXED_DIVISORS = ("1", "sqrt(d_k)", "d_k", "sqrt(d_model)", "sqrt(num_heads)", "log(d_k)")
LEARNED = "learned"
DIVISORS = (*FIXED_DIVISORS, LEARNED)


@dataclass(frozen=True)
class Config:
    d_ks: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    num_heads: int = 8
    batch: int = 8
    queries: int = 64
    keys: int = 64
    fit_steps: int = 100
    fit_lr: float = 0.1

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(d_ks=(8, 32, 128), batch=2, queries=16, keys=32, fit_steps=40)
        if profile == "quick":
            return cls(batch=4)
        if profile == "default":
            return cls(d_ks=(8, 16, 32, 64, 128, 256, 512), batch=16)
        return cls(d_ks=(4, 8, 16, 32, 64, 128, 256, 512, 1024), batch=128)


def divisor_value(name: str, d_k: int, num_heads: int) -> float:
    """The fixed divisor ``name`` for head size ``d_k`` and ``num_heads`` heads."""
    values = {
        "1": 1.0,
        "sqrt(d_k)": math.sqrt(d_k),
        "d_k": float(d_k),
        "sqrt(d_model)": math.sqrt(d_k * num_heads),
        "sqrt(num_heads)": math.sqrt(num_heads),
        "log(d_k)": math.log(d_k),
    }
    return values[name]


def fit_temperature(scores: torch.Tensor, *, steps: int, lr: float) -> float:
    """Gradient descent on tau to minimise (log Var(scores / exp(tau)))^2; returns exp(tau).

    Plain steps with autograd rather than ``torch.optim``, whose import pulls in the compiler stack.
    """
    tau = torch.zeros((), dtype=scores.dtype, requires_grad=True)
    for _ in range(steps):
        loss = torch.log((scores / torch.exp(tau)).var()) ** 2
        (grad,) = torch.autograd.grad(loss, tau)
        with torch.no_grad():
            tau -= lr * grad
    return float(torch.exp(tau.detach()))


def off_peak_jacobian_mass(p: torch.Tensor) -> torch.Tensor:
    """Per row of p (..., S): sum of |J_ij| over i, j != argmax, with J = diag(p) - p p^T."""
    jac = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)  # (..., S, S)
    off = torch.ones_like(p, dtype=torch.bool).scatter(-1, p.argmax(-1, keepdim=True), False)  # (..., S)
    keep = off.unsqueeze(-1) & off.unsqueeze(-2)
    return (jac.abs() * keep).sum(dim=(-1, -2))


def _measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, upstream: torch.Tensor, divisor: float) -> dict:
    S = k.shape[-2]
    scale = 1.0 / divisor
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, 1, L, S)
    eye = torch.eye(S, dtype=q.dtype).expand(*k.shape[:-2], S, S)  # values = one-hot keys: output = p
    p, stats = attnscale.scaled_dot_product_attention(q, k, eye, scale=scale, return_stats=True)
    qg = q.detach().requires_grad_(True)
    out = attnscale.scaled_dot_product_attention(qg, k, v, scale=scale)
    (out * upstream).sum().backward()
    return {
        "score_var": float(scores.var()),
        "max_prob": float(stats.max_prob.mean()),
        "entropy_ratio": float(stats.entropy.mean() / math.log(S)),
        "offpeak_jacobian": float(off_peak_jacobian_mass(p).mean()),
        "grad_q_norm": float(qg.grad.norm(dim=-1).mean()),
    }


def run(config: Config, seed: int, progress: Progress) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B, L, S, H = config.batch, config.queries, config.keys, config.num_heads
    rows = []
    total = len(config.d_ks)
    for done, d_k in enumerate(config.d_ks):
        q = torch.randn(B, 1, L, d_k, generator=gen)  # (B, H=1, L, D)
        k = torch.randn(B, 1, S, d_k, generator=gen)  # (B, Hkv=1, S, D)
        v = torch.randn(B, 1, S, d_k, generator=gen)
        upstream = torch.randn(B, 1, L, d_k, generator=gen)
        fit_q = torch.randn(B, L, d_k, generator=gen)
        fit_k = torch.randn(B, S, d_k, generator=gen)
        learned = fit_temperature(fit_q @ fit_k.transpose(-1, -2), steps=config.fit_steps, lr=config.fit_lr)
        for name in DIVISORS:
            value = learned if name == LEARNED else divisor_value(name, d_k, H)
            rows.append({"divisor": name, "d_k": d_k, "value": value, **_measure(q, k, v, upstream, value)})
        progress(done + 1, total)
    sqrt_vars = [r["score_var"] for r in rows if r["divisor"] == "sqrt(d_k)"]
    worst = max(sqrt_vars, key=lambda x: abs(math.log(x)))
    return {
        "worst_sqrt_dk_var": worst,
        "band": list(BAND),
        "wide_band": list(WIDE_BAND),
        "num_heads": H,
        "keys": S,
        "rows": rows,
    }


def _variances(measured: dict) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for row in measured["rows"]:
        out.setdefault(row["divisor"], {})[int(row["d_k"])] = row["score_var"]
    return out


def judge(measured: dict) -> Judgement:
    try:
        var = _variances(measured)
        d_ks = sorted(var["sqrt(d_k)"])
        missing = [n for n in FIXED_DIVISORS if n not in var or sorted(var[n]) != d_ks]
        bad = [n for n in FIXED_DIVISORS if n in var and any(x is None for x in var[n].values())]
    except (KeyError, TypeError):
        return Judgement(Verdict.INCONCLUSIVE, "the measurement lacks the per-divisor variance table")
    if missing or bad:
        return Judgement(Verdict.INCONCLUSIVE, f"missing or non-finite variances for {missing + bad}")
    if len(d_ks) < 3 or d_ks[-1] / d_ks[0] < 4:
        return Judgement(Verdict.INCONCLUSIVE, f"head sizes {d_ks} are too few or too close to tell divisors apart")

    def within(name: str, band: tuple[float, float]) -> bool:
        return all(band[0] <= x <= band[1] for x in var[name].values())

    sqrt_vars = var["sqrt(d_k)"].values()
    span = f"Var with sqrt(d_k) spans {min(sqrt_vars):.3g}..{max(sqrt_vars):.3g} over d_k {d_ks[0]}..{d_ks[-1]}"
    rivals = [n for n in FIXED_DIVISORS if n != "sqrt(d_k)" and within(n, BAND)]
    learned = [r["value"] / math.sqrt(r["d_k"]) for r in measured["rows"] if r["divisor"] == LEARNED]
    note = f"; the learned temperature ends at {min(learned):.3f}..{max(learned):.3f} x sqrt(d_k)" if learned else ""
    top = {r["divisor"]: r for r in measured["rows"] if r["d_k"] == d_ks[-1]}
    if "1" in top and top["1"].get("grad_q_norm") is not None and top["sqrt(d_k)"].get("grad_q_norm") is not None:
        note += (
            f"; at d_k = {d_ks[-1]} no division leaves off-peak Jacobian mass {top['1']['offpeak_jacobian']:.3g} "
            f"(sqrt(d_k): {top['sqrt(d_k)']['offpeak_jacobian']:.3g}) yet a larger gradient norm into q "
            f"({top['1']['grad_q_norm']:.3g} vs {top['sqrt(d_k)']['grad_q_norm']:.3g}), since it is not multiplied "
            f"by 1/sqrt(d_k) = {1 / math.sqrt(d_ks[-1]):.3g}: the gradient norm alone does not show the collapse"
        )
    if rivals:
        return Judgement(Verdict.DOES_NOT_HOLD, f"{rivals} also keep Var in {BAND} at every d_k; {span}{note}")
    if within("sqrt(d_k)", BAND):
        return Judgement(Verdict.HOLDS, f"{span}, inside {BAND}; every other fixed divisor leaves it{note}")
    if within("sqrt(d_k)", WIDE_BAND):
        return Judgement(Verdict.HOLDS_APPROXIMATELY, f"{span}: outside {BAND} but inside {WIDE_BAND}{note}")
    return Judgement(Verdict.DOES_NOT_HOLD, f"{span}, outside {WIDE_BAND}{note}")


PANELS = (
    ("score_var", "score variance", True),
    ("max_prob", "mean max probability", True),
    ("entropy_ratio", "entropy / log S", False),
    ("offpeak_jacobian", "off-peak Jacobian mass", True),
    ("grad_q_norm", "gradient norm into q", True),
)


def plot(measured: dict, outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5, 6.8), layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    for ax, (key, label, log_y) in zip(axes, PANELS, strict=False):
        for name in DIVISORS:
            rows = [r for r in measured["rows"] if r["divisor"] == name and r[key] is not None]
            style = "--" if name == LEARNED else "-"
            ax.plot([r["d_k"] for r in rows], [r[key] for r in rows], style, marker="o", ms=3, label=name)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("d_k (per-head key dimension)")
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    axes[0].axhspan(*measured["band"], color="green", alpha=0.15, label="band")
    rows = [r for r in measured["rows"] if r["divisor"] == LEARNED]
    ax = axes[5]
    ax.plot([r["d_k"] for r in rows], [r["value"] / math.sqrt(r["d_k"]) for r in rows], "--o", ms=3)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("d_k (per-head key dimension)")
    ax.set_ylabel("learned divisor / sqrt(d_k)")
    ax.set_title("learned divisor against sqrt(d_k)")
    ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=9)
    fig.suptitle(f"Divisors of q.k, iid N(0,1) q and k, {measured['keys']} keys, {measured['num_heads']} heads")
    return [save_figure(fig, outdir, "divisor_table")]


def captions(measured: dict) -> dict[str, str]:
    low, high = measured["band"]
    return {
        "divisor_table": (
            "Each panel is one property of softmax(q.k / divisor) against the head size d_k, one line per divisor "
            f"(the learned one dashed). In the score-variance panel the shaded band ({low:g} to {high:g}) is what the "
            "rule counts as keeping the variance: look for the divisors whose line stays inside it at every d_k; the "
            "other panels show what leaving it does (a peaked or flat softmax, a vanishing gradient). The last panel "
            "divides the learned divisor by sqrt(d_k): a flat line on the grey reference means learning finds sqrt(d_k)."
        )
    }
