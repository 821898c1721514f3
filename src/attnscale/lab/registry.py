"""Which claims the lab knows, in report order, and which experiment modules measure them.

``CLAIMS`` lists every claim of CLAIMS.md in its order, with a one-line statement, so that the
report and ``attnscale list`` can name claims that have no experiment yet. Experiments are found
by importing every module of ``attnscale.lab.experiments`` that defines ``CLAIM``; a new module
needs no registration.

>>> CLAIM_IDS[:3]
('variance-law', 'divisor-table', 'saturation-example')
>>> [e.id for e in discover().experiments if e.id == "variance-law"]
['variance-law']
"""

from __future__ import annotations

import importlib
import pkgutil
import traceback
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .base import Claim, Profile

__all__ = ["CLAIMS", "CLAIM_IDS", "DEFAULT_PACKAGE", "Discovery", "Experiment", "discover"]

DEFAULT_PACKAGE = "attnscale.lab.experiments"

CLAIMS: tuple[tuple[str, str], ...] = (
    ("variance-law", "Var(q.k) = d_k for iid unit-variance components, so q.k/sqrt(d_k) has std ~1 at any d_k"),
    ("divisor-table", "of 1, sqrt(d_k), d_k, sqrt(d_model), sqrt(heads), log d_k, only sqrt(d_k) keeps score variance ~1"),
    ("saturation-example", "at d_k = 128 with 64 keys, unscaled attention is near one-hot and scaled attention stays soft"),
    ("softmax-peak-example", "softmax(0, 0, 11, 0) puts almost all of its mass on the 11"),
    ("jacobian-collapse", "at a peaked softmax the Jacobian diag(p) - p p^T is near zero off the peak"),
    ("training-stall", "without the scale, attention learns much more slowly or stalls at d_k = 64, 128"),
    ("real-text-training", "without the scale, a GPT on real text stalls, trains worse, or at fewer learning rates"),
    ("fp16-secondary", "gradients through softmax vanish at logits far below fp16 overflow: the failure is gradient flow"),
    ("inference-removal", "removing or changing the scale at inference degrades a model trained with it"),
    ("qknorm-double-shrink", "1/sqrt(d_k) on top of QK normalisation shrinks scores into a near-uniform regime"),
    ("small-dk", "for d_k <= 4 the scale barely matters"),
    ("linear-attention", "attention without softmax cannot saturate; whether it needs the scale depends on the feature map"),
    ("hard-routing", "when near one-hot attention is wanted, a learned temperature reaches it and the fixed scale resists"),
    ("mup-correlated", "for correlated q and k, q.k grows like d_k and 1/sqrt(d_k) under-corrects (muP uses 1/d_k)"),
    ("logit-growth", "logits grow at high learning rates; QK-norm removes it, softcap bounds logits, QK-Clip the max logit"),
    ("length-scaling", "with a fixed scale softmax spreads out as keys are added; log-n scaling keeps a gap decisive"),
    ("rope-variance", "RoPE is a rotation: it preserves the variance law and commutes with the scale"),
    ("alibi-order", "ALiBi's bias goes after the scale; adding it before shrinks the slopes by sqrt(d_k)"),
    ("flash-exp2", "folding the scale into exp2 (scale * log2 e), as FlashAttention does, gives the same result"),
    ("quant-folding", "folding the scale into q before INT8 is exact for powers of two; smoothing K is exact and cuts error"),
    ("scale-in-the-wild", "modern transformers divide by sqrt(head_dim), and those that depart from it say how"),
)
CLAIM_IDS: tuple[str, ...] = tuple(cid for cid, _ in CLAIMS)
_STATEMENTS = dict(CLAIMS)


@dataclass(frozen=True)
class Experiment:
    """An imported experiment module (see ``attnscale.lab.base`` for what it provides)."""

    module_name: str
    module: ModuleType = field(repr=False, compare=False)

    @property
    def claim(self) -> Claim:
        return self.module.CLAIM

    @property
    def id(self) -> str:
        return self.claim.id

    def config(self, profile: Profile) -> Any:
        return self.module.Config.for_profile(profile)

    @property
    def headline_key(self) -> str | None:
        """The measured key (dotted for nested dicts) to show in summaries; optional ``HEADLINE``."""
        spec = getattr(self.module, "HEADLINE", None)
        return getattr(spec, "key", spec)


@dataclass(frozen=True)
class Discovery:
    """What :func:`discover` found: experiments in claim order, and modules that failed to import."""

    experiments: tuple[Experiment, ...]
    broken: tuple[tuple[str, str], ...]
    """``(module name, traceback)`` for each experiment module that raised on import."""

    def by_id(self) -> dict[str, Experiment]:
        return {e.id: e for e in self.experiments}


def statement(claim_id: str) -> str:
    """The one-line statement of a known claim id ('' for an id CLAIMS.md does not list)."""
    return _STATEMENTS.get(claim_id, "")


def order_key(claim_id: str) -> tuple[int, str]:
    # Claims CLAIMS.md does not list go last, alphabetically.
    return (CLAIM_IDS.index(claim_id) if claim_id in CLAIM_IDS else len(CLAIM_IDS), claim_id)


def discover(package: str = DEFAULT_PACKAGE) -> Discovery:
    """Import every public module of ``package`` and keep those that define ``CLAIM``."""
    pkg = importlib.import_module(package)
    found: list[Experiment] = []
    broken: list[tuple[str, str]] = []
    for info in pkgutil.iter_modules(pkg.__path__, prefix=f"{package}."):
        if info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:
            broken.append((info.name, traceback.format_exc()))
            continue
        if not isinstance(getattr(module, "CLAIM", None), Claim):
            continue
        first = next((e for e in found if e.id == module.CLAIM.id), None)
        if first is not None:
            broken.append((info.name, f"ValueError: claim id {first.id!r} is already measured by {first.module_name}"))
            continue
        found.append(Experiment(info.name, module))
    found.sort(key=lambda e: order_key(e.id))
    return Discovery(tuple(found), tuple(broken))


def module_claim_id(module_name: str) -> str:
    """The claim id a module name stands for by convention: ``saturation_example`` -> ``saturation-example``."""
    return module_name.rsplit(".", 1)[-1].replace("_", "-")
