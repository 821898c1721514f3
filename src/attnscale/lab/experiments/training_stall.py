"""training-stall: does attention without the scale learn much more slowly, or stall, at d_k = 64, 128?

A one-layer transformer (attnscale's MultiHeadAttention, AdamW) learns multi-query associative
recall, where the answer is only reachable through attention. Grid: divisor of q.k in
{1, sqrt(d_k), d_k} x d_k in {64, 128} x q/k initialisation x seeds. Two initialisations:

* ``default`` - ``nn.Linear``'s default init: q and k components have variance ~1/3 of the
  LayerNorm'd input's, so the unscaled init logits have std ~ sqrt(d_k) / 3, not sqrt(d_k);
* ``unit`` - q/k weights times sqrt(3): unit-variance components, the premise of the argument
  (unscaled init logit std ~ sqrt(d_k) = 8 at d_k = 64, 11.3 at d_k = 128).

``default`` and ``full`` add ``small`` (q/k weights times 0.1, no scale: small init as the
alternative cure), ``large`` (q/k weights times 4 sqrt(3), component variance 16, at the largest
d_k, with and without the scale: where saturation at init is complete, to locate the regime in
which the claim's mechanism bites), and train the unscaled model at the largest d_k and init for
``long_steps`` rather than ``steps``, to see whether a stall ends. The measured init logit std
of every condition is reported. The verdict is taken on the ``default`` and ``unit`` conditions
only: ``small`` and ``large`` are deliberate departures from them.

An optimizer arm trains the ``default`` and ``unit`` conditions (divisor 1 and sqrt(d_k)) again
with plain SGD with momentum. Adam divides each update by a running gradient scale, which largely
cancels a gradient that is small because softmax is saturated; SGD does not, so it is where the
claim's vanishing-gradient mechanism has the most room. Without the scale, for the same weights
and the same gradient on the logits, the gradient on W_q and W_k is sqrt(d_k) times larger and an
SGD step moves the logits about d_k times further, so one shared learning rate would compare an
unscaled model that overshoots with a scaled one that does not. Each condition's learning rate
is therefore tuned on the ladder ``sgd_lrs`` (factors of about 3) and the condition is judged at
its best one, the usual fair comparison: the search starts at ``sgd_lr_start`` and its two
neighbours and walks towards the better side until a learning rate beats both of its neighbours or
the ladder ends, so the reported best is never an untried edge. Under SGD a run can pass 90% and then diverge, so the arm counts a run as learned only
if it ends at or above 90% (its step is still the first one at 90%); a run that collapses counts
as never getting there, and each unscaled condition's best and final accuracy and peak logit are
reported. SGD runs without weight decay: coupled L2 decay at SGD's learning rate would shrink the
weights far more than AdamW's decoupled decay does.

Profiles: ``quick`` keeps d_k = 64 and 128 but drops the divisor d_k, the small and large inits,
the long budget and the SGD arm, with two seeds and early stop at 90% accuracy, so that it fits
CI; ``full`` uses a larger task (24 pairs of 64 keys), d_model 64, batch 64 and eight seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from ..base import Arm, Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, no_progress, save_figure
from ..tasks import MQAR
from ..training import SATURATED, ModelConfig, RunLog, TrainConfig, median_steps, train_seeds
from ..uncertainty import Estimate, Side, estimate, quantisation, ratio, side

CLAIM = Claim(
    id="training-stall",
    statement=(
        "Without the 1/sqrt(d_k) scale a transformer learns attention much more slowly or stalls at "
        "realistic head dims (d_k = 64, 128); with the scale it learns."
    ),
    sources=("Vaswani et al. 2017, sec. 3.2.1 and footnote 4",),
    method=(
        "One-layer pre-LN transformer with attnscale.MultiHeadAttention trained by AdamW on multi-query "
        "associative recall; divisor {1, sqrt(d_k), d_k} x d_k {64, 128} x q/k init {default nn.Linear, "
        "unit-variance components} x seeds; steps until held-out accuracy first reaches 90%, learning "
        "curves, max attention logit and share of saturated rows (max prob > 0.99); plus small q/k init "
        "without the scale, a large q/k init (component variance 16) at d_k = 128, and a long unscaled run; "
        "and (default and full profiles) the default and unit conditions with divisor 1 and sqrt(d_k) trained "
        "again by SGD with momentum 0.9 without weight decay, the learning rate of each condition tuned by a search on "
        "a ladder from 0.003 to 3 (factors of about 3) and the condition judged at its best one, a run counting as "
        "learned only if it ends at or above 90%."
    ),
    rule=(
        "Per (init, d_k) condition, init in {default, unit}, slowdown r = median steps-to-90% without the scale / with sqrt(d_k) "
        "over seeds, with its standard error (each median's 1.25 s / sqrt(n), s at least a logging interval / sqrt(12), "
        "relative errors added in quadrature; a run that never reaches 90% counts at the step budget, and an unscaled "
        "median that never reaches it is a stall, clearly slower than any bound). r is clearly above a bound b when "
        "r - t standard errors > b, clearly below it when r + t standard errors <= b, t being Student's t 95% quantile "
        "for the seed count (12.7 for 2 seeds, 4.30 for 3, 3.18 for 4, 2.36 for 8). inconclusive if fewer than 2 seeds "
        "or the scaled model's median does not reach 90% in some condition; holds if r is clearly above 2 in every "
        "condition; does-not-hold if r is clearly below 2 in every condition and clearly below 1.25 in some; "
        "holds-approximately if r is clearly below 2 in some condition and either clearly above 2 in some or clearly "
        "above 1.25 in every one (slower everywhere but not 2x everywhere, or 2x in some conditions only); "
        "inconclusive otherwise (a comparison the verdict turns on is within noise). "
        "The rule is applied to each optimizer's runs on their own (AdamW; SGD where it ran, at each condition's best "
        "learning rate: the smallest median steps, a run that ends below 90% counting as never reaching it), and each "
        "optimizer's verdict is reported. The claim's verdict: inconclusive if every optimizer is inconclusive; "
        "otherwise the least supportive conclusive verdict (does-not-hold < holds-approximately < holds), since the "
        "claim is stated for training in general."
    ),
    rule_history=(
        RuleVersion(
            1,
            "2026-11-29",
            "AdamW only: holds if the unscaled model needs >= 2x the scaled one's median steps to 90% in "
            "every (init, d_k) condition; does-not-hold if no condition reaches 2x and one is within 1.25x",
            "f99f3917c8887913",
        ),
        RuleVersion(
            2,
            "2026-11-29",
            "an SGD arm judged by the same rule at one learning rate; optimizers that disagree combined "
            "into holds-approximately",
            "ae5e335edb49f078",
        ),
        RuleVersion(
            3,
            "2026-11-29",
            "SGD judged at each condition's best of three learning rates; a run that ends below 90% counts "
            "as never reaching it",
            "056333632b8ba926",
        ),
        RuleVersion(
            4,
            "2026-11-29",
            "SGD learning rate tuned per condition by a ladder search that never stops at an untried edge",
            "cd3631cbe4ea3085",
        ),
        RuleVersion(
            5,
            "2026-11-29",
            "the reason's wording only (one formatter for the unscaled conditions); the same verdicts",
            "f11ad124bc6e7f81",
        ),
        RuleVersion(
            6,
            "2026-12-01",
            "each optimizer's verdict is reported on its own, and the claim gets the least supportive one "
            "instead of a holds-approximately merge of disagreeing optimizers",
            "fe47709b4ea71dfd",
        ),
        RuleVersion(7, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "a75f6a0183dc0a4c"),
        RuleVersion(
            8,
            "2026-12-02",
            "every slowdown carries its standard error over seeds and counts against 2 and 1.25 only when clear by 2 "
            "of them; a verdict that turns on a comparison within noise is inconclusive (v7 compared bare medians "
            "of 3 seeds)",
            "0c4faae9c38f7d22",
        ),
        RuleVersion(
            9,
            "2026-12-02",
            "a comparison is clear by Student's t 95% quantile of standard errors for the seed count (12.7 for 2 seeds, 4.30 for 3, 3.18 for 4) instead of 2: from a few seeds their standard deviation is itself uncertain, and the quick profile's 2 seeds gave logit-growth a clear growth on an AMD EPYC where an Intel Xeon's was within noise; training's AdamW and SGD use torch's foreach implementation (the same update on all parameters at once, faster)",
            "812ecb1c85d0c281",
        ),
        RuleVersion(10, "2026-12-02", "the same measurement and rule, faster: the seeds of each condition train together as one stack of models (attnscale.lab.grouped: each seed as if trained alone, up to rounding), the optimizers run torch's fused update, and the conditions run as parts side by side in the report's job slots; the numbers change by rounding", "62d8eab33200d8f0"),
    ),
)

HEADLINE = Headline(
    "slowdown.default/128",
    "steps to 90% without the scale / with it (AdamW, default init, d_k 128)",
    "x",
    spread="slowdown_spread.default/128",
)
INIT_GAINS = {"default": 1.0, "unit": math.sqrt(3.0), "small": 0.1, "large": 4 * math.sqrt(3.0)}
VERDICT_INITS = ("default", "unit")
MUCH_SLOWER = 2.0
SLOWER = 1.25
TARGET = 0.9


@dataclass(frozen=True)
class Config:
    dks: tuple[int, ...] = (64, 128)
    divisors: tuple[str, ...] = ("1", "sqrt", "dk")
    inits: tuple[str, ...] = ("default", "unit")
    small_init: bool = True
    large_init: bool = True
    seeds: int = 3
    context: int = 16
    queries: int = 8
    n_keys: int = 32
    n_values: int = 32
    d_model: int = 32
    batch: int = 32
    lr: float = 1e-3
    steps: int = 1500
    stop_at: float = 0.98
    log_every: int = 10
    eval_batch: int = 64
    long_steps: int = 4000
    sgd_lrs: tuple[float, ...] = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
    sgd_lr_start: float = 0.1
    sgd_momentum: float = 0.9
    sgd_steps: int = 400
    sgd_seeds: int = 2

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(
                dks=(64,), divisors=("1", "sqrt"), inits=("default",), small_init=False, large_init=False, seeds=2,
                context=4, queries=4, n_keys=8, n_values=8, steps=40, log_every=10, eval_batch=32, long_steps=60,
                sgd_steps=30, sgd_lrs=(0.1, 0.3, 1.0),
            )
        if profile == "quick":
            return cls(
                divisors=("1", "sqrt"), small_init=False, large_init=False, seeds=2, steps=400, stop_at=0.9, long_steps=0, sgd_steps=0
            )
        if profile == "default":
            return cls()
        if profile == "full":
            return cls(
                seeds=8, context=24, n_keys=64, n_values=64, d_model=64, batch=64, steps=3000, long_steps=10000,
                sgd_steps=1500, sgd_seeds=4,
            )
        raise ValueError(f"profile must be one of tiny, quick, default, full; got {profile!r}.")


def _label(divisor: str, dk: int) -> str:
    return f"{divisor}/{dk}"


def _conditions(config: Config) -> list[tuple[str, str, int]]:
    """(init, divisor, d_k) of every trained condition."""
    grid = [(init, div, dk) for init in config.inits for div in config.divisors for dk in config.dks]
    if config.small_init:
        grid += [("small", "1", dk) for dk in config.dks]
    if config.large_init:
        grid += [("large", div, max(config.dks)) for div in ("1", "sqrt")]
    return grid


def _curve(log: RunLog) -> dict[str, list[float]]:
    return {k: getattr(log, k) for k in ("steps", "accuracy", "loss", "max_logit", "entropy", "saturated")}


def _long_condition(config: Config) -> tuple[str, str, int] | None:
    """The condition trained for ``long_steps``: no scale, the largest d_k, the largest q/k init."""
    if not config.long_steps:
        return None
    return ("large" if config.large_init else config.inits[-1], "1", max(config.dks))


def _task(config: Config) -> MQAR:
    return MQAR(context=config.context, queries=config.queries, n_keys=config.n_keys, n_values=config.n_values)


def _part_conditions(config: Config) -> dict[str, list[tuple[str, str, int]]]:
    """The conditions of each part, in the grid's order: AdamW ("adamw init/d_k", every divisor;
    the long run on its own), then SGD ("sgd init/d_k", both divisors). Parts are independent runs
    of the same measurement, so that a report can train them side by side."""
    long_condition = _long_condition(config)
    out: dict[str, list[tuple[str, str, int]]] = {}
    for cond in _conditions(config):
        init, _, dk = cond
        name = f"adamw {init}/{dk}" + (" long" if cond == long_condition else "")
        out.setdefault(name, []).append(cond)
    if config.sgd_steps:
        for cond in _sgd_conditions(config):
            out.setdefault(f"sgd {cond[0]}/{cond[2]}", []).append(cond)
    return out


def parts(config: Config) -> list[str]:
    return list(_part_conditions(config))


def run_part(config: Config, seed: int, part: str, progress: Progress) -> dict:
    """Every condition of ``part``: ``{"optimizer|init|divisor/d_k": results}`` (see ``_adamw_condition``, ``_sgd_condition``)."""
    conditions = _part_conditions(config)[part]
    optimizer = part.split()[0]
    task, out = _task(config), {}
    for c, cond in enumerate(conditions):
        key = f"{optimizer}|{cond[0]}|{_label(cond[1], cond[2])}"
        out[key] = (_sgd_condition if optimizer == "sgd" else _adamw_condition)(config, task, seed, cond)
        progress(c + 1, len(conditions))
    return out


def run(config: Config, seed: int, progress: Progress) -> dict:
    names = parts(config)
    results = {}
    for i, name in enumerate(names):
        results[name] = run_part(config, seed, name, no_progress)
        progress(i + 1, len(names))
    return combine(config, seed, results)


def _adamw_condition(config: Config, task: MQAR, seed: int, cond: tuple[str, str, int]) -> dict:
    """One AdamW condition's seeds: steps to 90%, curves, final saturated shares, mean init logit stds."""
    init, div, dk = cond
    model_cfg = ModelConfig(d_model=config.d_model, head_dim=dk, divisor=div, qk_init_gain=INIT_GAINS[init])  # type: ignore[arg-type]
    long = cond == _long_condition(config)
    train_cfg = TrainConfig(
        steps=config.long_steps if long else config.steps,
        batch=config.batch,
        lr=config.lr,
        log_every=config.log_every,
        eval_batch=config.eval_batch,
        stop_at=TARGET if long else config.stop_at,  # whether the stall ends is all it must show
    )
    out: dict = {"steps": [], "curves": [], "final_saturated": [], "init_std": {"raw": 0.0, "scaled": 0.0}}
    for _, log in train_seeds(task, model_cfg, train_cfg, [seed + i for i in range(config.seeds)]):
        out["steps"].append(log.steps_to(TARGET))
        out["curves"].append(_curve(log))
        out["final_saturated"].append(log.saturated[-1])
        for k in ("raw", "scaled"):
            out["init_std"][k] += log.init_logit_std[k] / config.seeds
    return out


