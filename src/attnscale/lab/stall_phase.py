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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .base import Judgement, Progress, Verdict, no_progress
from .tasks import MQAR, PointerCopy, Task
from .training import ModelConfig, TinyTransformer, TrainConfig, init_logit_std, median_steps, train_seeds
from .uncertainty import Estimate, Side, estimate, quantisation, side

__all__ = ["Crossing", "Point", "crossing", "gains_for", "judge_ladder", "measure_ladder", "point_slowdown", "task_named"]

TARGET = 0.9
MUCH_SLOWER = 2.0


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


def judge_ladder(points: Sequence[Point], realistic: Mapping[str, float], bound: float = MUCH_SLOWER) -> Judgement:
    """One arm's verdict (an optimizer on a task) from its diagram: where the realistic
    initialisations (``realistic``: name -> their unscaled init logit std) lie against the
    crossing of ``bound``. A realistic std at or past the smallest rung clearly above the bound is
    clearly slowed that much (the slowdown grows with the std: :func:`crossing` checks that its
    clear rungs agree); one at or before the largest rung clearly below it clearly is not.
    holds: every realistic init is past; does-not-hold: every one is before; holds-approximately:
    some past and the rest before (the crossing lies among them); inconclusive: a realistic init
    within the bracket, clear rungs out of order, or a scaled model that misses 90% at or below
    the largest realistic std (the budget is too small to compare there)."""
    c = crossing(points, bound)
    stated = f"{bound:g}x crossed at an init logit std of {_std_text(c.at)} (bracket {_std_text(c.low)} .. {_std_text(c.high)})"
    top = max(realistic.values())
    missed = [p.logit_std for p in points if p.logit_std <= top and median_steps(list(p.scaled)) is None]
    if missed:
        return Judgement(Verdict.INCONCLUSIVE, f"with the scale the model missed 90% at init logit std {min(missed):.3g}: the budget is too small to compare; {stated}")
    if not c.monotone:
        return Judgement(Verdict.INCONCLUSIVE, f"a rung clearly above {bound:g}x lies below one clearly under it: the slowdown does not grow with the logit std alone; {stated}")
    where = {name: ("past" if c.high is not None and x >= c.high else "before" if c.low is not None and x <= c.low else "within") for name, x in realistic.items()}
    shown = ", ".join(f"{name} (std {realistic[name]:.3g}) {place}" for name, place in where.items())
    places = set(where.values())
    if places == {"past"}:
        return Judgement(Verdict.HOLDS, f"every realistic init is clearly past {bound:g}x: {shown}; {stated}")
    if places == {"before"}:
        return Judgement(Verdict.DOES_NOT_HOLD, f"every realistic init is clearly before {bound:g}x: {shown}; {stated}")
    if places == {"past", "before"}:
        return Judgement(Verdict.HOLDS_APPROXIMATELY, f"the crossing lies among the realistic inits: {shown}; {stated}")
    return Judgement(Verdict.INCONCLUSIVE, f"a realistic init lies within the bracket of the crossing: {shown}; {stated}")


def _std_text(x: float | None) -> str:
    return "none" if x is None else f"{x:.3g}"


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


def main(argv: Sequence[str] | None = None) -> int:
    """Print one ladder: each rung's logit std, gain, steps per seed and paired slowdown, then the
    crossing of 2x and the wall time (the lab's default training sizes unless told otherwise)."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m attnscale.lab.stall_phase", description=main.__doc__)
    parser.add_argument("--task", choices=["mqar", "copy"], default="mqar")
    parser.add_argument("--dk", type=int, default=64)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[1.0, 3.0, 9.0, 27.0, 54.0], help="target unscaled init logit stds")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    task = task_named(args.task, context=16, queries=8, vocab=32)
    train_cfg = TrainConfig(
        steps=args.steps, batch=32, lr=args.lr, log_every=10, eval_batch=64, stop_at=TARGET, optimizer=args.optimizer,
        weight_decay=0.0 if args.optimizer == "sgd" else 0.01,
    )  # fmt: skip
    start = time.perf_counter()
    points = measure_ladder(task, ModelConfig(d_model=32, head_dim=args.dk), train_cfg, args.sigmas, range(args.seeds))
    for p in points:
        e = point_slowdown(p)
        print(f"logit std {p.logit_std:6.2f}  gain {p.gain:5.2f}  steps to 90% without / with the scale {p.unscaled} / {p.scaled}  "
              f"slowdown {'stall' if e is None else e.text()}")  # fmt: skip
    c = crossing(points, 2.0)
    print(f"{args.task}, d_k {args.dk}, {args.optimizer}: 2x crossed at {c.at} (bracket {c.low} .. {c.high}, monotone {c.monotone}); "
          f"{time.perf_counter() - start:.0f} s on {torch.get_num_threads()} threads")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
