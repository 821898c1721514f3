"""The phase diagram of the stall: how much a missing 1/sqrt(d_k) slows training, against the
unscaled model's logit spread at initialisation.

A rung of the ladder is a target init logit std ``sigma`` of the unscaled model (the std of q.k
over the query rows of a held-out batch, as :func:`attnscale.lab.training.init_logit_std` reads
it). q and k both scale with the q/k init gain, so their products scale with its square: the gain
of a rung is about ``sqrt(sigma / sigma_1)``, ``sigma_1`` the std measured at gain 1 for that d_k
(:func:`gains_for` refines it, as the projections' biases do not scale). At
every rung the same initialisation trains twice, without the scale (divisor 1) and with it
(divisor sqrt(d_k)), and the rung's slowdown is the ratio of their steps to 90% held-out accuracy
over seeds, paired by seed: the seeds of a rung train as one stack of models
(:func:`attnscale.lab.training.train_seeds`), and a seed has the same data and the same initial
draws at every rung and divisor, so the rungs differ only by their gain and the pair of runs
only by the scale.

:func:`crossing` reads the diagram: where the slowdown passes a bound (2x, say), bracketed by the
largest rung clearly below it and the smallest clearly above it (a stall counts as above any
bound), with the log-log interpolation between the medians around it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Progress, no_progress
from .tasks import MQAR, PointerCopy, Task
from .training import ModelConfig, TinyTransformer, TrainConfig, init_logit_std, median_steps, train_seeds
from .uncertainty import Estimate, Side, estimate, quantisation, side

__all__ = ["Crossing", "Point", "crossing", "gains_for", "measure_ladder", "point_slowdown", "task_named"]

TARGET = 0.9


def task_named(name: str, *, context: int, queries: int, vocab: int) -> Task:
    """The ladder's tasks: ``"mqar"`` (multi-query associative recall) or ``"copy"`` (copy the
    value at the position a pointer names); each answer is reachable only through attention."""
    if name == "mqar":
        return MQAR(context=context, queries=queries, n_keys=vocab, n_values=vocab)
    if name == "copy":
        return PointerCopy.of(context=context, queries=queries, n_values=vocab)
    raise ValueError(f"task must be 'mqar' or 'copy'; got {name!r}.")


def _median_std(task: Task, model_cfg: ModelConfig, seeds: Sequence[int], gain: float, eval_batch: int) -> float:
    """The median over ``seeds`` of the unscaled init logit std at q/k init gain ``gain``, each
    seed's model read on its own held-out batch, as training reads it."""
    stds = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = TinyTransformer(task, dataclasses.replace(model_cfg, qk_init_gain=gain))
        stds.append(init_logit_std(model, task.sample(eval_batch, torch.Generator().manual_seed(seed + 10**6)))["raw"])
    return statistics.median(stds)


def gains_for(task: Task, model_cfg: ModelConfig, seeds: Sequence[int], sigmas: Sequence[float], eval_batch: int, *, rounds: int = 8) -> list[float]:
    """The q/k init gain at which the median over ``seeds`` of the unscaled init logit std is each
    of ``sigmas`` (to about 1e-4 relative): q.k grows with the gain's square, but the projections'
    biases do not scale, so each gain is refined from ``sqrt(sigma / sigma_1)`` by ``rounds`` of
    ``g <- g sqrt(sigma / std(g))``."""
    base = _median_std(task, model_cfg, seeds, 1.0, eval_batch)
    gains = []
    for sigma in sigmas:
        gain = math.sqrt(sigma / base)
        for _ in range(rounds):
            gain *= math.sqrt(sigma / _median_std(task, model_cfg, seeds, gain, eval_batch))
        gains.append(gain)
    return gains