def combine(config: Config, seed: int, results: dict[str, dict]) -> dict:
    """What ``run`` measures, from every part's ``run_part``."""
    done = {key: value for part in parts(config) for key, value in results[part].items()}
    long_condition = _long_condition(config)
    steps: dict[str, dict[str, list[int | None]]] = {}
    curves: dict[str, dict[str, list[dict]]] = {}
    init_std: dict[str, dict[str, dict[str, float]]] = {}
    final_saturated: dict[str, dict[str, list[float]]] = {}
    for init, div, dk in _conditions(config):
        label = _label(div, dk)
        cond = done[f"adamw|{init}|{label}"]
        steps.setdefault(init, {})[label] = cond["steps"]
        curves.setdefault(init, {})[label] = cond["curves"]
        final_saturated.setdefault(init, {})[label] = cond["final_saturated"]
        init_std.setdefault(init, {})[label] = cond["init_std"]

    long_run = None
    if long_condition is not None:
        init, div, dk = long_condition
        label = _label(div, dk)
        long_run = {
            "label": label,
            "init": init,
            "budget": config.long_steps,
            "runs": [
                {"steps_to_90": s, "final_accuracy": c["accuracy"][-1]} for s, c in zip(steps[init][label], curves[init][label])
            ],
        }

    medians = {init: {label: median_steps(v) for label, v in by_label.items()} for init, by_label in steps.items()}
    sgd = _sgd_measured(config, [done[f"sgd|{c[0]}|{_label(c[1], c[2])}"] for c in _sgd_conditions(config)]) if config.sgd_steps else {}
    measured = {
        "config": asdict(config),
        "target_accuracy": TARGET,
        "chance_accuracy": 1.0 / config.n_values,
        "init_gains": {k: INIT_GAINS[k] for k in steps},
        "steps_to_90": medians.get("default", {}),
        "steps_to_90_by_init": medians,
        "steps_to_90_per_seed": steps,
        "slowdown": _slowdowns(
            medians,
            config.dks,
            config.steps,
            {f"{long_condition[0]}/{long_condition[2]}": config.long_steps} if long_condition else None,
        ),
        "small_init_over_scaled": _small_init_ratio(medians, config.dks),
        "init_logit_std": init_std,
        "final_saturated_share": final_saturated,
        "curves": curves,
        "long_run": long_run,
        "optimizers": ["adamw", "sgd"] if sgd else ["adamw"],
        **sgd,
    }
    spreads = {}
    for cond, r in measured["slowdown"].items():
        e = _slowdown_estimate(measured, "", cond) if r is not None else None
        spreads[cond] = None if e is None else e.spread
    measured["slowdown_spread"] = spreads
    return measured


