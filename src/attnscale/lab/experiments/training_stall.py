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

Profiles: ``quick`` keeps d_k = 64 and 128 but drops the divisor d_k, the small and large inits
and the long budget, with two seeds and early stop at 90% accuracy, so that it fits CI; ``full``
uses a larger task (24 pairs of 64 keys), d_model 64, batch 64 and eight seeds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from ..base import Claim, Judgement, Profile, Progress, Verdict, save_figure
from ..tasks import MQAR
from ..training import ModelConfig, RunLog, TrainConfig, median_steps, train

CLAIM = Claim(
    id="training-stall",
    statement=(
        "Without the 1/sqrt(d_k) scale a transformer learns attention much more slowly or stalls at "
        "realistic head dims (d_k = 64, 128); with the scale it learns."
    ),
    sources=("seeds/003", "seeds/002", "Vaswani et al. 2017, footnote 4"),
    method=(
        "One-layer pre-LN transformer with attnscale.MultiHeadAttention trained by AdamW on multi-query "
        "associative recall; divisor {1, sqrt(d_k), d_k} x d_k {64, 128} x q/k init {default nn.Linear, "
        "unit-variance components} x seeds; steps until held-out accuracy first reaches 90%, learning "
        "curves, max attention logit and share of saturated rows (max prob > 0.99); plus small q/k init "
        "without the scale, a large q/k init (component variance 16) at d_k = 128, and a long unscaled run."
    ),
    rule=(
        "Per (init, d_k) condition, init in {default, unit}, slowdown r = median steps-to-90% without the scale / with sqrt(d_k) "
        "(a run that never reaches 90% counts as infinitely slow). inconclusive if fewer than 2 seeds or "
        "the scaled model's median does not reach 90% in some condition; holds if r >= 2 in every "
        "condition; does-not-hold if no condition has r >= 2 and some condition has r < 1.25; "
        "holds-approximately otherwise (slower everywhere but not 2x everywhere, or 2x in some conditions only)."
    ),
)

HEADLINE = "slowdown.default/128"
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

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(
                dks=(64,), divisors=("1", "sqrt"), inits=("default",), small_init=False, large_init=False, seeds=2,
                context=4, queries=4, n_keys=8, n_values=8, steps=40, log_every=10, eval_batch=32, long_steps=60,
            )
        if profile == "quick":
            return cls(divisors=("1", "sqrt"), small_init=False, large_init=False, seeds=2, steps=400, stop_at=0.9, long_steps=0)
        if profile == "default":
            return cls()
        if profile == "full":
            return cls(seeds=8, context=24, n_keys=64, n_values=64, d_model=64, batch=64, steps=3000, long_steps=10000)
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


