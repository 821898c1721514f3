"""The variance law: Var(q.k) = d_k for iid zero-mean unit-variance components.

Three cases are measured for each d_k:

* iid components, Gaussian, uniform on [-sqrt 3, sqrt 3] and Rademacher (+-1), all unit variance:
  the law's own premise;
* q and k from LayerNorm'd random inputs through default-initialised ``nn.Linear`` layers: what a
  freshly built attention layer sees (PyTorch's default init draws weights from
  U(-1/sqrt(fan_in), 1/sqrt(fan_in)), variance 1/(3 fan_in), so outputs have variance ~1/3, not 1);
* correlated q and k, ``k = rho q + sqrt(1 - rho^2) n``: the mean of q.k becomes ``rho d_k``, so
  the scaled score drifts like ``rho sqrt(d_k)`` even though its spread stays ~1.

Scores come from attnscale itself: with one key, the attention statistics' ``max_logit`` is
``scale * q.k`` exactly.

>>> m = run(Config.for_profile("tiny"), seed=0, progress=lambda done, total: None)
>>> sorted(m["var_over_dk"], key=int)
['2', '16', '128']
>>> judge(m).verdict.value
'holds'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnscale import scaled_dot_product_attention

from ..base import Claim, Headline, Judgement, Profile, Progress, RuleVersion, Verdict, save_figure

CLAIM = Claim(
    id="variance-law",
    statement="For q and k with iid zero-mean unit-variance components, Var(q.k) = d_k, so q.k / sqrt(d_k) has "
    "standard deviation ~1 whatever d_k is.",
    sources=("Vaswani et al. 2017, sec. 3.2.1 and footnote 4",),
    method="For d_k from 2 to 1024, many independent (q, k) pairs with iid Gaussian, uniform and Rademacher "
    "components of unit variance; q.k and q.k/sqrt(d_k) are the max_logit statistic of "
    "attnscale.scaled_dot_product_attention over a single key (scale 1 and the default scale). Var(q.k)/d_k is "
    "reported with its standard error (from the sample fourth moment). The same is measured for q, k computed "
    "from LayerNorm'd N(0, 1) inputs of width 512 by default-initialised nn.Linear layers (several inits pooled), "
    "and for correlated q, k (k = rho q + sqrt(1 - rho^2) n).",
    rule="Judged on the iid cases only, the law's premise. inconclusive with fewer than 1000 pairs per point, a "
    "non-finite value, or a standard error of Var(q.k)/d_k above 0.1; holds if every Var(q.k)/d_k is within 4 "
    "standard errors of 1; does-not-hold if any differs from 1 by more than 25% and by more than 4 standard "
    "errors; holds-approximately otherwise. The nn.Linear and correlated cases are reported as findings on when "
    "the premise holds in practice.",
    rule_history=(
        RuleVersion(1, "2026-11-29", "the rule as first committed", "a24a945fcb075f67"),
        RuleVersion(2, "2026-12-02", "the fingerprint now also covers the measurement (run, the lab code it calls, every profile's Config), so that a change to what is measured needs a new version; the rule is unchanged", "d62eeed6c962155f"),
    ),
)
HEADLINE = Headline("max_deviation_iid", "largest |Var(q.k) / d_k - 1| over d_k and iid distributions")

COMPONENTS = ("gaussian", "uniform", "rademacher")
MIN_SAMPLES = 1000
MAX_SE = 0.1
Z_LIMIT = 4.0
FAR = 0.25


@dataclass(frozen=True)
class Config:
    dks: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    samples: int = 50_000
    chunk: int = 8192
    d_model: int = 512
    linear_inits: int = 4
    rhos: tuple[float, ...] = (0.5, 0.9)

    @classmethod
    def for_profile(cls, profile: Profile) -> Config:
        if profile == "tiny":
            return cls(dks=(2, 16, 128), samples=2000, linear_inits=2)
        return cls(samples={"quick": 5000, "default": 50_000, "full": 400_000}[profile])


def _components(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    if kind == "gaussian":
        return torch.randn(shape, generator=gen)
    if kind == "uniform":
        return (torch.rand(shape, generator=gen) * 2 - 1) * math.sqrt(3.0)  # variance 1
    return torch.randint(0, 2, shape, generator=gen).float() * 2 - 1  # Rademacher


def _scores(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """q.k and q.k/sqrt(D) for (N, D) pairs, as attnscale's max_logit over one key."""
    n, D = q.shape
    q4, k4 = q.reshape(n, 1, 1, D), k.reshape(n, 1, 1, D)  # (N, H=1, L=1, D), (N, H=1, S=1, D)
    v = q4.new_zeros(n, 1, 1, 1)  # (N, H=1, S=1, Dv=1): only the statistics are used
    _, raw = scaled_dot_product_attention(q4, k4, v, scale=1.0, return_stats=True)
    _, scaled = scaled_dot_product_attention(q4, k4, v, return_stats=True)
    return raw.max_logit.flatten().double(), scaled.max_logit.flatten().double()