def _sgd_conditions(config: Config) -> list[tuple[str, str, int]]:
    """(init, divisor, d_k) of the SGD arm: the verdict's inits, with and without the scale."""
    return [(init, div, dk) for init in config.inits for div in ("1", "sqrt") for dk in config.dks]


def _kept(log: RunLog) -> int | None:
    """First step at 90% of a run that ends at or above 90%; None for a run that misses or collapses."""
    return log.steps_to(TARGET) if log.accuracy[-1] >= TARGET else None


def _best_lr(medians: dict[float, float | None]) -> float:
    """The learning rate with the smallest median steps (None is never); ties and all-None go to the smallest."""
    return min(medians, key=lambda lr: (math.inf if medians[lr] is None else medians[lr], lr))


def _search_lr(ladder: tuple[float, ...], start: float, evaluate: Callable[[float], float | None]) -> dict[float, float | None]:
    """Median steps at the learning rates a ladder search tries; ``_best_lr`` of the result is the pick.

    Tries ``start`` and its neighbours, then the untried neighbours of the best so far until the best
    has both neighbours tried (or the ladder ends there). While no learning rate has reached the
    target, it widens on both sides until one does or the ladder is exhausted.
    """
    tried: dict[float, float | None] = {}

    def visit(i: int) -> None:
        if 0 <= i < len(ladder) and ladder[i] not in tried:
            tried[ladder[i]] = evaluate(ladder[i])

    i = ladder.index(start)
    for j in (i, i - 1, i + 1):
        visit(j)
    while True:
        if all(v is None for v in tried.values()):
            idx = [ladder.index(lr) for lr in tried]
            todo = [j for j in (min(idx) - 1, max(idx) + 1) if 0 <= j < len(ladder)]
        else:
            b = ladder.index(_best_lr(tried))
            todo = [j for j in (b - 1, b + 1) if 0 <= j < len(ladder) and ladder[j] not in tried]
        if not todo:
            return tried
        for j in todo:
            visit(j)


