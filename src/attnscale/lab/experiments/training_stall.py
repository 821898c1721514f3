"""training-stall: does attention without the scale learn much more slowly, or stall, at d_k = 64, 128?

The stall's phase diagram (:mod:`attnscale.lab.stall_phase`): a one-layer transformer
(attnscale's MultiHeadAttention) learns a task whose answer is reachable only through attention,
without the scale (divisor 1) and with it (divisor sqrt(d_k)), from the same initialisation and
the same data per seed, on a ladder of q/k init gains. A rung's x is the unscaled model's
measured init logit std, its y the slowdown: steps to 90% held-out accuracy without the scale
over with it, each seed's own ratio (paired), their median and standard error over seeds.

Rungs: the two realistic initialisations (``nn.Linear``'s default, gain 1: q and k components of
variance about 1/3 of the LayerNorm'd input's, so an init logit std near sqrt(d_k) / 3; and
unit-variance components, gain sqrt(3), the premise of the textbook argument), plus rungs whose
gain is calibrated to a target init logit std (``sigmas``: 1 and 27 at default, 1 to 54 in full).

Arms: AdamW (lr 1e-3) and SGD with momentum 0.9 without weight decay, on multi-query
associative recall (MQAR) and pointer copy (copy the value at the position a query names). Adam
divides each update by a running gradient scale, which largely cancels a gradient that is small
because softmax is saturated; SGD does not, so it is where the claim's vanishing-gradient
mechanism has the most room. Without the scale, for the same weights and the same gradient on
the logits, an SGD step moves the logits about d_k times further, so one shared learning rate
would compare an unscaled model that overshoots with a scaled one that does not: SGD's learning
rate is searched per rung and divisor on a ladder (factors of about 3) that never stops at an
untried edge, walking towards the rate whose seeds most often keep 90%, the fastest median among
those (:func:`attnscale.lab.stall_phase.best_lr`), and each seed counts its fastest run over the
rates tried (:func:`attnscale.lab.stall_phase.fastest_per_seed`): with one rate for all seeds,
the slowdown was the ratio of the two divisors' picks, and which of two neighbouring rates won
changed from one report seed to the next (v12's SGD recall rung at unit-variance q and k: x3.09
+- 0.17, x1.65 +- 0.07, x1.76 +- 0.03 at report seeds 0, 1, 2). A run counts as learned only if
it ends at or above 90% (an SGD run can pass 90% and then diverge; training stops at 90%, so
under AdamW this is the first step at 90%).

Seeds, from the spreads measured so far: the three v11 default runs (report seeds 0, 1, 2: 15
seeds per realistic rung, pooled) give each realistic rung's median slowdown m and seed standard
deviation s, and the rule concludes at a rung once Student's t times 1.25 s / sqrt(n) is under
|m - 2|. AdamW on MQAR: m 1.00 to 1.43, s 0.09 to 0.17, 3 seeds conclude, so 5 (as before) leave
the claim's verdict room. AdamW on pointer copy: the unit-variance rungs (m 3.06 and 3.43, s 1.58
and 2.26: a share of seeds stall, the rest learn at 1.2x to 3x) need 16 and 18 seeds, more than a
5-minute report affords, so that arm is expected to stay inconclusive at ``default``. SGD on MQAR:
both rungs need 9 seeds (s 0.96 and 1.05, both inflated by 3 of 15 scaled runs that missed 90% at
the fastest-median rate, which the per-seed count above avoids): 8 seeds. SGD on pointer copy: the
default init's rung sits near the bound (m 1.78, s 1.04: 135 seeds), expected inconclusive at
any affordable count. A report at seed ``s`` trains the model seeds ``1000 s + i``
(:func:`model_seeds`): reports at seeds 0, 1 and 2 share no model.

``default`` trains AdamW on MQAR alone: the SGD arms (v15) and AdamW on pointer copy (v16),
inconclusive at report seeds 0, 1 and 2 as expected above (SGD under v13 and v14, pointer copy
under v15), run in ``full``, and their time went to real-text-training's learning-rate sweep on
real text. ``quick`` keeps MQAR at d_k 64, AdamW, the realistic rungs and 6
seeds (CI's size: with 4, the unit init's 1.48x +- 0.16 was within noise of 2x at seed 0 and clear
of it at seeds 1 and 2, a verdict a seed's width from changing); ``full`` trains both optimizers at
d_k 16, 64, 128 and 256, AdamW on the rungs 1, 3, 9, 27 and 54, SGD on 1, 27 and 54, 8 seeds each.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from ..base import Arm, Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, no_progress, save_figure
from ..formatting import short_arm_name
from ..stall_phase import REALISTIC, Point, Rung, crossing, judge_ladder, measure_ladder, task_named
from ..training import ModelConfig, TrainConfig

CLAIM = Claim(
    id="training-stall",
    statement=(
        "Without the 1/sqrt(d_k) scale a transformer learns attention much more slowly or stalls at "
        "realistic head dims (d_k = 64, 128); with the scale it learns."
    ),
    sources=("Vaswani et al. 2017, sec. 3.2.1 and footnote 4",),
    method=(
        "The stall's phase diagram: a one-layer pre-LN transformer with attnscale.MultiHeadAttention, trained without "
        "the scale and with 1/sqrt(d_k) from the same initialisation and data per seed, on a ladder of q/k init gains "
        "whose x is the unscaled model's measured init logit std: the realistic inits (nn.Linear's default, and "
        "unit-variance q/k components) and gains calibrated to init logit stds of 1 and 27 (1 to 54 in full); "
        "d_k 64 and 128 (16 to 256 in full); a task whose answer needs attention, multi-query associative recall "
        "(and, in the full profile, pointer copy); AdamW (lr 1e-3) and, in the full profile, SGD with momentum 0.9 without weight decay, "
        "its learning rate searched per rung and divisor on a ladder from 0.003 to 3 (walking towards the rate whose seeds most often keep 90%, the "
        "fastest median among those; each seed counts its fastest run over the rates tried); 5 seeds per rung for AdamW, 8 for SGD; per rung the slowdown (steps to 90% held-out accuracy "
        "without the scale / with it, paired by seed), the share of unscaled runs that never reach 90% and the "
        "saturated share of attention rows at init."
    ),
    rule=(
        "Per arm (optimizer x task), each realistic rung (default and unit-variance init at each d_k): its slowdown "
        "is the median over seeds of each seed's steps-to-90% without the scale / with it (a run that never reaches "
        "90%, or ends below it, counts at the step budget; an unscaled median that never reaches it is a stall, "
        "clearly slower than any bound), with the median's standard error (1.25 s / sqrt(n), s at least a logging "
        "interval / sqrt(12) over the scaled median); it is clearly above 2 when r - t standard errors > 2, clearly "
        "below when r + t standard errors <= 2, t being Student's t 95% quantile for the seed count (2.78 for 5 seeds). "
        "An arm is inconclusive if fewer than 2 seeds ran, or the scaled model's median misses 90% at a realistic "
        "rung; holds if every realistic rung is clearly above 2; does-not-hold if every one is clearly below 2; "
        "holds-approximately if each is clearly on one side and both sides occur; inconclusive otherwise. The "
        "crossing of 2x over the whole ladder (the rungs clearly below and above it, log-log interpolated between "
        "the medians around it) and the init logit std from which every rung of one d_k stalls are stated, not judged. The claim's verdict: inconclusive if every arm is "
        "inconclusive; otherwise the least supportive conclusive arm's (does-not-hold < holds-approximately < "
        "holds), since the claim is stated for training in general."
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
        RuleVersion(
            11,
            "2026-12-04",
            "the stall's phase diagram: each condition's slowdown is paired by seed, on a ladder of q/k init gains "
            "from an init logit std of 1 to 27 (54 in full) with the realistic inits as rungs, on two tasks (MQAR and "
            "pointer copy) and for both optimizers, 5 seeds per rung at default (enough, by the spreads measured so "
            "far, to put every realistic init clearly on one side of 2x); each (optimizer, task) is judged by its "
            "realistic inits against 2x alone (the 1.25x band, the divisor d_k, the small and large inits and the "
            "long run go: the ladder spans them), and the crossing of 2x is stated; quick trains 6 seeds (with 4, "
            "its verdict changed with the seed); a report at seed s trains model seeds 1000 s + i, so that reports at "
            "different seeds share no model",
            "e7a148fa91fb8256",
        ),
        RuleVersion(
            12,
            "2026-12-05",
            "the same rule, written before its runs from a power calculation on v11's three default runs (15 seeds per "
            "realistic rung; results/training_stall_v11_seeds.json): SGD trains 8 seeds per rung at default (its recall "
            "rungs needed 9 at v11's spreads) and, per divisor, at the learning rate whose seeds most often keep 90%, "
            "the fastest median among those (v11 took the fastest median, a rate at which 3 of 15 scaled runs per recall "
            "rung missed 90% and counted as ratios of 0.2x to 0.8x); full trains SGD at every d_k (16 to 256) on the "
            "rungs 1, 27 and 54; the reason also states the init logit std from which every rung stalls. Expected from "
            "those spreads: AdamW on recall concludes (3 seeds suffice), AdamW on copy does not (16 to 18 seeds), nor SGD "
            "on copy (its default init sits at 1.78x: 135 seeds)",
            "9353127d2988b9bf",
        ),
        RuleVersion(
            13,
            "2026-12-05",
            "SGD: each seed counts its fastest run that keeps 90% over the learning rates its divisor's search tried, "
            "instead of all seeds at one rate. v12's three default runs (results/training_stall_v12_seeds.json) "
            "showed its slowdown set by the two picks, the unscaled model at 0.03 throughout and the scaled one at "
            "0.1 or 0.3 as the seeds fell: recall at unit-variance q and k x3.09 +- 0.17 (scaled at 0.3), x1.65 +- "
            "0.07 and x1.76 +- 0.03 (at 0.1) at report seeds 0, 1, 2, and at the default init x1.05 and x1.00 (0.1), "
            "x2.09 +- 0.06 (0.3): a seed's standard error conditional on one pick misses the pick's own uncertainty, "
            "and the arms' verdicts moved with the report seed. Per seed, that uncertainty enters the spread over "
            "seeds. Its power is unknown before this run (v12 kept only the picked rate's runs; every rate's runs are "
            "now recorded, by_lr); the SGD arms may well stay inconclusive. The rule is otherwise v12's",
            "82293c24fe2fa7b5",
        ),
        RuleVersion(
            14,
            "2026-12-05",
            "the stall stated in the reason is read per d_k: the smallest init logit std from which every rung of one "
            "d_k's ladder stalls, with that d_k. v13 read it over all rungs sorted by logit std, where rungs calibrated "
            "to one target differ by rounding across d_k: at full, AdamW on recall stated a stall from 54 on d_k 16's "
            "rung alone, which sorted above three rungs at 54 that learn. Verdicts and measurements are v13's",
            "129e739a464fb213",
        ),
        RuleVersion(
            15,
            "2026-12-06",
            "default trains AdamW only; SGD's learning-rate search (8 seeds on a ladder of up to 7 rates per rung and "
            "divisor, the larger share of training-stall's time at default) moves to full alone, which keeps it. "
            "Under v13 and v14 both SGD arms were inconclusive at report seeds 0, 1 and 2 (the default runs "
            "at 78c2ac4), so they never set the claim's verdict at default; the time goes to real-text-training's "
            "learning-rate sweep on real text (its v6), the lab's answer to how the scale interacts with the learning "
            "rate. The rule and the AdamW arms are v14's",
            "fc03ef0d87646d34",
        ),
        RuleVersion(
            16,
            "2026-12-06",
            "default trains AdamW on MQAR alone; pointer copy moves to full, which keeps it (as SGD did in v15). "
            "Under v15 its arm was inconclusive at report seeds 0, 1 and 2 (the default runs at cf2dd6c, "
            "results/training_stall_v15_default_seeds.json), as the seed count stated in the method expected (its "
            "unit-variance rungs need 16 and 18 seeds, default runs 5), so it never set the claim's verdict at "
            "default; it took the larger share of training-stall's time there, which the 5-minute budget needs "
            "for real-text-training's sweep. Written before any run of it. The rule and the MQAR arm are v15's",
            "c8f107505c7f7ebe",
        ),
    ),
)

HEADLINE = Headline(
    "headline.centre",
    "steps to 90% without the scale / with it (AdamW, MQAR, unit-variance init, d_k 128)",
    "x",
    spread="headline.spread",
)
MUCH_SLOWER = 2.0
HEADLINE_RUNG = ("adamw", "mqar", "unit", 128)
OPTIMIZERS = ("adamw", "sgd")
TASK_NAMES = {"mqar": "MQAR", "copy": "pointer copy"}


@dataclass(frozen=True)
class Config:
    tasks: tuple[str, ...] = ("mqar", "copy")
    dks: tuple[int, ...] = (64, 128)
    sigmas: tuple[float, ...] = (1.0, 27.0)
    seeds: int = 5
    context: int = 16
    queries: int = 8
    vocab: int = 32
    d_model: int = 32
    batch: int = 32
    lr: float = 1e-3
    steps: int = 1000
    log_every: int = 10
    eval_batch: int = 64
    sgd_tasks: tuple[str, ...] = ("mqar", "copy")
    sgd_dks: tuple[int, ...] = (64,)
    sgd_sigmas: tuple[float, ...] = ()
    sgd_lrs: tuple[float, ...] = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
    sgd_lr_start: float = 0.1
    sgd_momentum: float = 0.9
    sgd_steps: int = 400
    sgd_seeds: int = 8

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(
                tasks=("mqar",), dks=(64,), sigmas=(), seeds=2, context=4, queries=4, vocab=8, steps=40, eval_batch=32,
                sgd_tasks=("mqar",), sgd_steps=30, sgd_lrs=(0.1, 0.3, 1.0), sgd_seeds=2,
            )  # fmt: skip
        if profile == "quick":
            return cls(tasks=("mqar",), dks=(64,), sigmas=(), seeds=6, steps=400, sgd_tasks=())
        if profile == "default":
            return cls(tasks=("mqar",), sgd_tasks=())  # SGD at full only (v15), pointer copy too (v16)
        if profile == "full":
            return cls(
                dks=(16, 64, 128, 256), sigmas=(1.0, 3.0, 9.0, 27.0, 54.0), seeds=8, steps=1500,
                sgd_dks=(16, 64, 128, 256), sgd_sigmas=(1.0, 27.0, 54.0), sgd_seeds=8,
            )  # fmt: skip
        raise ValueError(f"profile must be one of tiny, quick, default, full; got {profile!r}.")


SEED_STRIDE = 1000


def model_seeds(seed: int, n: int) -> list[int]:
    """The model seeds a report at ``seed`` trains: ``SEED_STRIDE * seed + i`` for ``i < n``, so
    that reports at different seeds share no model (``seed + i`` would give seeds 0 and 1 four of
    five models in common)."""
    return [SEED_STRIDE * seed + i for i in range(n)]


def _ladders(config: Config) -> dict[str, tuple[str, str, int]]:
    """Every ladder, "optimizer task d_k" -> (optimizer, task, d_k): AdamW's, then SGD's."""
    out = {f"adamw {task} {dk}": ("adamw", task, dk) for task in config.tasks for dk in config.dks}
    if config.sgd_steps:
        out.update({f"sgd {task} {dk}": ("sgd", task, dk) for task in config.sgd_tasks for dk in config.sgd_dks})
    return out


def parts(config: Config) -> list[str]:
    """One part per ladder: independent runs of the same measurement, so a report trains them side by side."""
    return list(_ladders(config))


def run_part(config: Config, seed: int, part: str, progress: Progress) -> dict:
    """One ladder: ``{"points": [Point.as_dict(), ...]}``, the realistic rungs first."""
    optimizer, task_name, dk = _ladders(config)[part]
    task = task_named(task_name, context=config.context, queries=config.queries, vocab=config.vocab)
    sgd = optimizer == "sgd"
    train_cfg = TrainConfig(
        steps=config.sgd_steps if sgd else config.steps, batch=config.batch, lr=config.lr,
        weight_decay=0.0 if sgd else 0.01, log_every=config.log_every, eval_batch=config.eval_batch, stop_at=0.9,
        optimizer=optimizer, momentum=config.sgd_momentum,
    )  # fmt: skip
    rungs = [Rung(name) for name in REALISTIC] + [Rung(sigma=s) for s in (config.sgd_sigmas if sgd else config.sigmas)]
    points = measure_ladder(
        task, ModelConfig(d_model=config.d_model, head_dim=dk), train_cfg, rungs,
        model_seeds(seed, config.sgd_seeds if sgd else config.seeds), progress,
        lrs=config.sgd_lrs if sgd else (), lr_start=config.sgd_lr_start if sgd else None,
    )  # fmt: skip
    return {"points": [p.as_dict() for p in points]}


def run(config: Config, seed: int, progress: Progress) -> dict:
    names = parts(config)
    results = {}
    for i, name in enumerate(names):
        results[name] = run_part(config, seed, name, no_progress)
        progress(i + 1, len(names))
    return combine(config, seed, results)


def combine(config: Config, seed: int, results: dict[str, dict]) -> dict:
    """What ``run`` measures, from every part's ``run_part``: per arm ("optimizer task") every
    rung of every d_k, and where the arm's slowdown crosses 2x."""
    arms: dict[str, list[dict]] = {}
    for part, (optimizer, task, _) in _ladders(config).items():
        arms.setdefault(f"{optimizer} {task}", []).extend(results[part]["points"])
    crossings = {arm: crossing([Point.from_dict(d) for d in points], MUCH_SLOWER).as_dict() for arm, points in arms.items()}
    optimizer, task, name, dk = HEADLINE_RUNG
    rung = next((d for d in arms.get(f"{optimizer} {task}", []) if d["name"] == name and d["dk"] == dk), None)
    headline = None if rung is None or rung["slowdown"] is None else rung["slowdown"]
    return {
        "config": asdict(config),
        "target_accuracy": 0.9,
        "realistic": list(REALISTIC),
        "arms": arms,
        "crossings": crossings,
        "headline": headline,
    }


