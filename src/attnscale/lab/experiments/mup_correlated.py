"""When queries and keys are correlated, q.k grows like d_k, not sqrt(d_k).

For k = rho q + sqrt(1 - rho^2) n with q, n iid N(0, I): E[q.k] = rho d_k and
E[(q.k)^2] = rho^2 (d_k^2 + 2 d_k) + (1 - rho^2) d_k, so |q.k| grows like d_k for any rho > 0
(like sqrt(d_k) only at rho = 0). Softmax only sees differences between the logits of one row,
so what matters is correlation that differs from key to key: a correlation shared by every key
of the row shifts all its logits by the same rho |q|^2 and changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

import attnscale

from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure
from ..uncertainty import Estimate, clear

CLAIM = Claim(
    id="mup-correlated",
    statement=(
        "Once queries and keys are correlated, as they become in training, q.k grows in proportion "
        "to d_k; dividing by sqrt(d_k) then leaves logits that still grow like sqrt(d_k), and only "
        "1/d_k (muP's choice) keeps them constant across head sizes."
    ),
    sources=("Yang et al. 2022 (Tensor Programs V), the muP attention scaling 1/d",),
    method=(
        "Rows of one query and S keys, q ~ N(0, I_{d_k}), keys k_j = rho_j q + sqrt(1 - rho_j^2) n_j. "
        "Cases: independent (rho_j = 0); one aligned key with rho = 0.1, 0.5 or 1 (q = k), the other "
        "keys independent; trained-like spread (rho_j ~ U(-0.5, 0.5) per key); shared (rho_j = 0.5 "
        "for every key). Per case and d_k: RMS of the correlated pairs' q.k (the aligned key, or all "
        "keys) and its growth exponent (least-squares slope in log-log over d_k); mean within-row "
        "std of the logits and mean maximum probability from attnscale.scaled_dot_product_attention "
        "(return_stats) with scale 1/sqrt(d_k) and 1/d_k."
    ),
    rule=(
        "Key-specific cases: rho = 0.5, q = k, spread. Every number the rule compares carries a bootstrap "
        "standard error (200 resamples of the rows within each case and d_k), and a comparison counts only when "
        "the number is clear of its bound by Student's t 95% quantile of standard errors (1.97 for 200 resamples). Growth: the key-specific RMS exponents lie "
        "clearly inside [0.85, 1.15] and the independent one clearly inside [0.4, 0.6]. Under-correction of a "
        "case: its mean max probability with 1/sqrt(d_k) rises clearly by more than 0.1 from the smallest to the "
        "largest d_k, and that rise exceeds clearly the absolute change with 1/d_k. Holds: growth, and every "
        "key-specific case and the shared case under-correct. Holds approximately: growth and the key-specific "
        "cases under-correct, and the shared case clearly does not (correlation must differ between keys to "
        "matter). Does not hold: a growth or key-specific under-correction comparison clearly fails. "
        "Inconclusive: a comparison the verdict depends on is within noise, fewer than 3 head sizes, a span "
        "below 16, or missing values."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "696e770669aaf7f9"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "98cd52084443a2ee"),
        RuleVersion(
            3,
            "2026-12-02",
            "every compared number carries a bootstrap standard error over rows and counts only when clear of its "
            "bound by 2 of them: a number within noise of a bound is inconclusive, so the verdict does not flip "
            "with floating-point rounding on another CPU",
            "76667cae16835d95",
        ),
        RuleVersion(
            4,
            "2026-12-02",
            "a comparison is clear by Student's t 95% quantile of standard errors for the seed count (12.7 for 2 seeds, 4.30 for 3, 3.18 for 4) instead of 2: from a few seeds their standard deviation is itself uncertain, and the quick profile's 2 seeds gave logit-growth a clear growth on an AMD EPYC where an Intel Xeon's was within noise",
            "39fe48e42b563b3b",
        ),
    ),
)

CASES = {
    "independent": "no correlation",
    "aligned_0.1": "one key, rho = 0.1",
    "aligned_0.5": "one key, rho = 0.5",
    "q=k": "one key equal to q",
    "spread": "rho_j ~ U(-0.5, 0.5)",
    "shared": "every key rho = 0.5",
}
HEADLINE = Headline(
    "exponents.q=k.rms_qk", "exponent of d_k in the growth of rms q.k when q = k", spread="bootstrap.exponent_se.q=k"
)
"""Growth exponent of q.k with d_k when one key equals the query."""

KEY_SPECIFIC = ("aligned_0.5", "q=k", "spread")
SCALINGS = ("1/sqrt(d_k)", "1/d_k")
BOOTSTRAP_DRAWS = 200
"""Resamples of the rows (within each case and d_k) behind every standard error the rule uses."""


@dataclass(frozen=True)
class Config:
    d_ks: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)
    keys: int = 64
    rows: int = 128

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(d_ks=(8, 32, 128, 512), keys=16, rows=64)
        if profile == "quick":
            return cls(rows=64)
        if profile == "default":
            return cls(d_ks=(4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048), rows=256)
        return cls(d_ks=(2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), rows=4096)


def correlations(case: str, R: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """rho_j per row and key, (R, S), for ``case``."""
    rho = torch.zeros(R, S)
    if case.startswith("aligned_"):
        rho[:, 0] = float(case.removeprefix("aligned_"))
    elif case == "q=k":
        rho[:, 0] = 1.0
    elif case == "spread":
        rho = torch.rand(R, S, generator=gen) - 0.5
    elif case == "shared":
        rho[:] = 0.5
    return rho


def growth_exponent(d_ks: list[int], values: list[float]) -> float:
    """Least-squares slope of log(values) on log(d_k)."""
    x = torch.log(torch.tensor(d_ks, dtype=torch.float64))
    y = torch.log(torch.tensor(values, dtype=torch.float64))
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc**2).sum())


def run(config: Config, seed: int, progress: Progress) -> dict:
    gen = torch.Generator().manual_seed(seed)
    R, S = config.rows, config.keys
    table = []
    per_row: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # per (case, d_k): (R,) values behind the means
    total = len(CASES) * len(config.d_ks)
    done = 0
    for case in CASES:
        for d_k in config.d_ks:
            rho = correlations(case, R, S, gen).reshape(R, 1, S, 1)
            q = torch.randn(R, 1, 1, d_k, generator=gen)  # (B = R, H, L = 1, D)
            noise = torch.randn(R, 1, S, d_k, generator=gen)
            k = rho * q + (1.0 - rho**2).sqrt() * noise  # (B, Hkv, S, D)
            v = torch.zeros(R, 1, S, 1)
            raw = (q @ k.transpose(-1, -2)).reshape(R, S)
            pairs = raw[:, :1] if case.startswith("aligned_") or case == "q=k" else raw
            row = {"case": case, "d_k": d_k, "rms_qk": float(pairs.pow(2).mean().sqrt())}
            row["row_std"] = float(raw.std(dim=-1).mean())
            cell = per_row[case, d_k] = {"square_qk": pairs.pow(2).mean(dim=-1).double()}  # every row has as many pairs
            for name, scale in zip(SCALINGS, (1.0 / math.sqrt(d_k), 1.0 / d_k), strict=True):
                _, stats = attnscale.scaled_dot_product_attention(q, k, v, scale=scale, return_stats=True)
                cell[name] = stats.max_prob.reshape(R).double()
                row[f"max_prob {name}"] = float(stats.max_prob.mean())
                row[f"row_std {name}"] = row["row_std"] * scale
            table.append(row)
            done += 1
            progress(done, total)
    exponents = {}
    for case in CASES:
        rows = [r for r in table if r["case"] == case]
        d_ks = [r["d_k"] for r in rows]
        exponents[case] = {
            "rms_qk": growth_exponent(d_ks, [r["rms_qk"] for r in rows]),
            "row_std": growth_exponent(d_ks, [r["row_std"] for r in rows]),
        }
    boot = _bootstrap(per_row, list(config.d_ks), torch.Generator().manual_seed(seed + 1))
    return {"keys": S, "cases": CASES, "rows": table, "exponents": exponents, "bootstrap": boot}


def _bootstrap(per_row: dict[tuple[str, int], dict[str, torch.Tensor]], d_ks: list[int], gen: torch.Generator) -> dict:
    """Bootstrap standard errors of the exponents, the max-probability changes and the under-correction
    margins: the rows of every (case, d_k) cell resampled with replacement, BOOTSTRAP_DRAWS times."""
    means: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, cell in per_row.items():
        n = cell["square_qk"].numel()
        idx = torch.randint(n, (BOOTSTRAP_DRAWS, n), generator=gen)
        means[key] = {name: values[idx].mean(dim=1) for name, values in cell.items()}  # (draws,)
    x = torch.log(torch.tensor(d_ks, dtype=torch.float64))
    xc = x - x.mean()
    out: dict[str, dict] = {"draws": BOOTSTRAP_DRAWS, "exponent_se": {}, "drift_se": {}, "margin_se": {}}
    for case in CASES:
        y = torch.stack([means[case, d]["square_qk"].sqrt().log() for d in d_ks])  # (d_ks, draws)
        slopes = (xc[:, None] * (y - y.mean(dim=0))).sum(dim=0) / (xc**2).sum()
        out["exponent_se"][case] = float(slopes.std())
        drift = {s: means[case, d_ks[-1]][s] - means[case, d_ks[0]][s] for s in SCALINGS}
        out["drift_se"][case] = {s: float(d.std()) for s, d in drift.items()}
        out["margin_se"][case] = float((drift["1/sqrt(d_k)"] - drift["1/d_k"].abs()).std())
    return out


def drift(measured: dict, case: str, scaling: str) -> float:
    """Mean max probability at the largest d_k minus that at the smallest, for ``case``."""
    rows = sorted((r for r in measured["rows"] if r["case"] == case), key=lambda r: r["d_k"])
    return rows[-1][f"max_prob {scaling}"] - rows[0][f"max_prob {scaling}"]


def _all(results: list[bool | None]) -> bool | None:
    """True if every comparison clearly passes, False if one clearly fails, None otherwise."""
    if False in results:
        return False
    return None if None in results else True


def judge(measured: dict) -> Judgement:
    try:
        boot = measured["bootstrap"]
        exps = {
            case: Estimate(measured["exponents"][case]["rms_qk"], boot["exponent_se"][case], boot["draws"])
            for case in (*KEY_SPECIFIC, "independent")
        }
        drifts = {c: {s: drift(measured, c, s) for s in SCALINGS} for c in (*KEY_SPECIFIC, "shared")}
        rise = {c: Estimate(d["1/sqrt(d_k)"], boot["drift_se"][c]["1/sqrt(d_k)"], boot["draws"]) for c, d in drifts.items()}
        margin = {
            c: Estimate(d["1/sqrt(d_k)"] - abs(d["1/d_k"]), boot["margin_se"][c], boot["draws"]) for c, d in drifts.items()
        }
        d_ks = sorted({r["d_k"] for r in measured["rows"]})
    except (KeyError, TypeError, IndexError):
        return Judgement(Verdict.INCONCLUSIVE, "the measurement lacks exponents, max probabilities or their standard errors")
    if any(not math.isfinite(e.centre) for e in exps.values()) or len(d_ks) < 3 or d_ks[-1] / d_ks[0] < 16:
        return Judgement(Verdict.INCONCLUSIVE, f"head sizes {d_ks} too few or exponents missing")
    growth = _all([clear(exps[c], 0.85, 1.15) for c in KEY_SPECIFIC] + [clear(exps["independent"], 0.4, 0.6)])
    under = {c: _all([clear(rise[c], low=0.1), clear(margin[c], low=0.0)]) for c in drifts}
    text = ", ".join(f"{c} {e.text(2)}" for c, e in exps.items())
    moves = ", ".join(f"{c} {rise[c].text(2)} vs {drifts[c]['1/d_k']:+.2f}" for c in drifts)
    reason = (
        f"q.k growth exponents: {text}; max-probability change over d_k {d_ks[0]}..{d_ks[-1]} "
        f"with 1/sqrt(d_k) vs 1/d_k: {moves}; +- is a bootstrap standard error over rows"
    )
    needed = _all([growth, *(under[c] for c in KEY_SPECIFIC)])
    if needed is False:
        return Judgement(Verdict.DOES_NOT_HOLD, reason)
    if needed is None:
        return Judgement(Verdict.INCONCLUSIVE, reason + "; a growth or under-correction comparison is within noise")
    if under["shared"] is True:
        return Judgement(Verdict.HOLDS, reason)
    if under["shared"] is None:
        return Judgement(Verdict.INCONCLUSIVE, reason + "; whether the shared case under-corrects is within noise")
    return Judgement(
        Verdict.HOLDS_APPROXIMATELY,
        reason + "; a correlation shared by every key only shifts the row and does not matter",
    )


def plot(measured: dict, outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.0), layout="constrained")
    axes = fig.subplots(1, 3)
    for case, label in measured["cases"].items():
        rows = sorted((r for r in measured["rows"] if r["case"] == case), key=lambda r: r["d_k"])
        d_ks = [r["d_k"] for r in rows]
        exponent = measured["exponents"][case]["rms_qk"]
        (line,) = axes[0].plot(d_ks, [r["rms_qk"] for r in rows], "o-", ms=3, label=f"{label} (slope {exponent:.2f})")
        for ax, scaling, style in ((axes[1], "1/sqrt(d_k)", "-"), (axes[1], "1/d_k", "--")):
            ax.plot(d_ks, [r[f"max_prob {scaling}"] for r in rows], style, color=line.get_color())
        axes[2].plot(d_ks, [r["row_std 1/sqrt(d_k)"] for r in rows], "-", color=line.get_color())
        axes[2].plot(d_ks, [r["row_std 1/d_k"] for r in rows], "--", color=line.get_color())
    labels = (
        ("RMS of correlated q.k", "q.k grows like d_k once correlated"),
        ("mean max probability", "solid 1/sqrt(d_k), dashed 1/d_k"),
        ("mean within-row logit std", "solid 1/sqrt(d_k), dashed 1/d_k"),
    )
    for ax, (y_label, title) in zip(axes, labels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("d_k (per-head key dimension)")
        ax.set_ylabel(y_label)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=9, framealpha=0.8)
    fig.suptitle(f"Correlated queries and keys, {measured['keys']} keys per row")
    return [save_figure(fig, outdir, "mup_correlated")]


def captions(measured: dict) -> dict[str, str]:
    return {
        "mup_correlated": (
            "One colour per way of correlating q and k, against the head size d_k on log axes. Left: the RMS of q.k, "
            "with its fitted log-log slope in the legend; a slope like d_k's means q.k grows in proportion to d_k, "
            "one like sqrt(d_k)'s is the independent case. Middle and right: the largest probability and the spread "
            "of the logits within a row, with 1/sqrt(d_k) (solid) and 1/d_k (dashed): the scaling whose lines stay "
            "flat across d_k is the one that keeps the logits constant."
        )
    }