def _sgd_condition(config: Config, task: MQAR, seed: int, cond: tuple[str, str, int]) -> dict:
    """One SGD condition at the learning rates its ladder search tries: each one's median steps
    (``by_lr``, in the order tried), the best one, and its seeds' steps, curves, final saturated
    shares, peak logits and best and final accuracies."""
    init, div, dk = cond
    model_cfg = ModelConfig(d_model=config.d_model, head_dim=dk, divisor=div, qk_init_gain=INIT_GAINS[init])  # type: ignore[arg-type]
    logs: dict[float, list[RunLog]] = {}
    by_lr: dict[str, float | None] = {}

    def evaluate(lr: float) -> float | None:
        train_cfg = TrainConfig(
            steps=config.sgd_steps,
            batch=config.batch,
            lr=lr,
            weight_decay=0.0,
            log_every=config.log_every,
            eval_batch=config.eval_batch,
            stop_at=config.stop_at,
            optimizer="sgd",
            momentum=config.sgd_momentum,
        )
        logs[lr] = [log for _, log in train_seeds(task, model_cfg, train_cfg, [seed + i for i in range(config.sgd_seeds)])]
        median = median_steps([_kept(log) for log in logs[lr]])
        by_lr[f"{lr:g}"] = median
        return median

    best = _best_lr(_search_lr(config.sgd_lrs, config.sgd_lr_start, evaluate))
    runs = logs[best]
    return {
        "by_lr": by_lr,
        "best": best,
        "steps": [_kept(log) for log in runs],
        "curves": [_curve(log) for log in runs],
        "final_saturated": [log.saturated[-1] for log in runs],
        "peak_logit": [max(log.max_logit) for log in runs],
        "accuracy": [{"best": max(log.accuracy), "final": log.accuracy[-1]} for log in runs],
    }


