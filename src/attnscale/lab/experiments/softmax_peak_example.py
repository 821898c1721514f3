"""softmax(0, 0, 11, 0): the worked example of a peaked softmax (docs/claims.md), computed exactly.

The logits are produced as attention scores: one query ``q = (1)`` against four one-dimensional
keys ``(0, 0, 11, 0)`` with ``scale = 1`` and identity values, so the attention output is the
probability vector itself. The closed form is ``p_peak = 1 / (1 + 3 e^-11)`` and
``p_other = e^-11 / (1 + 3 e^-11)``.

>>> m = run(Config.for_profile("tiny"), seed=0, progress=lambda done, total: None)
>>> [round(p, 6) for p in m["probs"]]
[1.7e-05, 1.7e-05, 0.99995, 1.7e-05]
>>> judge(m).verdict.value
'holds'
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
    id="softmax-peak-example",
    statement="softmax(0, 0, 11, 0) puts almost all of its mass on the 11: about 0.99994 there and about "
    "0.00002 on each of the other three.",
    sources=("Vaswani et al. 2017, sec. 3.2.1 and footnote 4",),
    method="The four logits are attention scores of one query against four keys (scale 1, identity values) in "
    "float64, through attnscale.scaled_dot_product_attention; the output is compared with the closed form "
    "e^-11 / (1 + 3 e^-11) and 1 / (1 + 3 e^-11), and with the claim's quoted values at the precision they are quoted.",
    rule="inconclusive if the attention output departs from the closed form by more than 1e-12 (the measurement is "
    "broken); does-not-hold if the peak is not the largest probability or holds less than 0.99 of the mass; holds "
    "if, in addition, every quoted value lies within one unit of its last quoted decimal of the exact value; "
    "holds-approximately otherwise (the mass is on the peak but a quoted number is off).",
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "1a5f4eb05600f99b"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "b235ebfa43bafca2"),
    ),
)
HEADLINE = Headline("peak_prob", "softmax(0, 0, 11, 0) at the 11")

QUOTED = {"other": 0.00002, "peak": 0.99994}
QUOTED_DECIMALS = 5


@dataclass(frozen=True)
class Config:
    logits: tuple[float, ...] = (0.0, 0.0, 11.0, 0.0)

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        return cls()  # exact arithmetic: every profile computes the same thing


def run(config: Config, seed: int, progress: Progress) -> dict[str, Any]:
    S = len(config.logits)
    q = torch.ones(1, 1, 1, dtype=torch.float64)  # (H=1, L=1, D=1)
    k = torch.tensor(config.logits, dtype=torch.float64).reshape(1, S, 1)  # (H=1, S, D=1)
    v = torch.eye(S, dtype=torch.float64).reshape(1, S, S)  # (H=1, S, Dv=S): output = weights
    probs = scaled_dot_product_attention(q, k, v, scale=1.0).reshape(S)
    progress(1, 1)

    top = max(config.logits)
    denom = sum(math.exp(x - top) for x in config.logits)
    exact = [math.exp(x - top) / denom for x in config.logits]
    peak = config.logits.index(top)
    other = [p for i, p in enumerate(exact) if i != peak]
    return {
        "logits": list(config.logits),
        "probs": probs.tolist(),
        "exact_probs": exact,
        "peak_index": peak,
        "peak_prob": probs[peak].item(),
        "off_peak_mass": 1.0 - probs[peak].item(),
        "max_error_vs_exact": max(abs(a - b) for a, b in zip(probs.tolist(), exact, strict=True)),
        "quoted": {
            "peak": QUOTED["peak"],
            "other": QUOTED["other"],
            "decimals": QUOTED_DECIMALS,
            "exact_peak": exact[peak],
            "exact_other": max(other),
            "exact_peak_rounded": round(exact[peak], QUOTED_DECIMALS),
            "exact_other_rounded": round(max(other), QUOTED_DECIMALS),
        },
    }


def judge(measured: dict[str, Any]) -> Judgement:
    probs, exact = measured["probs"], measured["exact_probs"]
    error = max(abs(a - b) for a, b in zip(probs, exact, strict=True))
    if not all(math.isfinite(p) for p in probs) or error > 1e-12:
        return Judgement(Verdict.INCONCLUSIVE, f"attention output departs from the closed form by {error:.3g} (> 1e-12)")
    peak = measured["peak_index"]
    if max(range(len(probs)), key=probs.__getitem__) != peak or probs[peak] < 0.99:
        return Judgement(Verdict.DOES_NOT_HOLD, f"the peak holds {probs[peak]:.6g} of the mass (needs >= 0.99)")
    quoted = measured["quoted"]
    unit = 10.0 ** -quoted["decimals"]
    off = {
        name: abs(quoted[name] - quoted[f"exact_{name}"])
        for name in ("peak", "other")
        if abs(quoted[name] - quoted[f"exact_{name}"]) > unit * (1 + 1e-9)
    }
    notes = (
        f"exact peak {quoted['exact_peak']:.9f} (quoted {quoted['peak']}: "
        f"{'truncated' if quoted['peak'] < quoted['exact_peak_rounded'] else 'rounded'}; rounding gives "
        f"{quoted['exact_peak_rounded']}), exact off-peak {quoted['exact_other']:.4g} (quoted {quoted['other']})"
    )
    if off:
        worst = ", ".join(f"{k} off by {v:.3g}" for k, v in off.items())
        return Judgement(Verdict.HOLDS_APPROXIMATELY, f"the peak holds {probs[peak]:.6g} of the mass, but quoted {worst}; {notes}")
    return Judgement(Verdict.HOLDS, f"the peak holds {probs[peak]:.6g} of the mass; {notes}")


def plot(measured: dict[str, Any], outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    probs = measured["probs"]
    labels = [f"{x:g}" for x in measured["logits"]]
    fig = Figure(figsize=(5.5, 3.2))
    ax = fig.add_subplot()
    ax.bar(range(len(probs)), probs, color="#4c72b0", label="measured (attnscale)")
    quoted = measured["quoted"]
    claimed = [quoted["peak"] if i == measured["peak_index"] else quoted["other"] for i in range(len(probs))]
    ax.scatter(range(len(probs)), claimed, color="#dd8452", zorder=3, marker="_", s=400, label="claimed value")
    ax.set_yscale("log")
    ax.set_ylim(top=4.0)  # room for the label above the peak
    ax.set_xticks(range(len(probs)), labels)
    ax.set_xlabel("logit")
    ax.set_ylabel("softmax probability (log scale)")
    ax.set_title("softmax(0, 0, 11, 0)")
    for i, p in enumerate(probs):
        ax.annotate(f"{p:.6g}", (i, p), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.legend(loc="center right", fontsize=8)
    return [save_figure(fig, outdir, "softmax_peak")]


def captions(measured: dict[str, Any]) -> dict[str, str]:
    logits = ", ".join(f"{x:g}" for x in measured["logits"])
    return {
        "softmax_peak": (
            f"The probabilities attnscale computes for softmax({logits}) (bars, log scale, values above them) and the "
            "values the claim quotes (orange dashes): a dash at the top of its bar means the quoted value is right."
        )
    }