def run(config: Config, seed: int, progress: Progress) -> dict:
    task = MQAR(context=config.context, queries=config.queries, n_keys=config.n_keys, n_values=config.n_values)
    grid = _conditions(config)
    long_condition = _long_condition(config)
    total, done = len(grid) * config.seeds, 0
    steps: dict[str, dict[str, list[int | None]]] = {}
    curves: dict[str, dict[str, list[dict]]] = {}
    init_std: dict[str, dict[str, dict[str, float]]] = {}
    final_saturated: dict[str, dict[str, list[float]]] = {}
    for init, div, dk in grid:
        label = _label(div, dk)
        model_cfg = ModelConfig(d_model=config.d_model, head_dim=dk, divisor=div, qk_init_gain=INIT_GAINS[init])  # type: ignore[arg-type]
        long = (init, div, dk) == long_condition
        train_cfg = TrainConfig(
            steps=config.long_steps if long else config.steps,
            batch=config.batch,
            lr=config.lr,
            log_every=config.log_every,
            eval_batch=config.eval_batch,
            stop_at=TARGET if long else config.stop_at,  # whether the stall ends is all it must show
        )
        for i in range(config.seeds):
            _, log = train(task, model_cfg, train_cfg, seed + i)
            steps.setdefault(init, {}).setdefault(label, []).append(log.steps_to(TARGET))
            curves.setdefault(init, {}).setdefault(label, []).append(_curve(log))
            final_saturated.setdefault(init, {}).setdefault(label, []).append(log.saturated[-1])
            stds = init_std.setdefault(init, {}).setdefault(label, {"raw": 0.0, "scaled": 0.0})
            for k in ("raw", "scaled"):
                stds[k] += log.init_logit_std[k] / config.seeds
            done += 1
            progress(done, total)

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
    return {
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


def judge(measured: dict) -> Judgement:
    per_seed = measured["steps_to_90_per_seed"]
    medians = measured["steps_to_90_by_init"]
    seeds = min((len(v) for by_label in per_seed.values() for v in by_label.values()), default=0)
    if seeds < 2:
        return Judgement(Verdict.INCONCLUSIVE, f"only {seeds} seed(s) per condition; the rule needs at least 2")
    ratios: dict[str, float] = {}
    extra = {cond: r for cond, r in measured["slowdown"].items() if cond.split("/")[0] not in VERDICT_INITS}
    for cond, r in measured["slowdown"].items():
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
    shown = "; ".join(
        f"{cond}: {'stalls' if math.isinf(r) else f'x{r:.2f}'} (unscaled init logit std "
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
    long_run = measured.get("long_run")
    if long_run:
        reached = sum(r["steps_to_90"] is not None for r in long_run["runs"])
        shown += (
            f"; long run ({long_run['label']}, {long_run['init']} init, {long_run['budget']} steps): "
            f"{reached}/{len(long_run['runs'])} seeds reached {TARGET:.0%}"
        )
    much = [c for c, r in ratios.items() if r >= MUCH_SLOWER]
    if len(much) == len(ratios):
        return Judgement(Verdict.HOLDS, f"without the scale learning is >= {MUCH_SLOWER:g}x slower or stalls everywhere: {shown}")
    if not much and any(r < SLOWER for r in ratios.values()):
        return Judgement(
            Verdict.DOES_NOT_HOLD,
            f"no condition is {MUCH_SLOWER:g}x slower without the scale, and some are within {SLOWER:g}x: {shown}",
        )
    return Judgement(
        Verdict.HOLDS_APPROXIMATELY,
        f"slower without the scale, but not {MUCH_SLOWER:g}x slower in every condition: {shown}",
    )


_COLORS = {"1": "tab:red", "sqrt": "tab:blue", "dk": "tab:green"}
_NAMES = {"1": "divisor 1", "sqrt": "divisor sqrt(d_k)", "dk": "divisor d_k"}


def plot(measured: dict, outdir: Path) -> list[str]:
    curves = measured["curves"]
    dks = measured["config"]["dks"]
    inits = list(curves)
    names = []
    for metric, ylabel, name in (
        ("accuracy", "held-out accuracy", "training_stall_curves"),
        ("saturated", "share of rows with max prob > 0.99", "training_stall_saturation"),
        ("max_logit", "max attention logit", "training_stall_max_logit"),
    ):
        fig = Figure(figsize=(4.2 * len(dks), 3.0 * len(inits)), layout="constrained")
        axes = fig.subplots(len(inits), len(dks), squeeze=False)
        for r, init in enumerate(inits):
            for c, dk in enumerate(dks):
                ax = axes[r][c]
                here = {label: runs for label, runs in curves[init].items() if int(label.split("/")[1]) == dk}
                if not here:
                    ax.set_visible(False)
                    continue
                for label, runs in here.items():
                    div = label.split("/")[0]
                    for i, curve in enumerate(runs):
                        ax.plot(curve["steps"], curve[metric], color=_COLORS[div], alpha=0.8, lw=1.2, label=_NAMES[div] if i == 0 else None)
                if metric != "max_logit":
                    ax.set_ylim(-0.03, 1.03)
                if metric == "accuracy":
                    ax.axhline(measured["target_accuracy"], color="grey", ls=":", lw=1)
                ax.set_title(f"{init} q/k init, d_k = {dk}", fontsize=9)
                ax.set_xlabel("step")
                ax.set_ylabel(ylabel, fontsize=8)
                ax.legend(fontsize=7)
        names.append(save_figure(fig, outdir, name))
    return names