def _sgd_measured(config: Config, conditions: list[dict]) -> dict:
    """The SGD arm's measured keys (suffix ``_sgd``; settings under ``sgd``; the medians of every
    learning rate tried under ``steps_to_90_sgd_by_lr``) from ``_sgd_condition`` of each condition."""
    by_lr: dict[str, dict[str, dict[str, float | None]]] = {}
    chosen: dict[str, dict[str, float]] = {}
    steps: dict[str, dict[str, list[int | None]]] = {}
    curves: dict[str, dict[str, list[dict]]] = {}
    final_saturated: dict[str, dict[str, list[float]]] = {}
    peak_logit: dict[str, dict[str, list[float]]] = {}
    accuracy: dict[str, dict[str, list[dict[str, float]]]] = {}
    for (init, div, dk), cond in zip(_sgd_conditions(config), conditions, strict=True):
        label = _label(div, dk)
        for lr, median in cond["by_lr"].items():
            by_lr.setdefault(lr, {}).setdefault(init, {})[label] = median
        chosen.setdefault(init, {})[label] = cond["best"]
        steps.setdefault(init, {})[label] = cond["steps"]
        curves.setdefault(init, {})[label] = cond["curves"]
        final_saturated.setdefault(init, {})[label] = cond["final_saturated"]
        peak_logit.setdefault(init, {})[label] = cond["peak_logit"]
        accuracy.setdefault(init, {})[label] = cond["accuracy"]
    medians = {init: {label: median_steps(v) for label, v in by_label.items()} for init, by_label in steps.items()}
    return {
        "sgd": {
            "lrs": list(config.sgd_lrs),
            "lr_start": config.sgd_lr_start,
            "momentum": config.sgd_momentum,
            "weight_decay": 0.0,
            "budget": config.sgd_steps,
            "seeds": config.sgd_seeds,
        },
        "sgd_best_lr": chosen,
        "steps_to_90_sgd_by_lr": by_lr,
        "steps_to_90_sgd": medians.get("default", {}),
        "steps_to_90_sgd_by_init": medians,
        "steps_to_90_sgd_per_seed": steps,
        "slowdown_sgd": _slowdowns(medians, config.dks, config.sgd_steps),
        "final_saturated_share_sgd": final_saturated,
        "peak_max_logit_sgd": peak_logit,
        "accuracy_sgd": accuracy,
        "curves_sgd": curves,
    }


