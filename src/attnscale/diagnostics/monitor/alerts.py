"""Alerts on a training run's time series: :class:`AlertRules` (limits per head, set before
the run), :class:`Alert` (a rule that fired), :class:`TrainingStopped`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..._validate import fail
from .report import HeadReport, check_unit


@dataclass(frozen=True)
class Alert:
    """A rule that fired for one head at one sampled step (see :class:`AlertRules`).

    ``rule`` is "max_logit", "logit_growth", "entropy_collapse" or "saturation_jump"; ``value`` is
    the measured quantity (the max logit, the growth factor, the normalised entropy or the jump
    of the saturated share) and ``threshold`` the limit it crossed."""

    step: int
    layer: str
    head: int
    rule: str
    value: float
    threshold: float
    message: str


def _check_optional_positive(name: str, value: object, example: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(name, "None or a float", repr(value), f"pass e.g. {name}={example}", exc=TypeError)
    if not math.isfinite(value) or value <= 0:
        fail(name, "None or a finite float > 0", repr(value), f"pass e.g. {name}={example}, or None to turn the rule off")


@dataclass(frozen=True)
class AlertRules:
    """When the monitor raises an alert for a head, checked at every sampled step; None turns a rule off.

    * ``max_logit``: the head's max logit exceeds it (100 is QK-Clip's tau in Kimi K2);
    * ``growth_factor`` over ``growth_window`` steps: the max logit is at least ``growth_factor``
      times the smallest max logit the head had in the sampled steps of the last ``growth_window``
      steps, and above ``growth_floor`` (small logits at initialisation may double harmlessly);
    * ``min_normalized_entropy``: the mean entropy / log(visible keys) falls below it (entropy
      collapse: the head has become close to one-hot);
    * ``saturation_jump``: the share of saturated rows (max prob > ``MonitorThresholds.saturation_prob``)
      rose by more than it since the previous sampled step.

    A rule fires once when its condition becomes true for a head and again only after it was false
    at a sampled step. Every alert is logged as a warning on the ``attnscale.monitor`` logger and
    passed to the monitor's ``on_alert`` hook; with ``stop=True`` it also stops training
    (:meth:`Monitor.step` raises :class:`TrainingStopped`).

    >>> AlertRules(max_logit=30.0, growth_factor=None).max_logit
    30.0
    >>> AlertRules(growth_window=0)
    Traceback (most recent call last):
    ...
    ValueError: growth_window: expected an int >= 1 (steps), got 0. Fix: pass e.g. growth_window=100
    """

    max_logit: float | None = 100.0
    growth_factor: float | None = 4.0
    growth_window: int = 200
    growth_floor: float = 10.0
    min_normalized_entropy: float | None = 0.05
    saturation_jump: float | None = 0.5
    stop: bool = False

    def __post_init__(self) -> None:
        _check_optional_positive("max_logit", self.max_logit, "100.0")
        _check_optional_positive("growth_factor", self.growth_factor, "4.0")
        if self.growth_factor is not None and self.growth_factor <= 1:
            fail("growth_factor", "None or a factor > 1", repr(self.growth_factor), "pass e.g. growth_factor=4.0")
        if isinstance(self.growth_window, bool) or not isinstance(self.growth_window, int) or self.growth_window < 1:
            fail("growth_window", "an int >= 1 (steps)", repr(self.growth_window), "pass e.g. growth_window=100")
        if isinstance(self.growth_floor, bool) or not isinstance(self.growth_floor, (int, float)) or not math.isfinite(self.growth_floor):
            fail("growth_floor", "a finite float", repr(self.growth_floor), "pass e.g. growth_floor=10.0")
        for name in ("min_normalized_entropy", "saturation_jump"):
            if getattr(self, name) is not None:
                check_unit(name, getattr(self, name))
        if not isinstance(self.stop, bool):
            fail("stop", "a bool", repr(self.stop), "pass stop=True to stop training on an alert", exc=TypeError)


class TrainingStopped(RuntimeError):
    """Raised by :meth:`Monitor.step` when an alert fired under ``AlertRules(stop=True)``; ``alerts`` holds them."""

    def __init__(self, alerts: tuple[Alert, ...]) -> None:
        super().__init__("attnscale.monitor stopped training: " + "; ".join(a.message for a in alerts))
        self.alerts = alerts


class AlertState:
    """What the rules remember per (layer, head): recent max logits, the last saturated share, and
    which rules are firing."""

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self.logits: dict[tuple[str, int], list[tuple[int, float]]] = {}
        self.saturated: dict[tuple[str, int], float] = {}
        self.firing: set[tuple[str, int, str]] = set()

    def check(self, step: int, heads: Iterable[HeadReport]) -> list[Alert]:
        r, out = self.rules, []
        for h in heads:
            key = (h.layer, h.head)
            conditions: dict[str, tuple[bool, float, float, str]] = {}
            if h.max_logit is not None:
                if r.max_logit is not None:
                    conditions["max_logit"] = (h.max_logit > r.max_logit, h.max_logit, r.max_logit, f"max logit {h.max_logit:.1f} > {r.max_logit:g}")
                window = [(s, v) for s, v in self.logits.get(key, []) if s >= step - r.growth_window]
                self.logits[key] = [*window, (step, h.max_logit)]
                low = min((v for _, v in window), default=None)
                if r.growth_factor is not None and low is not None and low > 0:
                    grown = h.max_logit / low
                    fired = grown >= r.growth_factor and h.max_logit > r.growth_floor
                    conditions["logit_growth"] = (fired, grown, r.growth_factor, f"max logit grew {grown:.1f}x to {h.max_logit:.1f} within {r.growth_window} steps (>= {r.growth_factor:g}x)")
            if h.normalized_entropy is not None and r.min_normalized_entropy is not None:
                e = h.normalized_entropy
                conditions["entropy_collapse"] = (e < r.min_normalized_entropy, e, r.min_normalized_entropy, f"normalised entropy {e:.3f} < {r.min_normalized_entropy:g}")
            if h.saturated_share is not None:
                before = self.saturated.get(key)
                self.saturated[key] = h.saturated_share
                if r.saturation_jump is not None and before is not None:
                    jump = h.saturated_share - before
                    conditions["saturation_jump"] = (jump > r.saturation_jump, jump, r.saturation_jump, f"saturated share jumped {before:.0%} -> {h.saturated_share:.0%} (> +{r.saturation_jump:.0%})")
            for rule, (fired, value, threshold, what) in conditions.items():
                tag = (h.layer, h.head, rule)
                if fired and tag not in self.firing:
                    out.append(Alert(step, h.layer, h.head, rule, float(value), float(threshold), f"step {step}, {h.layer} head {h.head}: {what}"))
                (self.firing.add if fired else self.firing.discard)(tag)
        return out
