"""qknorm-double-shrink: 1/sqrt(d_k) on top of unit-length QK normalisation leaves softmax near uniform.

With q and k L2-normalised, ``q . k`` is a cosine in [-1, 1]; the extra 1/sqrt(d_k) puts every
logit in ``[-1/sqrt(d_k), 1/sqrt(d_k)]`` and caps the logit gap at ``2/sqrt(d_k)``. The largest
probability softmax can then give one of n keys is ``e^g / (e^g + n - 1)`` with g = 2/sqrt(d_k)
(one key perfectly aligned with the query, every other exactly opposite). To concentrate a share
p on one key, the gap must be ``log(p (n - 1) / (1 - p))``.

Compared through ``attnscale.variants.QKNorm`` and ``attnscale.scaled_dot_product_attention``:
L2 + 1/sqrt(d_k), L2 + Henry et al.'s learned scale at its initial value g0 = log2(L^2 - L),
RMS-style QK-norm (norm sqrt(d_k), as Qwen3/OLMo 2) + 1/sqrt(d_k), and no norm + 1/sqrt(d_k).
Both the best case (a perfectly aligned key) and random data (mean max probability, entropy /
log n) are measured.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...functional import scaled_dot_product_attention
from ...variants import DoubleShrinkWarning, QKNorm
from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="qknorm-double-shrink",
    statement=(
        "Applying 1/sqrt(d_k) on top of QK normalisation shrinks the scores twice, into a near-uniform regime "
        "where attention cannot concentrate."
    ),
    sources=("Henry et al. 2020", "Dehghani et al. 2023, sec. 2 (QK normalization)"),
    method=(
        "For d_k in {16, 32, 64, 128, 256} and n = 64 keys: the largest achievable probability (one key aligned "
        "with the query, the rest opposite) and, on random Gaussian q, k, the mean max probability and entropy / "
        "log n, for L2 norm + 1/sqrt(d_k), L2 norm + learned scale at Henry et al.'s init log2(L^2 - L) "
        "(L = n), RMS norm + 1/sqrt(d_k), and no norm + 1/sqrt(d_k). The gap needed for a 0.5 and a 0.9 share "
        "is computed alongside."
    ),
    rule=(
        "Stuck = the best-case largest probability is below 0.5. inconclusive if the learned-scale reference is "
        "stuck too (the setup could not tell the regimes apart). does-not-hold if L2 + 1/sqrt(d_k) is stuck at no "
        "d_k. holds if it is stuck at every d_k and its random-data entropy / log n exceeds 0.95 at every d_k; "
        "holds-approximately if it is stuck at some d_k only, or stuck but not near uniform on random data. The "
        "RMS-norm rows are reported beside it: the double shrink is specific to unit-length normalisation."
    ),
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "4a228ca2618e16e0"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "7ef7f21ddad7fc1a"),
    ),
)
HEADLINE = Headline(
    "best_case_max_prob_l2_inverse_sqrt_at_128",
    "best achievable max attention probability, L2 QK-norm with 1/sqrt(d_k), d_k 128",
)

VARIANTS = ("l2 + 1/sqrt(d)", "l2 + learned (init)", "rms + 1/sqrt(d)", "none + 1/sqrt(d)")


@dataclass(frozen=True)
class Config:
    dims: tuple[int, ...] = (16, 32, 64, 128, 256)
    keys: int = 64
    queries: int = 256

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(dims=(16, 128), queries=32)
        if profile == "full":
            return cls(dims=(4, 8, 16, 32, 64, 128, 256, 512, 1024), queries=2048)
        return cls()


def _norm(variant: str, D: int, n: int) -> QKNorm | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DoubleShrinkWarning)  # the double shrink is what is measured
        if variant == "l2 + 1/sqrt(d)":
            return QKNorm(D, kind="l2", scale="inverse_sqrt")
        if variant == "l2 + learned (init)":
            return QKNorm(D, kind="l2", scale="learned", seq_len=n)
        if variant == "rms + 1/sqrt(d)":
            return QKNorm(D, kind="rms", scale="inverse_sqrt")
    return None


def _attend(norm: QKNorm | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Softmax weights (value = identity) after the variant's normalisation and scale."""
    scale = None
    if norm is not None:
        with torch.no_grad():
            q, k = norm(q, k)
        scale = norm.effective_scale
    S = k.shape[-2]
    eye = torch.eye(S, dtype=q.dtype).expand(*k.shape[:-2], S, S)
    return scaled_dot_product_attention(q, k, eye, scale=scale)


