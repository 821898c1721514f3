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

A rung is a target logit std or one of the realistic initialisations (:data:`REALISTIC`: nn.Linear's
default and unit-variance q and k, at their fixed gains, :class:`Rung`). Under SGD each divisor's
learning rate is searched per rung (:func:`measure_point`), since one shared rate would compare an
unscaled model that overshoots with a scaled one that does not.

:func:`crossing` reads the diagram: where the slowdown passes a bound (2x, say), bracketed by the
largest rung clearly below it and the smallest clearly above it (a stall counts as above any
bound), with the log-log interpolation between the medians around it. :func:`judge_ladder` is the
rule of one arm (an optimizer on a task): each realistic rung's own slowdown against the bound.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .base import Judgement, Progress, Verdict, no_progress
from .tasks import MQAR, PointerCopy, Task
from .training import ModelConfig, RunLog, TinyTransformer, TrainConfig, init_logit_std, median_steps, train_seeds
from .uncertainty import MEDIAN_SE, Estimate, Side, estimate, margin, quantisation, side

__all__ = [
    "REALISTIC",
    "REALISTIC_GAINS",
    "Crossing",
    "Point",
    "Rung",
    "best_lr",
    "crossing",
    "fastest_per_seed",
    "gains_for",
    "judge_ladder",
    "kept",
    "measure_ladder",
    "measure_point",
    "paired_ratios",
    "point_slowdown",
    "search_lr",
    "seeds_needed",
    "task_named",
]

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
    there), the unscaled model's measured init logit std and share of saturated rows at init
    (medians over seeds), and, where a learning rate was searched, each divisor's search pick
    (``lrs``: unscaled, scaled) and every rate's steps per seed (``by_lr``: (divisor, rate, steps)
    per rate tried, divisor "1" or "sqrt"), of which ``unscaled`` and ``scaled`` hold each seed's
    fastest (:func:`fastest_per_seed`). ``name`` names a realistic initialisation ("default":
    gain 1, "unit": unit-variance components), empty for a rung set by its target logit std."""

    dk: int
    gain: float
    logit_std: float
    unscaled: tuple[int | None, ...]
    scaled: tuple[int | None, ...]
    budget: int
    log_every: int
    name: str = ""
    saturated: float = 0.0
    lrs: tuple[float, float] | None = None
    by_lr: tuple[tuple[str, float, tuple[int | None, ...]], ...] = ()

    def as_dict(self) -> dict:
        by_lr: dict[str, dict[str, list]] = {}
        for divisor, lr, steps in self.by_lr:
            by_lr.setdefault(_DIVISOR_KEYS[divisor], {})[f"{lr:g}"] = list(steps)
        return {
            "dk": self.dk, "gain": self.gain, "logit_std": self.logit_std, "unscaled": list(self.unscaled),
            "scaled": list(self.scaled), "budget": self.budget, "log_every": self.log_every, "name": self.name,
            "saturated": self.saturated, "lrs": None if self.lrs is None else list(self.lrs), "by_lr": by_lr,
            "slowdown": None if (e := point_slowdown(self)) is None else e.as_dict(),
            "never_unscaled": sum(u is None for u in self.unscaled) / len(self.unscaled),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Point:
        lrs = None if d.get("lrs") is None else (float(d["lrs"][0]), float(d["lrs"][1]))
        by_lr = tuple(
            (divisor, float(lr), tuple(steps))
            for divisor, key in _DIVISOR_KEYS.items()
            for lr, steps in d.get("by_lr", {}).get(key, {}).items()
        )
        return cls(
            d["dk"], d["gain"], d["logit_std"], tuple(d["unscaled"]), tuple(d["scaled"]), d["budget"], d["log_every"],
            d.get("name", ""), d.get("saturated", 0.0), lrs, by_lr,
        )  # fmt: skip


_DIVISOR_KEYS = {"1": "unscaled", "sqrt": "scaled"}


def fastest_per_seed(tried: Mapping[float, Sequence[int | None]]) -> tuple[int | None, ...]:
    """Each seed's fastest steps to 90% over the learning rates tried (``tried``: each rate's steps
    per seed, None for a miss); None for a seed that missed at every rate.

    Each seed is judged at its own best rate, so that the uncertainty of which rate is best enters
    the spread over seeds; one rate shared by all seeds (the median's best) makes every seed's
    ratio move together when the pick flips between neighbouring rates.

    >>> fastest_per_seed({0.1: [200, None, 300], 0.3: [90, None, None]})
    (90, None, 300)
    """
    per_seed = zip(*tried.values(), strict=True)
    return tuple(min((s for s in steps if s is not None), default=None) for steps in per_seed)


def paired_ratios(point: Point) -> list[float]:
    """Each seed's steps to 90% without the scale over with it, a run that never gets there counted
    at the budget."""
    return [(point.budget if u is None else u) / max(point.budget if s is None else s, 1) for u, s in zip(point.unscaled, point.scaled, strict=True)]


def seeds_needed(ratios: Sequence[float], bound: float = MUCH_SLOWER, *, most: int = 1000) -> int | None:
    """The power calculation: the fewest seeds ``n`` at which a rung whose seeds' ratios spread as
    ``ratios`` do (their median and standard deviation taken as the truth) is clear of ``bound``
    by the rule's margin, Student's t(n) x 1.25 s / sqrt(n) < |median - bound|; None past ``most``.

    >>> seeds_needed([1.0, 1.1, 1.2, 1.3]), seeds_needed([1.9, 2.0, 2.1]) is None
    (3, True)
    """
    centre, s = statistics.median(ratios), statistics.stdev(ratios)
    return next((n for n in range(2, most + 1) if margin(n) * MEDIAN_SE * s / math.sqrt(n) < abs(centre - bound)), None)


def point_slowdown(point: Point) -> Estimate | None:
    """Steps to 90% without the scale over with it, paired by seed: each seed's ratio (the same
    initialisation and data at both divisors, so a seed's own difficulty cancels), their median
    and its standard error over seeds (a run that never gets there counts at the budget); None for
    a stall (the unscaled median never gets there), which is clearly slower than any bound."""
    if median_steps(list(point.unscaled)) is None:
        return None
    counted = paired_ratios(point)
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
    ``monotone`` False when some rung clearly above lies below some rung clearly below; ``stall``
    the smallest logit std from which every rung of one d_k's ladder stalls (its unscaled median
    never reaches 90%) and ``stall_dk`` that d_k, None where no d_k's largest rung stalls. (Rungs
    calibrated to one target logit std differ by rounding across d_k, so the stall is read per d_k.)"""

    bound: float
    low: float | None
    high: float | None
    at: float | None
    monotone: bool
    stall: float | None = None
    stall_dk: int | None = None

    def as_dict(self) -> dict:
        return {
            "bound": self.bound, "low": self.low, "high": self.high, "at": self.at, "monotone": self.monotone,
            "stall": self.stall, "stall_dk": self.stall_dk,
        }  # fmt: skip


def crossing(points: Sequence[Point], bound: float) -> Crossing:
    """:class:`Crossing` of ``bound`` over ``points`` (any d_k: the diagram's x axis is the
    unscaled init logit std, whatever set it). A rung whose scaled model misses 90% (median) says
    nothing of the slowdown and is left out."""
    ordered = sorted((p for p in points if median_steps(list(p.scaled)) is not None), key=lambda p: p.logit_std)
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
    stall, stall_dk = None, None
    for dk in sorted({p.dk for p in ordered}):
        onset = None
        for p, (x, y) in reversed(list(zip(ordered, medians, strict=True))):
            if p.dk != dk:
                continue
            if not math.isinf(y):
                break
            onset = x
        if onset is not None and (stall is None or onset < stall):
            stall, stall_dk = onset, dk
    return Crossing(bound, low, high, at, monotone, stall, stall_dk)


REALISTIC = ("default", "unit")
"""The realistic initialisations, rungs at fixed q/k init gains: ``nn.Linear``'s default (gain 1:
q and k components of variance about 1/3 of the LayerNorm'd input's) and unit-variance components
(gain sqrt(3), the premise of the textbook argument)."""
REALISTIC_GAINS = {"default": 1.0, "unit": math.sqrt(3.0)}


def judge_ladder(points: Sequence[Point], bound: float = MUCH_SLOWER) -> Judgement:
    """One arm's verdict (an optimizer on a task) from the rungs at the realistic initialisations
    (``Point.name`` in :data:`REALISTIC`, at every d_k), each judged by its own paired slowdown
    against ``bound`` (a stall is clearly above any bound): holds if every one is clearly above,
    does-not-hold if every one is clearly below, holds-approximately if each is clearly on one
    side and both sides occur; inconclusive if one is within noise of the bound, if fewer than 2
    seeds ran, or if the scaled model's median misses 90% at one (the budget is too small to
    compare there). The reason also states where the whole ladder crosses the bound
    (:func:`crossing`)."""
    c = crossing(points, bound)
    stated = f"{bound:g}x crossed at an init logit std of {_std_text(c.at)} (bracket {_std_text(c.low)} .. {_std_text(c.high)}"
    stated += ")" if c.monotone else "; the clear rungs are out of order)"
    stated += f"; a stall from an init logit std of {_std_text(c.stall)} (d_k {c.stall_dk})" if c.stall is not None else "; no stall at any d_k's largest rung"
    realistic = sorted((p for p in points if p.name in REALISTIC), key=lambda p: (p.dk, REALISTIC.index(p.name)))
    if not realistic:
        return Judgement(Verdict.INCONCLUSIVE, f"no rung at a realistic initialisation; {stated}")
    seeds = min(len(p.unscaled) for p in realistic)
    if seeds < 2:
        return Judgement(Verdict.INCONCLUSIVE, f"only {seeds} seed(s) per rung; the rule needs at least 2; {stated}")
    missed = [p for p in realistic if median_steps(list(p.scaled)) is None]
    if missed:
        return Judgement(
            Verdict.INCONCLUSIVE,
            f"with the scale the model missed 90% at {missed[0].name}/{missed[0].dk}: the budget is too small to compare; {stated}",
        )
    sides = {p: _side(p, bound) for p in realistic}
    names = {Side.ABOVE: "clearly above", Side.BELOW: "clearly below", Side.WITHIN: "within noise of"}
    shown = "; ".join(f"{p.name}/{p.dk} (init logit std {p.logit_std:.3g}): {_slowdown_text(p)}, {names[sides[p]]} {bound:g}x" for p in realistic)
    found = set(sides.values())
    tail = f"{shown}; {stated}; +- is the paired slowdown's standard error over {seeds} seeds"
    if found == {Side.ABOVE}:
        return Judgement(Verdict.HOLDS, f"every realistic init learns clearly >= {bound:g}x slower without the scale or stalls: {tail}")
    if found == {Side.BELOW}:
        return Judgement(Verdict.DOES_NOT_HOLD, f"every realistic init learns clearly less than {bound:g}x slower without the scale: {tail}")
    if found == {Side.ABOVE, Side.BELOW}:
        return Judgement(Verdict.HOLDS_APPROXIMATELY, f"some realistic inits are clearly {bound:g}x slower without the scale, the others clearly not: {tail}")
    return Judgement(Verdict.INCONCLUSIVE, f"a realistic init's slowdown is within noise of {bound:g}x: {tail}")


def _slowdown_text(p: Point) -> str:
    e = point_slowdown(p)
    if e is None:
        return f"stall ({sum(u is None for u in p.unscaled)}/{len(p.unscaled)} unscaled runs never reach 90%)"
    return f"x{e.centre:.2f} +- {e.spread:.2f}"


def _std_text(x: float | None) -> str:
    return "none" if x is None else f"{x:.3g}"


def kept(log: RunLog) -> int | None:
    """First logged step at 90% held-out accuracy of a run that ends at or above 90%; None for a
    run that never gets there or collapses after it (SGD can pass 90% and then diverge)."""
    return log.steps_to(TARGET) if log.accuracy[-1] >= TARGET else None


def best_lr(tried: Mapping[float, Sequence[int | None]]) -> float:
    """The learning rate whose seeds most often keep 90% (``tried``: each rate's steps per seed,
    None for a miss), the smallest median steps among those; ties go to the smallest rate.

    The fastest median alone would pick a rate at the edge of stability, where a seed or two
    diverge: a seed whose scaled run misses counts its unscaled steps over the budget, a ratio
    that measures the miss, not the scale.

    >>> best_lr({0.1: [200, 210, 190], 0.3: [90, None, 100], 1.0: [None, None, None]})
    0.1
    """

    def key(lr: float) -> tuple[int, float, float]:
        median = median_steps(list(tried[lr]))
        return sum(s is None for s in tried[lr]), math.inf if median is None else median, lr

    return min(tried, key=key)


def search_lr(
    ladder: Sequence[float], start: float, evaluate: Callable[[float], Sequence[int | None]]
) -> dict[float, Sequence[int | None]]:
    """Steps per seed (None: a miss) at the learning rates a ladder search tries; :func:`best_lr` of
    the result is the pick.

    Tries ``start`` and its neighbours, then the untried neighbours of the best so far until the best
    has both neighbours tried (or the ladder ends there), so the pick is never an untried edge.
    While no learning rate's median seed has reached the target, it widens on both sides until one does or the
    ladder is exhausted.
    """
    ladder = list(ladder)
    if start not in ladder:
        raise ValueError(f"start must be one of the ladder's learning rates {ladder}; got {start!r}.")
    tried: dict[float, Sequence[int | None]] = {}

    def visit(i: int) -> None:
        if 0 <= i < len(ladder) and ladder[i] not in tried:
            tried[ladder[i]] = evaluate(ladder[i])

    i = ladder.index(start)
    for j in (i, i - 1, i + 1):
        visit(j)
    while True:
        if all(median_steps(list(v)) is None for v in tried.values()):
            idx = [ladder.index(lr) for lr in tried]
            todo = [j for j in (min(idx) - 1, max(idx) + 1) if 0 <= j < len(ladder)]
        else:
            b = ladder.index(best_lr(tried))
            todo = [j for j in (b - 1, b + 1) if 0 <= j < len(ladder) and ladder[j] not in tried]
        if not todo:
            return tried
        for j in todo:
            visit(j)


@dataclass(frozen=True)
class Rung:
    """A rung of the ladder: a realistic initialisation (``name`` in :data:`REALISTIC`, its gain
    fixed) or a target unscaled init logit std ``sigma`` (its gain calibrated by :func:`gains_for`)."""

    name: str = ""
    sigma: float | None = None

    def __post_init__(self) -> None:
        if (self.name in REALISTIC) == (self.sigma is not None):
            raise ValueError(f"a rung is a realistic init {REALISTIC} or a target logit std, not both or neither; got {self!r}.")


def measure_point(
    task: Task,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    gain: float,
    seeds: Sequence[int],
    *,
    name: str = "",
    lrs: Sequence[float] = (),
    lr_start: float | None = None,
) -> Point:
    """One rung: ``seeds`` trained at q/k init gain ``gain`` without and with the scale (as one
    stack of models each). With ``lrs``, each divisor's learning rate is searched on that ladder
    from ``lr_start`` (:func:`search_lr`, walking towards :func:`best_lr`), and each seed's steps
    are its fastest over the rates tried (:func:`fastest_per_seed`): the fair comparison for SGD,
    whose step moves unscaled logits about d_k times further than scaled ones at one learning rate."""
    if lr_start is not None and not lrs:
        raise ValueError(
            f"lr_start={lr_start!r} starts a learning-rate search, which needs lrs (the ladder to search); got no lrs. "
            "Pass lrs, or leave lr_start out to train at train_cfg.lr."
        )
    seeds = list(seeds)
    init: dict[str, list[RunLog]] = {}
    steps: dict[str, tuple[int | None, ...]] = {}
    chosen: dict[str, float] = {}
    by_lr: list[tuple[str, float, tuple[int | None, ...]]] = []
    for divisor in ("1", "sqrt"):
        cfg = dataclasses.replace(model_cfg, divisor=divisor, qk_init_gain=gain)
        if not lrs:
            init[divisor] = [log for _, log in train_seeds(task, cfg, train_cfg, seeds)]
            steps[divisor] = tuple(kept(log) for log in init[divisor])
            continue
        logs: dict[float, list[RunLog]] = {}

        def evaluate(lr: float, cfg: ModelConfig = cfg, logs: dict[float, list[RunLog]] = logs) -> list[int | None]:
            logs[lr] = [log for _, log in train_seeds(task, cfg, dataclasses.replace(train_cfg, lr=lr), seeds)]
            return [kept(log) for log in logs[lr]]

        tried = search_lr(lrs, lr_start if lr_start is not None else lrs[len(lrs) // 2], evaluate)
        chosen[divisor] = best_lr(tried)
        init[divisor] = logs[chosen[divisor]]  # the init (logit std, saturation) is the same at every rate
        steps[divisor] = fastest_per_seed(tried)
        by_lr.extend((divisor, lr, tuple(tried[lr])) for lr in sorted(tried))
    unscaled = init["1"]
    return Point(
        dk=model_cfg.head_dim,
        gain=gain,
        logit_std=statistics.median(log.init_logit_std["raw"] for log in unscaled),
        unscaled=steps["1"],
        scaled=steps["sqrt"],
        budget=train_cfg.steps,
        log_every=train_cfg.log_every,
        name=name,
        saturated=statistics.median(log.saturated[0] for log in unscaled),
        lrs=(chosen["1"], chosen["sqrt"]) if lrs else None,
        by_lr=tuple(by_lr),
    )


def measure_ladder(
    task: Task,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    rungs: Sequence[Rung | float],
    seeds: Sequence[int],
    progress: Progress = no_progress,
    *,
    lrs: Sequence[float] = (),
    lr_start: float | None = None,
) -> list[Point]:
    """The ladder at ``model_cfg``'s d_k: every rung (a :class:`Rung`, or a bare number as the
    target logit std) x ``seeds``, trained without and with the scale (:func:`measure_point`)."""
    rungs = [r if isinstance(r, Rung) else Rung(sigma=float(r)) for r in rungs]
    targets = [r.sigma for r in rungs if r.sigma is not None]
    calibrated = iter(gains_for(task, model_cfg, seeds, targets, train_cfg.eval_batch) if targets else [])
    gains = [REALISTIC_GAINS[r.name] if r.sigma is None else next(calibrated) for r in rungs]
    points = []
    for i, (rung, gain) in enumerate(zip(rungs, gains, strict=True)):
        points.append(measure_point(task, model_cfg, train_cfg, gain, seeds, name=rung.name, lrs=lrs, lr_start=lr_start))
        progress(i + 1, len(rungs))
    return points


def main(argv: Sequence[str] | None = None) -> int:
    """Print one ladder: each rung's logit std, gain, steps per seed and paired slowdown, then the
    crossing of 2x and the wall time (the lab's default training sizes unless told otherwise).
    The realistic inits are rungs too, unless --no-realistic."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m attnscale.lab.stall_phase", description=main.__doc__)
    parser.add_argument("--task", choices=["mqar", "copy"], default="mqar")
    parser.add_argument("--dk", type=int, default=64)
    parser.add_argument("--sigmas", type=float, nargs="*", default=[1.0, 27.0], help="target unscaled init logit stds")
    parser.add_argument("--no-realistic", action="store_true", help="leave out the default and unit-variance inits")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, help="AdamW's learning rate (default 1e-3)")
    parser.add_argument("--lrs", type=float, nargs="+", help="SGD's learning-rate ladder (default 0.003 0.01 0.03 0.1 0.3 1 3)")
    parser.add_argument("--lr-start", type=float, help="the ladder's rate where SGD's search starts (default 0.1)")
    args = parser.parse_args(argv)
    task = task_named(args.task, context=16, queries=8, vocab=32)
    sgd = args.optimizer == "sgd"
    wrong = ["--lrs" if args.lrs is not None else "", "--lr-start" if args.lr_start is not None else ""] if not sgd else ["--lr" if args.lr is not None else ""]
    if any(wrong):
        parser.error(f"{' and '.join(w for w in wrong if w)} applies to the other optimizer, not --optimizer {args.optimizer}: AdamW takes --lr, SGD searches --lrs from --lr-start.")
    args.lr = 1e-3 if args.lr is None else args.lr
    args.lrs = [0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0] if args.lrs is None else args.lrs
    args.lr_start = 0.1 if args.lr_start is None else args.lr_start
    if sgd and args.lr_start not in args.lrs:
        parser.error(f"--lr-start must be one of --lrs {args.lrs}; got {args.lr_start:g}.")
    train_cfg = TrainConfig(
        steps=args.steps, batch=32, lr=args.lr, log_every=10, eval_batch=64, stop_at=TARGET, optimizer=args.optimizer,
        weight_decay=0.0 if sgd else 0.01,
    )  # fmt: skip
    rungs = ([] if args.no_realistic else [Rung(name) for name in REALISTIC]) + [Rung(sigma=s) for s in args.sigmas]
    start = time.perf_counter()
    points = measure_ladder(
        task, ModelConfig(d_model=32, head_dim=args.dk), train_cfg, rungs, range(args.seeds), lrs=args.lrs if sgd else (),
        lr_start=args.lr_start if sgd else None,
    )  # fmt: skip
    for p in sorted(points, key=lambda p: p.logit_std):
        e = point_slowdown(p)
        print(f"{p.name or 'rung':7s} logit std {p.logit_std:6.2f}  gain {p.gain:5.2f}  steps to 90% without / with the scale "
              f"{p.unscaled} / {p.scaled}{'' if p.lrs is None else f'  lr {p.lrs[0]:g} / {p.lrs[1]:g}'}  slowdown {'stall' if e is None else e.text()}")  # fmt: skip
    print(judge_ladder(points).reason)
    print(f"{args.task}, d_k {args.dk}, {args.optimizer}: {time.perf_counter() - start:.0f} s on {torch.get_num_threads()} threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