def _moments(raw: Tensor, scaled: Tensor, d_k: int) -> dict[str, float]:
    centred = raw - raw.mean()
    var = centred.square().mean().item()
    m4 = centred.pow(4).mean().item()
    return {
        "mean_over_dk": raw.mean().item() / d_k,
        "var_over_dk": var / d_k,
        "var_over_dk_se": math.sqrt(max(m4 - var * var, 0.0) / raw.numel()) / d_k,
        "scaled_std": scaled.std().item(),
        "scaled_rms": scaled.square().mean().sqrt().item(),
    }


def _iid(kind: str, d_k: int, gen: torch.Generator) -> Callable[[int], tuple[Tensor, Tensor]]:
    """``make(n)``: n independent (q, k) pairs, each (n, D), with iid components of the given kind."""
    return lambda n: (_components(kind, (n, d_k), gen), _components(kind, (n, d_k), gen))


def _pairs(config: Config, make: Callable[[int], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    raws, scaleds, done = [], [], 0
    while done < config.samples:
        n = min(config.chunk, config.samples - done)
        q, k = make(n)
        raw, scaled = _scores(q, k)
        raws.append(raw)
        scaleds.append(scaled)
        done += n
    return torch.cat(raws), torch.cat(scaleds)


def _linear_pairs(config: Config, d_k: int, seed: int, gen: torch.Generator) -> tuple[Tensor, Tensor, float]:
    """Scores of q = W_q LN(x), k = W_k LN(x') over several default inits; also q's mean square component."""
    per_init = -(-config.samples // config.linear_inits)
    raws, scaleds, mean_sq = [], [], 0.0
    norm = nn.LayerNorm(config.d_model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for init in range(config.linear_inits):
            torch.manual_seed(seed * 1_000_003 + d_k * 101 + init)  # default init reads the global generator
            w_q, w_k = nn.Linear(config.d_model, d_k), nn.Linear(config.d_model, d_k)
            q = w_q(norm(torch.randn(per_init, config.d_model, generator=gen)))  # (N, D)
            k = w_k(norm(torch.randn(per_init, config.d_model, generator=gen)))  # (N, D)
            raw, scaled = _scores(q, k)
            raws.append(raw)
            scaleds.append(scaled)
            mean_sq += q.double().square().mean().item() / config.linear_inits
    return torch.cat(raws), torch.cat(scaleds), mean_sq


def run(config: Config, seed: int, progress: Progress) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    total = len(config.dks) * (len(COMPONENTS) + 1 + len(config.rhos))
    step = 0
    iid: dict[str, dict[str, dict[str, float]]] = {c: {} for c in COMPONENTS}
    for kind in COMPONENTS:
        for d_k in config.dks:
            raw, scaled = _pairs(config, _iid(kind, d_k, gen))
            iid[kind][str(d_k)] = _moments(raw, scaled, d_k)
            step += 1
            progress(step, total)

    linear: dict[str, dict[str, float]] = {"q component mean square": {}, "var(q.k)/d_k": {}, "std of q.k/sqrt(d_k)": {}}
    for d_k in config.dks:
        raw, scaled, mean_sq = _linear_pairs(config, d_k, seed, gen)
        stats = _moments(raw, scaled, d_k)
        linear["q component mean square"][str(d_k)] = mean_sq
        linear["var(q.k)/d_k"][str(d_k)] = stats["var_over_dk"]
        linear["std of q.k/sqrt(d_k)"][str(d_k)] = stats["scaled_std"]
        step += 1
        progress(step, total)

    correlated: dict[str, dict[str, dict[str, float]]] = {}
    for rho in config.rhos:
        rows: dict[str, dict[str, float]] = {
            "mean(q.k)/d_k": {}, "var(q.k)/d_k": {}, "std of q.k/sqrt(d_k)": {}, "rms of q.k/sqrt(d_k)": {}
        }
        for d_k in config.dks:

            def make(n: int, d_k: int = d_k, rho: float = rho) -> tuple[Tensor, Tensor]:
                q = torch.randn(n, d_k, generator=gen)
                return q, rho * q + math.sqrt(1 - rho * rho) * torch.randn(n, d_k, generator=gen)

            stats = _moments(*_pairs(config, make), d_k)
            for row, key in zip(rows, ("mean_over_dk", "var_over_dk", "scaled_std", "scaled_rms"), strict=True):
                rows[row][str(d_k)] = stats[key]
            step += 1
            progress(step, total)
        correlated[f"rho={rho:g}"] = rows

    names = next(iter(iid["gaussian"].values()))  # the statistics computed for every (component, d_k)
    grid = {name: {kind: {d: iid[kind][d][name] for d in iid[kind]} for kind in COMPONENTS} for name in names}
    deviation = max(abs(v - 1.0) for kind in COMPONENTS for v in grid["var_over_dk"][kind].values())
    return {
        "samples": config.samples,
        "dks": list(config.dks),
        "max_deviation_iid": deviation,
        "var_over_dk": dict(grid["var_over_dk"]["gaussian"]),
        "var_over_dk_by_component": grid["var_over_dk"],
        "var_over_dk_se": grid["var_over_dk_se"],
        "scaled_std": grid["scaled_std"],
        "linear_d_model": config.d_model,
        "linear_inits": config.linear_inits,
        "linear_layer": linear,
        "correlated": correlated,
    }


def judge(measured: dict[str, Any]) -> Judgement:
    ratios, errors = measured["var_over_dk_by_component"], measured["var_over_dk_se"]
    points = [(kind, d, ratios[kind][d], errors[kind][d]) for kind in ratios for d in ratios[kind]]
    bad = [p for p in points if not (math.isfinite(p[2]) and math.isfinite(p[3]))]
    if measured["samples"] < MIN_SAMPLES or not points or bad or max(p[3] for p in points) > MAX_SE:
        return Judgement(
            Verdict.INCONCLUSIVE,
            f"{measured['samples']} pairs per point (needs >= {MIN_SAMPLES}), {len(bad)} non-finite values, or a "
            f"standard error above {MAX_SE}: too noisy to judge",
        )
    worst = max(points, key=lambda p: abs(p[2] - 1) / max(p[3], 1e-12))
    z = abs(worst[2] - 1) / max(worst[3], 1e-12)
    shown = (
        f"Var(q.k)/d_k over {len(points)} (component, d_k) points: most extreme {worst[2]:.4g} "
        f"({worst[0]}, d_k = {worst[1]}, {z:.1f} standard errors from 1)"
    )
    notes = _findings(measured)
    if all(abs(r - 1) <= Z_LIMIT * se for _, _, r, se in points):
        return Judgement(Verdict.HOLDS, f"{shown}; every point is within {Z_LIMIT:g} standard errors of 1. {notes}")
    far = [p for p in points if abs(p[2] - 1) > FAR and abs(p[2] - 1) > Z_LIMIT * p[3]]
    if far:
        return Judgement(Verdict.DOES_NOT_HOLD, f"{shown}; {len(far)} points differ from 1 by more than {FAR:.0%}. {notes}")
    return Judgement(
        Verdict.HOLDS_APPROXIMATELY,
        f"{shown}; some points differ from 1 beyond sampling error, none by more than {FAR:.0%}. {notes}",
    )


def _findings(measured: dict[str, Any]) -> str:
    notes = []
    linear = measured.get("linear_layer")
    if linear:
        std = list(linear["std of q.k/sqrt(d_k)"].values())
        sq = list(linear["q component mean square"].values())
        notes.append(
            f"With LayerNorm then default nn.Linear, q's components have mean square {min(sq):.3g}-{max(sq):.3g} "
            f"(not 1), so the scaled score's std is {min(std):.3g}-{max(std):.3g}, not 1."
        )
    for name, rows in (measured.get("correlated") or {}).items():
        rms = rows["rms of q.k/sqrt(d_k)"]
        d_max = max(rms, key=int)
        notes.append(
            f"Correlated q, k ({name}): mean(q.k)/d_k = {rows['mean(q.k)/d_k'][d_max]:.3g} and the scaled score's "
            f"rms grows to {rms[d_max]:.3g} at d_k = {d_max} while its std stays {rows['std of q.k/sqrt(d_k)'][d_max]:.3g}."
        )
    return " ".join(notes)


def plot(measured: dict[str, Any], outdir: Path) -> list[str]:
    from matplotlib.figure import Figure

    dks = measured["dks"]
    keys = [str(d) for d in dks]

    def variance(ratio_by_dk: dict[str, float]) -> list[float]:
        return [ratio_by_dk[k] * d for k, d in zip(keys, dks, strict=True)]

    def series(by_dk: dict[str, float]) -> list[float]:
        return [by_dk[k] for k in keys]

    fig = Figure(figsize=(10, 5.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(dks, dks, color="black", lw=1, label="Var = d_k")
    right.axhline(1.0, color="black", lw=1)
    for kind, marker in zip(COMPONENTS, ("o", "s", "^"), strict=True):
        style = {"marker": marker, "ls": "none", "ms": 5, "mfc": "none", "label": f"iid {kind}"}
        left.plot(dks, variance(measured["var_over_dk_by_component"][kind]), **style)
        right.plot(dks, series(measured["scaled_std"][kind]), **style)
    linear = measured["linear_layer"]
    label = f"LayerNorm + default nn.Linear (d_model {measured['linear_d_model']})"
    left.plot(dks, variance(linear["var(q.k)/d_k"]), "D-", ms=4, label=label)
    right.plot(dks, series(linear["std of q.k/sqrt(d_k)"]), "D-", ms=4, label=label)
    for name, rows in measured["correlated"].items():
        left.plot(dks, variance(rows["var(q.k)/d_k"]), "--", label=f"correlated {name}")
        right.plot(dks, series(rows["rms of q.k/sqrt(d_k)"]), "--", label=f"correlated {name}: rms")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("d_k")
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.15))  # below: inside, it hides the points
    left.set_ylabel("Var(q.k)")
    left.set_title("variance of the unscaled score")
    right.set_ylabel("std (or rms) of q.k / sqrt(d_k)")
    right.set_title("size of the scaled score")
    return [save_figure(fig, outdir, "variance_vs_dk")]


def captions(measured: dict[str, Any]) -> dict[str, str]:
    return {
        "variance_vs_dk": (
            "Left: the variance of the unscaled score q.k against d_k (log axes); the iid points should sit on the "
            "black line Var = d_k, and the LayerNorm + nn.Linear (d_model "
            f"{measured['linear_d_model']}) and correlated cases show how far real projections depart from the "
            "premise. Right: the same scores divided by sqrt(d_k): for iid components they should stay on the black line at "
            "every d_k, which is what the scale is for."
        )
    }