def _arm_name(measured: dict, arm: str) -> str:
    optimizer, task = arm.split()
    if optimizer == "adamw":
        return f"AdamW, {TASK_NAMES[task]}"
    c = measured["config"]
    lrs = f"{min(c['sgd_lrs']):g}..{max(c['sgd_lrs']):g}"
    return f"SGD (lr tuned per rung on {lrs}, momentum {c['sgd_momentum']:g}, {c['sgd_steps']} steps), {TASK_NAMES[task]}"


# How far each verdict supports the claim: where arms disagree, the claim (stated for training in
# general) gets the least supportive one, and every arm's verdict is reported beside it.
_SUPPORT = {Verdict.DOES_NOT_HOLD: 0, Verdict.HOLDS_APPROXIMATELY: 1, Verdict.HOLDS: 2}


def judge(measured: dict) -> Judgement:
    arms = []
    for arm, points in measured["arms"].items():
        j = judge_ladder([Point.from_dict(d) for d in points], MUCH_SLOWER)
        arms.append(Arm(_arm_name(measured, arm), j.verdict, j.reason))
    conclusive = [a for a in arms if a.verdict is not Verdict.INCONCLUSIVE]
    if not conclusive:
        return Judgement(Verdict.INCONCLUSIVE, "no arm gives a conclusive verdict", tuple(arms))
    least = min(conclusive, key=lambda a: _SUPPORT[a.verdict])
    each = "; ".join(f"{short_arm_name(a.name)}: {a.verdict.value}" for a in arms)
    if all(a.verdict is least.verdict for a in arms):
        return Judgement(least.verdict, f"every arm agrees ({each})", tuple(arms))
    return Judgement(
        least.verdict,
        f"the arms differ ({each}); the claim, stated for training in general, gets the least supportive conclusive "
        "verdict, and each arm's verdict stands on its own",
        tuple(arms),
    )