def run(config: Config, seed: int, progress: Progress) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    n = config.keys
    rows: dict[str, dict[str, dict[str, float]]] = {v: {} for v in VARIANTS}
    for i, D in enumerate(config.dims):
        direction = torch.randn(D, generator=gen, dtype=torch.float64)
        best_q = direction.reshape(1, 1, D)  # (H=1, L=1, D)
        best_k = torch.cat([direction[None], -direction.expand(n - 1, D)]).reshape(1, n, D)  # aligned key first
        q = torch.randn(1, config.queries, D, generator=gen, dtype=torch.float64)
        k = torch.randn(1, n, D, generator=gen, dtype=torch.float64)
        for variant in VARIANTS:
            norm = _norm(variant, D, n)
            best = _attend(norm, best_q, best_k)[0, 0, 0].item()
            w = _attend(norm, q, k)
            entropy = -(w * w.clamp_min(1e-300).log()).sum(-1).mean().item()
            rows[variant][str(D)] = {
                "best_case_max_prob": best,
                "mean_max_prob": w.amax(-1).mean().item(),
                "entropy_over_log_n": entropy / math.log(n),
            }
        progress(i + 1, len(config.dims))
    needed = {f"{p:g}": math.log(p * (n - 1) / (1 - p)) for p in (0.5, 0.9)}
    headline_dim = "128" if "128" in rows[VARIANTS[0]] else str(config.dims[-1])
    return {
        "keys": n,
        "variants": rows,
        "max_gap_l2_inverse_sqrt": {str(D): 2 / math.sqrt(D) for D in config.dims},
        "gap_needed_for_share": needed,
        "best_case_max_prob_l2_inverse_sqrt_at_128": rows[VARIANTS[0]][headline_dim]["best_case_max_prob"],
    }


def judge(measured: dict[str, Any]) -> Judgement:
    rows = measured["variants"]
    shrunk, learned = rows["l2 + 1/sqrt(d)"], rows["l2 + learned (init)"]
    if any(r["best_case_max_prob"] < 0.5 for r in learned.values()):
        return Judgement(Verdict.INCONCLUSIVE, "the learned-scale reference cannot concentrate either")
    stuck = [D for D, r in shrunk.items() if r["best_case_max_prob"] < 0.5]
    if not stuck:
        return Judgement(Verdict.DOES_NOT_HOLD, "L2 + 1/sqrt(d_k) can still put half the mass on one key at every d_k")
    uniform = all(r["entropy_over_log_n"] > 0.95 for r in shrunk.values())
    best = max(r["best_case_max_prob"] for r in shrunk.values())
    rms_best = min(r["best_case_max_prob"] for r in rows["rms + 1/sqrt(d)"].values())
    summary = (
        f"with L2 + 1/sqrt(d_k) the best achievable max probability over {measured['keys']} keys is at most "
        f"{best:.3f} (stuck at d_k = {', '.join(stuck)}); random-data entropy / log n is at least "
        f"{min(r['entropy_over_log_n'] for r in shrunk.values()):.3f}; the learned scale and RMS-style "
        f"QK-norm (best case >= {rms_best:.3f}) are not affected"
    )
    if len(stuck) == len(shrunk) and uniform:
        return Judgement(Verdict.HOLDS, summary)
    return Judgement(Verdict.HOLDS_APPROXIMATELY, summary)


def plot(measured: dict[str, Any], outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.8), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for variant, rows in measured["variants"].items():
        dims = [int(d) for d in rows]
        ax1.plot(dims, [r["best_case_max_prob"] for r in rows.values()], marker="o", label=variant)
        ax2.plot(dims, [r["entropy_over_log_n"] for r in rows.values()], marker="o", label=variant)
    ax1.axhline(0.5, color="gray", ls=":", lw=1)
    for ax, ylabel in ((ax1, "best-case max probability"), (ax2, "entropy / log n (random q, k)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_k")
        ax.set_ylabel(ylabel)
    ax1.set_title("best case: one aligned key")
    ax2.set_title("random q and k")
    ax1.legend(fontsize=9, framealpha=0.8)
    fig.suptitle(f"QK normalisation with and without a second 1/sqrt(d_k), {measured['keys']} keys")
    return [save_figure(fig, outdir, "qknorm_double_shrink")]


def captions(measured: dict[str, Any]) -> dict[str, str]:
    variants = ", ".join(measured["variants"])
    return {
        "qknorm_double_shrink": (
            f"Each line is one normalisation and scale of q and k ({variants}), against d_k, with "
            f"{measured['keys']} keys. Left: the largest probability attention can reach when one key is aligned with "
            "the query; below the dotted line (half the mass) attention cannot concentrate even in this best case. "
            "Right: the entropy of attention on random q and k over log n, where the top of the axis is uniform "
            "attention."
        )
    }
