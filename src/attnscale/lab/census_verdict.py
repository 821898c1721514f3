"""The verdict rule of ``scale-in-the-wild`` over the scale census (rule version 6).

The census (:mod:`attnscale.diagnostics.census`) gives, per model type of the installed
transformers, the class of its attention scale measured end to end (from the raw projections'
dot product ``(W_q x_i) . (W_k x_j)`` to the logit softmax sees, every layer and head, query and
key at equal positions from 0 to 4x every length threshold of the config). This module turns those
rows into the claim's verdict. Its text is :data:`RULE`; :func:`judge_census` is the rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from ..diagnostics.census import CLIPPED, HEAD, LAYER, LEARNED, NORMALISED, NOT_MEASURABLE, OTHER_CONSTANT, POSITION, SQRT
from .base import Judgement, Verdict

CLASSES = (SQRT, NORMALISED, CLIPPED, OTHER_CONSTANT, POSITION, LAYER, HEAD, LEARNED, NOT_MEASURABLE)
"""The classes of a probed type (:func:`attnscale.diagnostics.census.classify`), in the order the
verdict's reason counts them."""

MIN_PROBED = 25
MIN_PROBED_SHARE = 0.5
HOLDS_PROBED_SHARE = 0.9
APPROXIMATE_SHARE = 2 / 3

RULE = (
    "Over the census of model types at their config defaults (released configs are measured and named "
    "beside the verdict, not counted): a type conforms when its class is 1/sqrt(head_dim) (every layer, "
    "head and probed position within 3% of 1/sqrt(head_dim), fit R^2 > 0.99), when it is after QK-norm "
    "and the multiplier after its normalisation is 1/sqrt(head_dim) within 3%, or when it is clipped (a clamp "
    "on q or k binds once q is driven far past its usual size) and the multiplier below the clamp is "
    "1/sqrt(head_dim) within 3%; a learned multiplier does not conform (its value is whatever training "
    "makes it). inconclusive if transformers "
    f"is missing, fewer than {MIN_PROBED} types were probed, or fewer than half of the types tried; holds if "
    f"every probed type conforms and at least {HOLDS_PROBED_SHARE:.0%} of the types tried were probed; "
    "holds-approximately if at least two thirds of the probed types conform; does-not-hold otherwise. Every "
    "type not probed is counted and named with its reason."
)


def conforms(row: Mapping) -> bool:
    """Whether one census row divides its logits by sqrt(head_dim) in the rule's sense."""
    if row.get("class") == SQRT:
        return True
    if row.get("class") == CLIPPED:
        return bool(row.get("below_clip_sqrt"))
    return row.get("class") == NORMALISED and bool(row.get("after_norm_sqrt"))


def judge_census(rows: Sequence[Mapping], not_probed: Sequence[Mapping], *, transformers: str | None) -> Judgement:
    """The verdict over census ``rows`` (probed types: ``model_type``, ``class``, ``after_norm_sqrt``,
    ``below_clip_sqrt``, ``released``) and ``not_probed`` (``model_type``, ``reason``)."""
    if transformers is None:
        return Judgement(Verdict.INCONCLUSIVE, "transformers is not installed (pip install 'attnscale[hf]')")
    counted = [r for r in rows if not r.get("released")]
    released = [r for r in rows if r.get("released")]
    tried = len(counted) + len(not_probed)
    reasons = Counter(str(n.get("reason", "")).split(":")[0] for n in not_probed)
    unprobed = (
        f"; {len(not_probed)} of {tried} types tried could not be probed ("
        + ", ".join(f"{why or 'no reason'}: {k}" for why, k in reasons.most_common())
        + ")"
        if not_probed
        else ""
    )
    departing_released = [f"{r['model_type']} {r.get('label', '')}".strip() for r in released if not conforms(r)]
    beside = f"; released configs that depart: {', '.join(departing_released)}" if departing_released else ""
    if len(counted) < MIN_PROBED or len(counted) < MIN_PROBED_SHARE * tried:
        return Judgement(Verdict.INCONCLUSIVE, f"only {len(counted)} of {tried} types could be probed (need {MIN_PROBED} and half){unprobed}{beside}")
    classes = Counter(r["class"] for r in counted)
    good = [r for r in counted if conforms(r)]
    share = len(good) / len(counted)
    by_class = ", ".join(f"{cls} {classes[cls]}" for cls in CLASSES if classes[cls])
    departing = sorted(r["model_type"] for r in counted if not conforms(r))
    summary = (
        f"{len(good)} of {len(counted)} probed types ({share:.0%}) divide by sqrt(head_dim) (classes: {by_class}); "
        f"departing: {', '.join(departing) or 'none'}{unprobed}{beside}"
    )
    if not departing and len(counted) >= HOLDS_PROBED_SHARE * tried:
        return Judgement(Verdict.HOLDS, summary)
    if share >= APPROXIMATE_SHARE:
        return Judgement(Verdict.HOLDS_APPROXIMATELY, summary)
    return Judgement(Verdict.DOES_NOT_HOLD, summary)