@dataclass(frozen=True)
class Point:
    """One rung at one d_k: the unscaled and scaled runs' steps to 90% per seed (None: never got
    there), and the unscaled model's measured init logit std (median over seeds)."""

    dk: int
    gain: float
    logit_std: float
    unscaled: tuple[int | None, ...]
    scaled: tuple[int | None, ...]
    budget: int
    log_every: int

    def as_dict(self) -> dict:
        return {
            "dk": self.dk, "gain": self.gain, "logit_std": self.logit_std, "unscaled": list(self.unscaled),
            "scaled": list(self.scaled), "budget": self.budget, "log_every": self.log_every,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Point:
        return cls(d["dk"], d["gain"], d["logit_std"], tuple(d["unscaled"]), tuple(d["scaled"]), d["budget"], d["log_every"])


def point_slowdown(point: Point) -> Estimate | None:
    """Steps to 90% without the scale over with it, paired by seed: each seed's ratio (the same
    initialisation and data at both divisors, so a seed's own difficulty cancels), their median
    and its standard error over seeds (a run that never gets there counts at the budget); None for
    a stall (the unscaled median never gets there), which is clearly slower than any bound."""
    if median_steps(list(point.unscaled)) is None:
        return None
    counted = [(point.budget if u is None else u) / max(point.budget if s is None else s, 1) for u, s in zip(point.unscaled, point.scaled, strict=True)]
    scaled_median = statistics.median(point.budget if s is None else s for s in point.scaled)
    # a step count is known to a logging interval: the ratio to that over the scaled median
    return estimate(counted, quantisation(point.log_every) / max(scaled_median, 1))


def _side(point: Point, bound: float) -> Side:
    e = point_slowdown(point)
    return Side.ABOVE if e is None else side(e, bound)


@dataclass(frozen=True)
class Crossing:
    """Where the slowdown passes ``bound`` along the logit std: ``low`` the largest rung clearly
    below it, ``high`` the smallest clearly above it (None where no rung is), ``at`` the log-log
    interpolation of the medians between the rungs around the bound (None without both), and
    ``monotone`` False when some rung clearly above lies below some rung clearly below."""

    bound: float
    low: float | None
    high: float | None
    at: float | None
    monotone: bool

    def as_dict(self) -> dict:
        return {"bound": self.bound, "low": self.low, "high": self.high, "at": self.at, "monotone": self.monotone}


def crossing(points: Sequence[Point], bound: float) -> Crossing:
    """:class:`Crossing` of ``bound`` over ``points`` (any d_k: the diagram's x axis is the
    unscaled init logit std, whatever set it)."""
    ordered = sorted(points, key=lambda p: p.logit_std)
    sides = [_side(p, bound) for p in ordered]
    below = [p.logit_std for p, s in zip(ordered, sides) if s is Side.BELOW]
    above = [p.logit_std for p, s in zip(ordered, sides) if s is Side.ABOVE]
    low, high = (max(below) if below else None), (min(above) if above else None)
    monotone = low is None or high is None or low < high
    at = None
    medians = [(p.logit_std, math.inf if (e := point_slowdown(p)) is None else e.centre) for p in ordered]
    for (x0, y0), (x1, y1) in zip(medians, medians[1:]):
        if y0 <= bound < y1:
            if math.isinf(y1):
                at = x1  # the next rung stalls: the bound is passed by then
            else:
                t = (math.log(bound) - math.log(y0)) / (math.log(y1) - math.log(y0))
                at = math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0)))
            break
    return Crossing(bound, low, high, at, monotone)


def measure_ladder(
    task: Task,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    sigmas: Sequence[float],
    seeds: Sequence[int],
    progress: Progress = no_progress,
) -> list[Point]:
    """The ladder at ``model_cfg``'s d_k: every rung of ``sigmas`` (target unscaled init logit
    stds) x ``seeds``, trained without and with the scale."""
    gains = gains_for(task, model_cfg, seeds, sigmas, train_cfg.eval_batch)
    points = []
    for r, gain in enumerate(gains):
        unscaled, scaled = (
            [log for _, log in train_seeds(task, dataclasses.replace(model_cfg, divisor=divisor, qk_init_gain=gain), train_cfg, list(seeds))]
            for divisor in ("1", "sqrt")
        )
        points.append(
            Point(
                dk=model_cfg.head_dim,
                gain=gain,
                logit_std=statistics.median(log.init_logit_std["raw"] for log in unscaled),
                unscaled=tuple(log.steps_to(TARGET) for log in unscaled),
                scaled=tuple(log.steps_to(TARGET) for log in scaled),
                budget=train_cfg.steps,
                log_every=train_cfg.log_every,
            )
        )
        progress(r + 1, len(gains))
    return points