def _slowdowns(
    medians: dict[str, dict[str, float | None]],
    dks: tuple[int, ...],
    budget: int,
    long_budgets: dict[str, int] | None = None,
) -> dict[str, float | None]:
    """Median steps without the scale over with it, per "init/d_k"; None where the scaled model did
    not reach the target; a stalled unscaled model gives at least its budget / scaled steps (JSON
    has no infinity, so the bound is reported and flagged by ``steps_to_90`` being null).
    ``long_budgets`` gives the budget of conditions trained for longer."""
    out: dict[str, float | None] = {}
    for init, by_label in medians.items():
        for dk in dks:
            scaled, unscaled = by_label.get(_label("sqrt", dk)), by_label.get(_label("1", dk))
            if _label("sqrt", dk) not in by_label or _label("1", dk) not in by_label:
                continue
            if scaled is None:
                out[f"{init}/{dk}"] = None
            else:
                cap = (long_budgets or {}).get(f"{init}/{dk}", budget)
                out[f"{init}/{dk}"] = (unscaled if unscaled is not None else cap) / max(scaled, 1)
    return out


def _small_init_ratio(medians: dict[str, dict[str, float | None]], dks: tuple[int, ...]) -> dict[str, float | None]:
    """Median steps of the unscaled small-init model over the scaled default-init one, per d_k."""
    small, default = medians.get("small"), medians.get("default")
    if not small or not default:
        return {}
    out: dict[str, float | None] = {}
    for dk in dks:
        a, b = small.get(_label("1", dk)), default.get(_label("sqrt", dk))
        out[str(dk)] = None if a is None or b is None else a / max(b, 1)
    return out


# How far each verdict supports the claim: where optimizers disagree, the claim (stated for training
# in general) gets the least supportive one, and every optimizer's verdict is reported beside it.
_SUPPORT = {Verdict.DOES_NOT_HOLD: 0, Verdict.HOLDS_APPROXIMATELY: 1, Verdict.HOLDS: 2}


def judge(measured: dict) -> Judgement:
    adamw = _judge_arm(measured, "")
    if "slowdown_sgd" not in measured:
        return adamw
    sgd, settings = _judge_arm(measured, "_sgd"), measured["sgd"]
    lrs = f"{min(settings['lrs']):g}..{max(settings['lrs']):g}"
    sgd_name = f"SGD (lr tuned per condition on {lrs}, momentum {settings['momentum']:g}, {settings['budget']} steps)"
    arms = (Arm("AdamW", adamw.verdict, adamw.reason), Arm(sgd_name, sgd.verdict, sgd.reason))
    conclusive = [a for a in arms if a.verdict is not Verdict.INCONCLUSIVE]
    if not conclusive:
        return Judgement(Verdict.INCONCLUSIVE, "no optimizer gives a conclusive verdict", arms)
    least = min(conclusive, key=lambda a: _SUPPORT[a.verdict])
    each = "; ".join(f"{a.name.split(' ')[0]}: {a.verdict.value}" for a in arms)
    if all(a.verdict is least.verdict for a in arms):
        return Judgement(least.verdict, f"both optimizers agree ({each})", arms)
    return Judgement(
        least.verdict,
        f"the optimizers disagree ({each}); the claim, stated for training in general, gets the least supportive "
        "verdict, and each optimizer's verdict stands on its own",
        arms,
    )


def _unscaled(by_init: dict[str, dict[str, object]], show: Callable[..., str]) -> str:
    """"init/d_k value" for every unscaled (divisor 1) entry of an init -> label -> value table;
    ``show(value, by_label, d_k)`` formats the value."""
    return ", ".join(
        f"{init}/{label.split('/')[1]} {show(value, by_label, int(label.split('/')[1]))}"
        for init, by_label in by_init.items()
        for label, value in by_label.items()
        if label.startswith("1/")
    )