_DK_COLOURS = {16: "tab:green", 32: "tab:olive", 64: "tab:blue", 128: "tab:purple", 256: "tab:red"}
_MARKERS = {"default": "s", "unit": "D"}


def plot(measured: dict, outdir: Path) -> list[str]:
    """The phase diagram: slowdown against the unscaled init logit std, one panel per (task,
    optimizer), d_k as colour, the realistic inits as large outlined markers, stalls at the top."""
    arms = measured["arms"]
    tasks = list(dict.fromkeys(arm.split()[1] for arm in arms))
    optimizers = [o for o in OPTIMIZERS if any(arm.startswith(o + " ") for arm in arms)]
    fig = Figure(figsize=(4.4 * len(optimizers), 3.3 * len(tasks)), layout="constrained")
    axes = fig.subplots(len(tasks), len(optimizers), squeeze=False)
    finite = [p["slowdown"]["centre"] for points in arms.values() for p in points if p["slowdown"] is not None]
    top = max([MUCH_SLOWER * 2, *finite]) * 1.6
    x_top = max(p["logit_std"] for points in arms.values() for p in points) * 1.6
    for r, task in enumerate(tasks):
        for c, optimizer in enumerate(optimizers):
            ax = axes[r][c]
            points = arms.get(f"{optimizer} {task}")
            if not points:
                ax.set_visible(False)
                continue
            for dk in sorted({p["dk"] for p in points}):
                here = sorted((p for p in points if p["dk"] == dk), key=lambda p: p["logit_std"])
                colour = _DK_COLOURS.get(dk, "tab:gray")
                xs = [p["logit_std"] for p in here]
                ys = [top if p["slowdown"] is None else p["slowdown"]["centre"] for p in here]
                ax.plot(xs, ys, color=colour, lw=1.2, alpha=0.7, label=f"d_k = {dk}")
                for p, y in zip(here, ys, strict=True):
                    marker = "^" if p["slowdown"] is None else _MARKERS.get(p["name"], "o")
                    big = bool(p["name"])
                    ax.plot(p["logit_std"], y, marker=marker, ms=9 if big else 5, color=colour, mec="black" if big else colour, mew=1.4 if big else 0.5, ls="none")
                    if p["slowdown"] is not None:
                        ax.errorbar(p["logit_std"], y, yerr=p["slowdown"]["spread"], color=colour, lw=1, capsize=2)
                    if big:
                        ax.annotate(p["name"], (p["logit_std"], y), textcoords="offset points", xytext=(6, -12), fontsize=9)
            c = measured.get("crossings", {}).get(f"{optimizer} {task}") or {}
            if c.get("stall") is not None:
                ax.axvspan(c["stall"], x_top, color="tab:red", alpha=0.07, lw=0)
            if c.get("at") is not None:
                ax.axvline(c["at"], color="black", ls=":", lw=1)
                ax.text(c["at"] * 1.05, 0.55, f"2x at {c['at']:.3g}", fontsize=9, va="bottom")
            ax.axhline(MUCH_SLOWER, color="black", ls="--", lw=1)
            ax.axhline(1.0, color="grey", ls=":", lw=1)
            ax.axhline(top, color="grey", lw=0.6)
            ax.text(0.02, top * 1.04, "stall (never reaches 90%)", transform=ax.get_yaxis_transform(), va="bottom", fontsize=9)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(0.7, x_top)
            ax.set_ylim(0.5, top * 1.5)
            ticks = [t for t in (1, 3, 10, 30, 100) if t <= x_top]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_xticks([], minor=True)
            yticks = [t for t in (0.5, 1, 2, 5, 10, 20, 50) if t <= top]
            ax.set_yticks(yticks, [f"{t:g}x" for t in yticks])
            ax.set_yticks([], minor=True)
            ax.set_xlabel("unscaled model's init logit std", fontsize=9)
            ax.set_ylabel("steps to 90%: no scale / scale", fontsize=9)
            ax.set_title(f"{'AdamW' if optimizer == 'adamw' else 'SGD, lr tuned'}: {TASK_NAMES[task]}", fontsize=10)
            ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(0.0, 0.86), framealpha=0.8)
    return [save_figure(fig, outdir, "training_stall_phase")]


def captions(measured: dict) -> dict[str, str]:
    c = measured["config"]
    return {
        "training_stall_phase": (
            "The stall's phase diagram: how many times more steps the model needs to reach "
            f"{measured['target_accuracy']:.0%} held-out accuracy without the scale than with it (the median of each "
            f"seed's own ratio, bars its standard error over {c['seeds']} seeds; {c['sgd_seeds']} for SGD), against the "
            "unscaled model's logit std at initialisation, one panel per task and optimizer, d_k as colour. The "
            "outlined squares and diamonds are the realistic inits (nn.Linear's default and unit-variance q/k "
            "components); triangles on the top line are stalls. Above the dashed line a missing scale costs 2x or more; "
            "the dotted vertical line marks where the slowdown crosses 2x, the shaded band the init logit stds from "
            "which every rung of one d_k stalls."
        )
    }
