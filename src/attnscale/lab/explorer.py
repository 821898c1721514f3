"""The explorer: one offline HTML page that moves d_k and the divisor and shows what softmax does.

The page (``explore.html``, beside this module) computes everything in the browser, and
:func:`measure` computes the same numbers in Python for the same :class:`State`, with the same
seeded draws: the page's tests compare the two. ``write_explorer`` copies the page into a
folder (the report writes it beside ``index.html``); :func:`explorer_link` gives the view of
the page that shows a claim.

The draws. One stream of uint32 words from mulberry32 seeded with ``State.seed`` (word ``i`` is
mulberry32's ``i``-th output, see :func:`mulberry32`); uniforms are ``word / 2**32``; normals
``2m`` and ``2m + 1`` are Box-Muller's pair on uniforms ``2m`` and ``2m + 1`` (see :func:`normals`).
With ``qk = "linear"`` the weights come first, from uniforms: ``W_q`` (D, M) row-major, ``b_q``
(D), ``W_k``, ``b_k``, each ``(2u - 1) / sqrt(M)`` (``nn.Linear``'s default init, M = 512 inputs);
the normals start after them. Each draw then takes, in order: the query's source (D normals, M
for ``linear``), the S keys' sources (S x D, or S x M), the values (S, D) and the upstream
gradient (D). The sources become q and k by:

==============  =============================================================================
``iid``         as drawn: iid N(0, 1) components
``linear``      ``W LayerNorm(x) + b`` (LayerNorm without gain, eps 1e-5) with x ~ N(0, I_M)
``correlated``  q as drawn, ``k_j = rho q + sqrt(1 - rho^2) n_j`` (n_j the key's draw)
``l2``          unit length: ``x / max(|x|, 1e-6)`` (attnscale.variants.normalize_qk)
``rms``         norm sqrt(D): ``x / sqrt(mean(x^2) + 1e-6)`` (attnscale.variants.normalize_qk)
==============  =============================================================================

Per draw: scores ``s_j = q.k_j / divisor`` over the S keys, weights ``p = softmax(s)``, output
``o = sum_j p_j v_j``, loss ``upstream . o``; gradients are those of that loss, into the q and k
that enter the scores (after any normalisation).

>>> state = State.from_query("dk=128&divisor=1&keys=64&draws=20")
>>> state.to_query()
'dk=128&divisor=1&keys=64&draws=20'
>>> m = measure(state)
>>> m.max_prob_median > 0.5 > measure(State(dk=128, divisor="sqrt-dk", keys=64, draws=20)).max_prob_median
True
>>> explorer_link("saturation-example")
'explore.html?dk=128&divisor=1&keys=64'
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Literal, get_args
from urllib.parse import parse_qsl

import numpy as np

from .._validate import fail

__all__ = [
    "Divisor",
    "Measures",
    "QKDraw",
    "State",
    "explorer_link",
    "measure",
    "mulberry32",
    "normals",
    "page_html",
    "write_explorer",
]

Divisor = Literal["1", "sqrt-dk", "dk", "sqrt-dmodel", "free"]
"""What q.k is divided by: 1, sqrt(d_k), d_k, sqrt(d_model) with d_model = d_k * heads, or ``temp``."""
QKDraw = Literal["iid", "linear", "correlated", "l2", "rms"]
"""How q and k are drawn (see the module docstring)."""

PAGE = "explore.html"
LINEAR_INPUTS = 512
"""M, the input width of the ``linear`` draw, as in the variance-law experiment."""
FP16_MAX = 65504.0
"""Largest finite float16: an fp16 q @ k^T holding a larger |q.k| overflows."""
NAIVE_EXP_FP16 = math.log(FP16_MAX)
"""exp(x) overflows fp16 above x = log(65504) ~= 11.09 when softmax does not subtract the row max."""
VANISH = 1e-3
"""The fp16-secondary threshold: the off-peak gradient has vanished below this share of its value at logit std 1."""
SIGMA_GRID = tuple(10.0 ** (i / 10) for i in range(-10, 51))
"""Logit stds 0.1 .. 1e5, ten per decade, 1 included: where the off-peak gradient is traced."""

_LIMITS = {"dk": (1, 1024), "keys": (2, 512), "heads": (1, 128), "draws": (1, 2000), "seed": (0, 2**32 - 1)}
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_EPS_QK = 1e-6
_EPS_LN = 1e-5


@dataclass(frozen=True)
class State:
    """One view of the page, as its URL query holds it (see :meth:`to_query`); fields default as below."""

    dk: int = 128
    divisor: Divisor = "sqrt-dk"
    heads: int = 8
    temp: float = 1.0
    keys: int = 64
    qk: QKDraw = "iid"
    rho: float = 0.5
    seed: int = 0
    draws: int = 200

    def __post_init__(self) -> None:
        for name, (lo, hi) in _LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                fail(name, f"an integer in [{lo}, {hi}]", _shown(value), f"pass e.g. {name}={getattr(State, name)}")
        if self.divisor not in get_args(Divisor):
            fail("divisor", f"one of {', '.join(get_args(Divisor))}", repr(self.divisor), "pass e.g. divisor=sqrt-dk")
        if self.qk not in get_args(QKDraw):
            fail("qk", f"one of {', '.join(get_args(QKDraw))}", repr(self.qk), "pass e.g. qk=iid")
        if not (_is_real(self.temp) and math.isfinite(self.temp) and self.temp > 0):
            fail("temp", "a finite number > 0", _shown(self.temp), "pass e.g. temp=11.3")
        if not (_is_real(self.rho) and -1.0 <= self.rho <= 1.0):
            fail("rho", "a number in [-1, 1]", _shown(self.rho), "pass e.g. rho=0.5")

    @classmethod
    def from_query(cls, query: str) -> State:
        """Parse a URL query (``"dk=128&divisor=1"``, a leading ``?`` allowed); absent fields keep their defaults.

        Numbers are decimal (``2``, ``0.5``, ``1e3``); an integer field takes any integral one.
        The page parses and checks its URL the same way, with the same messages.
        """
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, object] = {}
        for name, text in parse_qsl(query.removeprefix("?"), keep_blank_values=True):
            if name not in kinds:
                fail("query", f"parameters among {', '.join(kinds)}", repr(name), "remove it or fix its spelling")
            kind = kinds[name]
            if kind not in ("int", "float"):
                values[name] = text
                continue
            if not _DECIMAL.fullmatch(text):
                fail(name, f"a number ({kind})", repr(text), f"pass e.g. {name}={_shown(getattr(cls, name))}")
            number = float(text)
            values[name] = int(number) if kind == "int" and number.is_integer() else number
        return cls(**values)  # type: ignore[arg-type]

    def to_query(self) -> str:
        """The URL query of this view, in field order: dk, divisor and keys always, the parameter the
        divisor or draw reads (heads, temp, rho), and any other field that differs from its default."""
        default = State()
        shown = {"dk", "divisor", "keys"}
        shown |= {"heads"} if self.divisor == "sqrt-dmodel" else set()
        shown |= {"temp"} if self.divisor == "free" else set()
        shown |= {"rho"} if self.qk == "correlated" else set()
        return "&".join(
            f"{k}={_text(v)}" for k, v in asdict(self).items() if k in shown or v != getattr(default, k)
        )

    @property
    def divisor_value(self) -> float:
        """The number q.k is divided by."""
        return {
            "1": 1.0,
            "sqrt-dk": math.sqrt(self.dk),
            "dk": float(self.dk),
            "sqrt-dmodel": math.sqrt(self.dk * self.heads),
            "free": self.temp,
        }[self.divisor]


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(value: object) -> str:
    """A received value in an error message: numbers as the URL writes them, anything else as repr."""
    return _text(value) if _is_real(value) else repr(value)


def _text(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def mulberry32(seed: int, start: int, count: int) -> np.ndarray:
    """Words ``start .. start + count - 1`` (uint32) of mulberry32 seeded with ``seed``.

    mulberry32 adds 0x6D2B79F5 to its state before each output, so word ``i`` mixes
    ``seed + (i + 1) * 0x6D2B79F5 (mod 2**32)``: any stretch is computed without the ones before.

    >>> [int(w) for w in mulberry32(1, 0, 3)]
    [2693262067, 11749833, 2265367787]
    """
    u32 = np.uint32
    t = np.arange(count, dtype=u32)  # uint32 arithmetic wraps modulo 2**32, as the page's Math.imul does
    t += u32((start + 1) & 0xFFFFFFFF)
    t *= u32(0x6D2B79F5)
    t += u32(seed)
    t = (t ^ (t >> u32(15))) * (t | u32(1))
    t ^= t + (t ^ (t >> u32(7))) * (t | u32(61))
    t ^= t >> u32(14)
    return t


def uniforms(seed: int, start: int, count: int) -> np.ndarray:
    """Uniforms in [0, 1): words ``start ..`` divided by 2**32 (float64)."""
    return mulberry32(seed, start, count) / 2.0**32


def normals(seed: int, start: int, count: int) -> np.ndarray:
    """Normals ``start ..`` of the stream that begins at word 0, by Box-Muller on pairs of words.

    Pair ``m`` (words 2m, 2m + 1, uniforms u0, u1) gives normal 2m = r cos(theta) and normal
    2m + 1 = r sin(theta), with r = sqrt(-2 log(1 - u0)) and theta = 2 pi u1.
    """
    first, last = start // 2, (start + count - 1) // 2
    u = uniforms(seed, 2 * first, 2 * (last - first + 1)).reshape(-1, 2)
    r, theta = np.sqrt(-2.0 * np.log(1.0 - u[:, 0])), 2.0 * math.pi * u[:, 1]
    pairs = np.stack([r * np.cos(theta), r * np.sin(theta)], axis=-1).reshape(-1)  # normals 2 first .. 2 last + 1
    return pairs[start - 2 * first : start - 2 * first + count]


@dataclass(frozen=True)
class Measures:
    """The numbers the page shows for a :class:`State` (all float64; "draws" are the state's draws).

    ``weights`` and ``jacobian`` are those of the first draw's query; ``*_first`` the first
    draw's value of a per-draw quantity; means and medians run over the draws.
    """

    divisor: float
    score_mean: float
    """Mean of the scores q.k / divisor over all draws and keys (logits)."""
    score_std: float
    """std of the scores q.k / divisor over all draws and keys (population std, logits)."""
    law_std: float
    """What the variance law predicts for it: sqrt(d_k) / divisor."""
    var_over_dk: float
    """Var(q.k) / d_k over all draws and keys (population variance), as the variance-law experiment."""
    weights: tuple[float, ...]
    max_prob_first: float
    max_prob_median: float
    """Median over draws of the largest weight (linear interpolation between order statistics)."""
    max_prob_mean: float
    entropy_ratio: float
    """Mean over draws of the entropy (nats) divided by log(keys)."""
    jacobian_max: float
    """Largest |J_ij| of the first draw's Jacobian: the heatmap's full colour."""
    offpeak_first: float
    offpeak_mean: float
    """Mean over draws of the off-peak Jacobian mass: sum |J_ij| over i, j both off the argmax."""
    offpeak_uniform: float
    """The off-peak mass of uniform weights, (S - 1)(2S - 3)/S^2: the largest it gets."""
    grad_q: float
    """Mean over draws of |d loss / d q| (the q entering the scores)."""
    grad_k: float
    """Mean over draws of the Frobenius norm of d loss / d k over the S keys."""
    offpeak_grad_rel: float | None
    """Median off-peak logit gradient now, over its median at the same logits rescaled to std 1
    (None when all scores are equal)."""
    vanish_std: float | None
    """Logit std at which that ratio falls below 1e-3 (None: not on 0.1 .. 1e5, or all scores equal), as fp16-secondary."""
    max_abs_qk: float
    """Largest |q.k| (before the divisor) over all draws and keys."""
    fp16_overflow_std: float | None
    """Score std at which q and k, grown by a common factor, make an fp16 q @ k^T overflow (None when all scores are equal)."""
    max_score: float
    """Largest score q.k / divisor (a softmax without max subtraction overflows fp16 above 11.09)."""


def _draw_q_k(state: State, start: int, weights: tuple[np.ndarray, ...] | None) -> tuple:
    """The state's draws, from normal ``start`` on: q (n, D), k (n, S, D), v (n, S, D), upstream (n, D)."""
    import torch
    import torch.nn.functional as F

    from ..variants import normalize_qk

    D, S, n = state.dk, state.keys, state.draws
    width = LINEAR_INPUTS if state.qk == "linear" else D
    block = width * (S + 1) + S * D + D
    z = normals(state.seed, start, n * block).reshape(n, block)
    q = z[:, :width]
    k = z[:, width : width * (S + 1)].reshape(n, S, width)
    v = z[:, width * (S + 1) : width * (S + 1) + S * D].reshape(n, S, D)
    up = z[:, width * (S + 1) + S * D :]
    if state.qk == "linear":
        assert weights is not None
        w_q, b_q, w_k, b_k = (torch.from_numpy(w) for w in weights)
        ln = [F.layer_norm(torch.from_numpy(x), (width,), eps=_EPS_LN) for x in (q, k)]
        q, k = (ln[0] @ w_q.T + b_q).numpy(), (ln[1] @ w_k.T + b_k).numpy()
    elif state.qk == "correlated":
        k = state.rho * q[:, None, :] + math.sqrt(1.0 - state.rho**2) * k
    elif state.qk in ("l2", "rms"):
        qt, kt = normalize_qk(torch.from_numpy(q)[:, None, None], torch.from_numpy(k)[:, None], kind=state.qk, eps=_EPS_QK)
        q, k = qt.reshape(n, D).numpy(), kt.reshape(n, S, D).numpy()  # from (n, 1, 1, D) and (n, 1, S, D)
    return q, k, v, up


def _linear_weights(state: State) -> tuple[np.ndarray, ...]:
    D, M = state.dk, LINEAR_INPUTS
    u = uniforms(state.seed, 0, 2 * (D * M + D))
    w = (2.0 * u - 1.0) / math.sqrt(M)
    w_q, b_q = w[: D * M].reshape(D, M), w[D * M : D * M + D]
    rest = w[D * M + D :]
    return w_q, b_q, rest[: D * M].reshape(D, M), rest[D * M :]


def _offpeak_logit_grad(s: np.ndarray, dp: np.ndarray) -> np.ndarray:
    """Per draw: norm of d loss / d s over every key but the argmax, for scores s (n, S), d loss / d p = dp."""
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    np.put_along_axis(ds, s.argmax(-1)[:, None], 0.0, axis=-1)
    return np.sqrt((ds * ds).sum(-1))


def measure(state: State) -> Measures:
    """The page's numbers for ``state``, through attnscale: its attention, statistics and autograd.

    Holds every draw at once (about 24 * draws * keys * dk bytes): meant for the sizes a test or a
    notebook checks, while the page itself streams its draws.
    """
    import torch

    from attnscale import scaled_dot_product_attention

    from .experiments.fp16_secondary import crossing
    from .experiments.jacobian_collapse import jacobian_metrics, softmax_jacobian, uniform_metrics

    D, S, n = state.dk, state.keys, state.draws
    weights = _linear_weights(state) if state.qk == "linear" else None
    start = D * LINEAR_INPUTS + D if weights is not None else 0  # the first normal after the weights' 2 (DM + D) words
    q, k, v, up = (torch.from_numpy(a) for a in _draw_q_k(state, start, weights))
    scale = 1.0 / state.divisor_value
    q4 = q.reshape(n, 1, 1, D).requires_grad_(True)  # (B = draws, H = 1, L = 1, D)
    k4 = k.reshape(n, 1, S, D).requires_grad_(True)  # (B, Hkv = 1, S, D)
    out, stats = scaled_dot_product_attention(q4, k4, v.reshape(n, 1, S, D), scale=scale, return_stats=True)
    (out.reshape(n, D) * up).sum().backward()
    eye = torch.eye(S, dtype=torch.float64).expand(n, 1, S, S)  # values = one-hot keys: the output is p
    p = scaled_dot_product_attention(q4.detach(), k4.detach(), eye, scale=scale).reshape(n, S)

    raw = (q.reshape(n, 1, D) * k).sum(-1).numpy()  # (n, S): q.k
    s = raw * scale
    offpeak = jacobian_metrics(p)["offpeak_mass"]
    max_prob = stats.max_prob.reshape(n).double()
    dp = torch.einsum("nd,nsd->ns", up, v).numpy()  # d loss / d p_j = upstream . v_j
    score_std = float(s.std())
    relative = vanish = None  # stay None when every score is equal: no shape to rescale to std 1
    if score_std > 0:
        curve = [float(np.median(_offpeak_logit_grad(sigma * s / score_std, dp))) for sigma in SIGMA_GRID]
        unit = curve[SIGMA_GRID.index(1.0)]
        if unit > 0:
            relative = float(np.median(_offpeak_logit_grad(s, dp))) / unit
            vanish = crossing(list(SIGMA_GRID), [c / unit for c in curve], VANISH)
    max_abs = float(np.abs(raw).max())
    return Measures(
        divisor=state.divisor_value,
        score_mean=float(s.mean()),
        score_std=score_std,
        law_std=math.sqrt(D) * scale,
        var_over_dk=float(raw.var()) / D,
        weights=tuple(p[0].tolist()),
        max_prob_first=float(max_prob[0]),
        max_prob_median=float(torch.quantile(max_prob, 0.5)),
        max_prob_mean=float(max_prob.mean()),
        entropy_ratio=float(stats.entropy.mean()) / math.log(S),
        jacobian_max=float(softmax_jacobian(p[0]).abs().max()),
        offpeak_first=float(offpeak[0]),
        offpeak_mean=float(offpeak.mean()),
        offpeak_uniform=uniform_metrics(S)["offpeak_mass"],
        grad_q=float(q4.grad.reshape(n, D).norm(dim=-1).mean()),
        grad_k=float(k4.grad.reshape(n, S * D).norm(dim=-1).mean()),
        offpeak_grad_rel=relative,
        vanish_std=vanish,
        max_abs_qk=max_abs,
        fp16_overflow_std=score_std * FP16_MAX / max_abs if score_std > 0 else None,
        max_score=float(s.max()),
    )


_CLAIM_VIEWS: dict[str, State] = {
    "variance-law": State(dk=512),
    "divisor-table": State(divisor="sqrt-dmodel"),
    "saturation-example": State(divisor="1"),
    "softmax-peak-example": State(dk=128, divisor="1", keys=4),
    "jacobian-collapse": State(divisor="1", keys=16),
    "fp16-secondary": State(divisor="1"),
    "qknorm-double-shrink": State(qk="l2"),
    "small-dk": State(dk=4, divisor="1"),
    "mup-correlated": State(dk=512, qk="correlated", rho=0.5),
    "length-scaling": State(keys=512),
    "hard-routing": State(divisor="free", temp=2.0),
}


def explorer_link(claim_id: str) -> str | None:
    """The explorer view, as a URL relative to the report folder, that shows ``claim_id``; None if none does."""
    state = _CLAIM_VIEWS.get(claim_id)
    if state is None:
        return None
    query = state.to_query()
    return f"{PAGE}?{query}" if query else PAGE


def page_html() -> str:
    """The explorer page's HTML: self-contained (inline script and style, nothing fetched)."""
    return resources.files(__package__).joinpath(PAGE).read_text(encoding="utf-8")


def write_explorer(out_dir: Path | str, *, filename: str = PAGE) -> Path:
    """Write the explorer page into ``out_dir`` (created if missing) as ``filename``; return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    with resources.as_file(resources.files(__package__).joinpath(PAGE)) as source:
        shutil.copyfile(source, path)
    return path