def _judge_arm(measured: dict, suffix: str) -> Judgement:
    """The rule on one optimizer's runs: AdamW's keys (``suffix=""``) or SGD's (``"_sgd"``)."""
    per_seed = measured[f"steps_to_90{suffix}_per_seed"]
    medians = measured[f"steps_to_90{suffix}_by_init"]
    slowdown = measured[f"slowdown{suffix}"]
    seeds = min((len(v) for by_label in per_seed.values() for v in by_label.values()), default=0)
    if seeds < 2:
        return Judgement(Verdict.INCONCLUSIVE, f"only {seeds} seed(s) per condition; the rule needs at least 2")
    ratios: dict[str, float] = {}
    extra = {cond: r for cond, r in slowdown.items() if cond.split("/")[0] not in VERDICT_INITS}
    for cond, r in slowdown.items():
        init, dk = cond.split("/")
        if init not in VERDICT_INITS:
            continue
        if r is None:
            return Judgement(
                Verdict.INCONCLUSIVE,
                f"with the scale the model did not reach {TARGET:.0%} in condition {cond} (median over seeds): "
                "the budget is too small to compare",
            )
        stalled = medians[init].get(_label("1", int(dk))) is None
        ratios[cond] = math.inf if stalled else r
    if not ratios:
        return Judgement(Verdict.INCONCLUSIVE, "no condition has both divisor 1 and sqrt(d_k)")
    std = measured["init_logit_std"]
    # under SGD a run can miss 90% by collapsing after a rise rather than by stalling: say only what was measured
    missed = "stalls" if not suffix else "misses or loses 90%"
    def spread(cond: str) -> str:
        e = _slowdown_estimate(measured, suffix, cond)
        return "" if e is None else f" +- {e.spread:.2f}"

    shown = "; ".join(
        f"{cond}: {missed if math.isinf(r) else f'x{r:.2f}{spread(cond)}'} (unscaled init logit std "
        f"{std[cond.split('/')[0]][_label('1', int(cond.split('/')[1]))]['raw']:.1f})"
        for cond, r in ratios.items()
    )
    for cond, r in extra.items():
        init, dk = cond.split("/")
        stalled = medians[init].get(_label("1", int(dk))) is None
        if r is None:
            outcome = f"the scaled model did not reach {TARGET:.0%} either"
        elif stalled:
            outcome = f"the unscaled one did not reach {TARGET:.0%} within the budget (x{r:.1f} or more)"
        else:
            outcome = f"x{r:.2f}"
        shown += f"; outside the rule, {cond}: {outcome}"
    long_run = measured.get("long_run") if not suffix else None
    if long_run:
        reached = sum(r["steps_to_90"] is not None for r in long_run["runs"])
        shown += (
            f"; long run ({long_run['label']}, {long_run['init']} init, {long_run['budget']} steps): "
            f"{reached}/{len(long_run['runs'])} seeds reached {TARGET:.0%}"
        )
    best_lr = measured.get("sgd_best_lr") if suffix else None
    if best_lr:
        shown += "; best lr without / with the scale: " + _unscaled(
            best_lr, lambda lr, by_label, dk: f"{lr:g} / {by_label.get(_label('sqrt', dk), math.nan):g}"
        )
    peaks = measured.get(f"peak_max_logit{suffix}")
    if peaks:
        shown += "; peak max logit without the scale: " + _unscaled(peaks, lambda v, *_: f"{statistics.median(v):.3g}")
    accuracy = measured.get(f"accuracy{suffix}")
    if accuracy:
        # a run can pass 90% and then diverge: the best and final accuracy tell a stall from a collapse
        shown += "; accuracy without the scale, best -> final (medians): " + _unscaled(
            accuracy,
            lambda runs, *_: f"{statistics.median(r['best'] for r in runs):.2f} -> {statistics.median(r['final'] for r in runs):.2f}",
        )
    shown += f"; +- is the slowdown's standard error over {seeds} seeds"
    estimates = {cond: _slowdown_estimate(measured, suffix, cond) for cond in ratios}
    over2 = {cond: _side(e, MUCH_SLOWER) for cond, e in estimates.items()}
    over125 = {cond: _side(e, SLOWER) for cond, e in estimates.items()}
    if all(x == Side.ABOVE for x in over2.values()):
        return Judgement(Verdict.HOLDS, f"without the scale learning is clearly >= {MUCH_SLOWER:g}x slower or stalls everywhere: {shown}")
    if all(x == Side.BELOW for x in over2.values()) and Side.BELOW in over125.values():
        return Judgement(
            Verdict.DOES_NOT_HOLD,
            f"no condition is {MUCH_SLOWER:g}x slower without the scale, and some are clearly within {SLOWER:g}x: {shown}",
        )
    if Side.BELOW in over2.values() and (Side.ABOVE in over2.values() or all(x == Side.ABOVE for x in over125.values())):
        return Judgement(
            Verdict.HOLDS_APPROXIMATELY,
            f"slower without the scale, but not {MUCH_SLOWER:g}x slower in every condition: {shown}",
        )
    return Judgement(
        Verdict.INCONCLUSIVE,
        f"a comparison the verdict turns on is within noise (against {MUCH_SLOWER:g}x or {SLOWER:g}x; {seeds} seeds): {shown}",
    )


def _side(value: Estimate | None, bound: float) -> Side:
    """A stall (None) is clearly slower than any bound."""
    return Side.ABOVE if value is None else side(value, bound)


def _slowdown_estimate(measured: dict, suffix: str, cond: str) -> Estimate | None:
    """The slowdown of one condition with its standard error over seeds; None for a stall (the
    unscaled median never reaches 90%). Runs that never reach it count at the step budget."""
    init, dk = cond.split("/")
    per_seed = measured[f"steps_to_90{suffix}_per_seed"][init]
    config = measured["config"]
    budget = measured["sgd"]["budget"] if suffix else config["steps"]
    unscaled, scaled = per_seed[_label("1", int(dk))], per_seed[_label("sqrt", int(dk))]
    if median_steps(unscaled) is None:
        return None
    resolution = quantisation(config["log_every"])
    counted = [estimate([budget if s is None else s for s in runs], resolution) for runs in (unscaled, scaled)]
    return ratio(*counted)


_COLORS = {"1": "tab:red", "sqrt": "tab:blue", "dk": "tab:green"}
_NAMES = {"1": "divisor 1", "sqrt": "divisor sqrt(d_k)", "dk": "divisor d_k"}


def plot(measured: dict, outdir: Path) -> list[str]:
    dks = measured["config"]["dks"]
    rows = [(f"AdamW, {init}", by_label) for init, by_label in measured["curves"].items()]
    rows += [(f"SGD, {init}", by_label) for init, by_label in measured.get("curves_sgd", {}).items()]
    names = []
    for metric, ylabel, name in (
        ("accuracy", "held-out accuracy", "training_stall_curves"),
        ("saturated", "share of rows with max prob > 0.99", "training_stall_saturation"),
        ("max_logit", "max attention logit", "training_stall_max_logit"),
    ):
        fig = Figure(figsize=(4.2 * len(dks), 3.0 * len(rows)), layout="constrained")
        axes = fig.subplots(len(rows), len(dks), squeeze=False)
        for r, (title, by_label) in enumerate(rows):
            for c, dk in enumerate(dks):
                ax = axes[r][c]
                here = {label: runs for label, runs in by_label.items() if int(label.split("/")[1]) == dk}
                if not here:
                    ax.set_visible(False)
                    continue
                for label, runs in here.items():
                    div = label.split("/")[0]
                    for i, curve in enumerate(runs):
                        ax.plot(curve["steps"], curve[metric], color=_COLORS[div], alpha=0.8, lw=1.2, label=_NAMES[div] if i == 0 else None)
                if metric == "max_logit":
                    ax.set_yscale("symlog", linthresh=1.0)  # SGD without the scale reaches logits of 1e5
                else:
                    ax.set_ylim(-0.03, 1.03)
                if metric == "accuracy":
                    ax.axhline(measured["target_accuracy"], color="grey", ls=":", lw=1)
                ax.set_title(f"{title} q/k init, d_k = {dk}", fontsize=9)
                ax.set_xlabel("step")
                ax.set_ylabel(ylabel, fontsize=9)
                ax.legend(fontsize=9, framealpha=0.8)
        names.append(save_figure(fig, outdir, name))
    return names


def captions(measured: dict) -> dict[str, str]:
    panels = "one panel per optimizer, q/k initialisation and d_k, every seed a line coloured by divisor"
    return {
        "training_stall_curves": (
            f"Held-out accuracy during training, {panels}. The dotted line is the target "
            f"({measured['target_accuracy']:.0%}); the verdict compares the steps each colour needs to cross it: "
            "a red curve that crosses far later than the blue one, or never, is the slowdown or stall of the claim."
        ),
        "training_stall_saturation": (
            f"The share of attention rows whose largest probability exceeds {SATURATED:g} during the same runs ({panels}): "
            "whether attention without the scale starts or ends saturated."
        ),
        "training_stall_max_logit": (
            f"The largest attention logit during the same runs ({panels}), on a symmetric log scale: how large the "
            "logits become without the scale compared with the scaled runs."
        ),
    }
