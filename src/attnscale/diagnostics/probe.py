"""Find the logit scale an attention implementation really uses, from the outside.

Softmax weights satisfy ``log p_ij = s * (q_i . k_j) + c_i`` for every visible key j of row i, where
``s`` is the effective scale and ``c_i`` a per-row constant (minus the log-sum-exp). So ``s`` is the
slope of ``log p`` against ``q . k`` within rows: :func:`fit_logit_scale` fits it per head by least
squares on row-centred values and reports how well a single slope explains the weights (R^2). A
position bias (ALiBi, T5's relative bias) or a soft-cap in its non-linear range lowers R^2, which
is why the fit is reported with it.

:func:`probe_module` does the same for a multi-head attention *module*: on a float64 copy (the
module itself is never touched), it sets the query/key projections to known random matrices, so
every head's q.k is known, and the value/output projections to matrices it can invert, so the
output reveals every head's weights.

:func:`probe_attention` applies this to any callable with the SDPA layout ``fn(q, k, v)``: with
``v`` the identity over keys, the output *is* the weight matrix.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

from .._validate import fail

__all__ = [
    "CallTimedOut",
    "ModuleProbe",
    "ScaleFit",
    "call_with_timeout",
    "diagnose_scale",
    "fit_logit_scale",
    "probe_attention",
    "probe_module",
]

T = TypeVar("T")


class CallTimedOut(TimeoutError):
    """A call made by :func:`call_with_timeout` did not return in time; it may still be running."""


def call_with_timeout(body: Callable[[], T], timeout: float | None) -> T:
    """``body()``'s result or exception, or :class:`CallTimedOut` once ``timeout`` seconds have passed.

    ``body`` runs in a daemon thread, because a call into foreign code cannot be interrupted: after a
    timeout it goes on running in the background, and does not keep the interpreter alive at exit.
    Thread-local state, such as torch's grad mode, must be set inside ``body``. ``timeout=None``
    calls ``body`` in this thread, without a limit.

    >>> call_with_timeout(lambda: 6 * 7, 1.0)
    42
    """
    if timeout is None:
        return body()
    outcome: list[tuple[bool, object]] = []

    def target() -> None:
        try:
            outcome.append((True, body()))
        except BaseException as exc:  # handed over to the caller, whatever it is
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name="attnscale-timed-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise CallTimedOut(f"timed out after {timeout:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class ScaleFit:
    """Per-head effective logit scale fitted from weights, with the fit's R^2 (1 = exact)."""

    scale: tuple[float, ...]
    r2: tuple[float, ...]
    rows: int
    bias_slope: tuple[float, ...] = ()
    """Per head, with ``position_bias``: the slope of log weights on the query-key distance."""

    @property
    def mean_scale(self) -> float:
        return sum(self.scale) / len(self.scale)

    @property
    def min_r2(self) -> float:
        return min(self.r2)


def fit_logit_scale(query: Tensor, key: Tensor, weights: Tensor, *, min_prob: float = 1e-12, position_bias: bool = False) -> ScaleFit:
    """Fit ``s`` in ``log weights = s * q.k + row constant`` per head.

    Shapes: query (..., H, L, D), key (..., Hkv, S, D) with H a multiple of Hkv, weights
    (..., H, L, S). Entries with weight <= ``min_prob`` (masked, or underflowed) are ignored; rows
    with fewer than two usable entries are skipped. A head whose usable entries leave q.k constant
    (none at all, from NaN or zero weights) has R^2 0: nothing was fitted. With ``position_bias``
    the fit also has a slope ``b`` on the query-key distance (``i - j``, the last query at the last
    key), ALiBi's form: ``log weights = s * q.k + b * (i - j) + row constant`` (rows need three
    entries), and ``ScaleFit.bias_slope`` holds ``b`` per head.
    """
    if weights.shape[-3:] != (*query.shape[-3:-1], key.shape[-2]):
        fail(
            "weights",
            f"shape (..., H, L, S) = (..., {query.shape[-3]}, {query.shape[-2]}, {key.shape[-2]})",
            f"shape {tuple(weights.shape)}",
            "pass the softmax weights of this query and key",
        )
    q = query.detach().double()
    k = key.detach().double()
    group = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(group, dim=-3)  # (..., H, S, D)
    x = q @ k.transpose(-1, -2)  # (..., H, L, S)
    w = weights.detach().double()
    use = w > min_prob
    y = torch.where(use, torch.log(torch.where(use, w, torch.ones_like(w))), torch.zeros_like(w))
    x = torch.where(use, x, torch.zeros_like(x))
    n = use.sum(-1, keepdim=True)
    row_ok = n >= (3 if position_bias else 2)
    use = use & row_ok
    n = n.clamp_min(1)
    heads = q.shape[-3]

    def centred(t: Tensor) -> Tensor:  # within rows, over the usable entries; (H, everything else)
        t = torch.where(use, t - t.sum(-1, keepdim=True) / n, torch.zeros_like(t))
        return t.movedim(-3, 0).reshape(heads, -1)

    xc, yc = centred(x), centred(y)
    sxx = (xc * xc).sum(-1)
    sxy = (xc * yc).sum(-1)
    syy = (yc * yc).sum(-1)
    if not position_bias:
        slope = sxy / sxx.clamp_min(1e-300)
        resid = ((yc - slope[:, None] * xc) ** 2).sum(-1)
        bias: tuple[float, ...] = ()
    else:
        L, S = w.shape[-2:]
        distance = torch.arange(L, dtype=w.dtype)[:, None] + (S - L) - torch.arange(S, dtype=w.dtype)[None, :]
        dc = centred(torch.where(use, distance.expand_as(w), torch.zeros_like(w)))
        sdd, sxd, sdy = (dc * dc).sum(-1), (xc * dc).sum(-1), (dc * yc).sum(-1)
        # the 2x2 normal equations; a head whose distances do not vary (one key per row) has no b
        det = sxx * sdd - sxd * sxd
        solvable = det > 1e-12 * (sxx * sdd).clamp_min(1e-300)
        slope = torch.where(solvable, (sxy * sdd - sdy * sxd) / det.where(solvable, torch.ones_like(det)), sxy / sxx.clamp_min(1e-300))
        b = torch.where(solvable, (sdy - slope * sxd) / sdd.clamp_min(1e-300), torch.zeros_like(slope))
        resid = ((yc - slope[:, None] * xc - b[:, None] * dc) ** 2).sum(-1)
        bias = tuple(b.tolist())
    # R^2 1 where the weights do not vary but q.k does (a multiplier of 0, fitted exactly); 0 where
    # q.k does not vary over the usable entries (none: NaN or zero weights, or q.k constant): no
    # data is never a perfect fit
    r2 = torch.where(syy > 0, 1.0 - resid / syy.clamp_min(1e-300), torch.ones_like(syy)).where(sxx > 0, torch.zeros_like(syy))
    return ScaleFit(scale=tuple(slope.tolist()), r2=tuple(r2.tolist()), rows=int(row_ok.sum()), bias_slope=bias)


def diagnose_scale(found: float, head_dim: int, num_heads: int | None = None, *, rtol: float = 0.03) -> str:
    """Name the convention nearest to ``found`` (within ``rtol`` in log space), else "unusual".

    Candidates, in order of precedence: ``1/sqrt(D)`` (correct), ``1`` (no scale), ``1/D`` (the
    scale applied twice, or muP's 1/d), and with ``num_heads``: ``1/sqrt(D * H)`` (sqrt(d_model)
    used instead of sqrt(d_k)) and ``1/sqrt(H)``.
    """
    candidates = [
        ("1/sqrt(head_dim)", 1.0 / math.sqrt(head_dim)),
        ("no scale", 1.0),
        ("1/head_dim (scale applied twice, or muP)", 1.0 / head_dim),
    ]
    if num_heads is not None:
        candidates += [
            ("1/sqrt(d_model) (uses the model width)", 1.0 / math.sqrt(head_dim * num_heads)),
            ("1/sqrt(num_heads)", 1.0 / math.sqrt(num_heads)),
        ]
    if not found > 0:
        return "no positive scale found"
    for name, value in candidates:
        if abs(math.log(found / value)) <= rtol:
            return name
    return "learned or unusual scale"


def probe_attention(
    fn: Callable[[Tensor, Tensor, Tensor], Tensor],
    *,
    head_dim: int = 64,
    num_heads: int = 4,
    L: int = 8,
    S: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> ScaleFit:
    """Fit the effective scale of ``fn(query, key, value) -> out`` (SDPA layout, (B, H, L, D)).

    Value is the identity over keys (Dv = S), so ``out[..., i, :]`` is row i's weights. Queries and
    keys are standard normal, so a correct implementation sees unit-variance logits.

    >>> import attnscale
    >>> fit = probe_attention(attnscale.scaled_dot_product_attention, head_dim=64)
    >>> round(fit.mean_scale * 64 ** 0.5, 4), diagnose_scale(fit.mean_scale, 64)
    (1.0, '1/sqrt(head_dim)')
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num_heads, L, head_dim, generator=gen, dtype=torch.float64).to(dtype)  # (B, H, L, D)
    k = torch.randn(1, num_heads, S, head_dim, generator=gen, dtype=torch.float64).to(dtype)  # (B, H, S, D)
    v = torch.eye(S, dtype=dtype).expand(1, num_heads, S, S)  # (B, H, S, Dv=S)
    with torch.no_grad():
        weights = fn(q, k, v)
    if not isinstance(weights, Tensor) or weights.shape != (1, num_heads, L, S):
        fail(
            "fn",
            f"a callable returning a (B, H, L, Dv) tensor, here (1, {num_heads}, {L}, {S})",
            f"{type(weights).__name__} {tuple(getattr(weights, 'shape', ()))}",
            "wrap the implementation so that it takes (query, key, value) and returns the output",
        )
    return fit_logit_scale(q, k, weights.double())


@dataclass(frozen=True)
class ModuleProbe:
    """Per-head scale found in an attention module, what 1/sqrt(d_model / num_heads) expects, and why."""

    fit: ScaleFit
    head_dim: int
    num_heads: int
    expected: float
    diagnosis: str


_PROJECTION_NAMES = (
    ("q_proj", "k_proj", "v_proj", "out_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj"),  # Llama-family layers
    ("query", "key", "value", None),
)
"""The (q, k, v, out) layer names tried, in order, when none are given."""


def _default_call(module: nn.Module, x: Tensor) -> Tensor:
    if isinstance(module, nn.MultiheadAttention):
        seq = x if module.batch_first else x.transpose(0, 1)  # (L, B, E) when not batch_first
        out = module(seq, seq, seq, need_weights=False)[0]
        return out if module.batch_first else out.transpose(0, 1)
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def probe_module(
    module: nn.Module,
    *,
    num_heads: int | None = None,
    projections: tuple[str, str, str, str | None] | None = None,
    call: Callable[[nn.Module, Tensor], Tensor] | None = None,
    length: int = 8,
    seed: int = 0,
    timeout: float | None = None,
) -> ModuleProbe:
    """Find the per-head logit scale of a self-attention module from the outside.

    Supports ``torch.nn.MultiheadAttention``, :class:`attnscale.MultiHeadAttention`, HF attention
    layers with ``query``/``key``/``value`` linears (no output projection), and any module with
    linear projections named by ``projections = (q, k, v, out or None)``. ``call(module, x)``
    runs self-attention on x (B, L, E) and returns (B, L, E'); the default handles the above.
    Masks inside the module (causal) are fine: hidden keys are ignored by the fit.

    Raises ``TypeError``/``ValueError`` naming what does not fit (no linear projections, a head
    count that does not divide them, a call that returns no (B, L, E') tensor), the module's own
    exception if it raises, and :class:`CallTimedOut` if ``call`` takes longer than ``timeout``
    seconds (``None``: no limit; see :func:`call_with_timeout`).

    >>> mha = torch.nn.MultiheadAttention(64, num_heads=8, batch_first=True)
    >>> found = probe_module(mha)
    >>> found.diagnosis, round(found.fit.mean_scale / found.expected, 6)
    ('1/sqrt(head_dim)', 1.0)
    """
    if not isinstance(module, nn.Module):
        fail("module", "a torch.nn.Module instance", type(module).__name__, "pass the attention layer itself", exc=TypeError)
    if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1):
        fail("num_heads", "a positive int or None", repr(num_heads), "pass the number of query heads, e.g. num_heads=8")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf):
        fail("timeout", "a finite number of seconds > 0, or None for no limit", repr(timeout), "pass timeout=10")
    m = copy.deepcopy(module).double().eval()
    gen = torch.Generator().manual_seed(seed)
    if isinstance(m, nn.MultiheadAttention):
        if m.in_proj_weight is None or m.bias_k is not None:
            fail("module", "nn.MultiheadAttention with packed in-projections and no bias_k/v", "kdim/vdim or add_bias_kv", "probe a self-attention module")
        E = m.embed_dim
        H = m.num_heads
        Hkv, hd, E_in = H, E // H, E
        out_features = E
    else:
        names = projections or next((n for n in _PROJECTION_NAMES if all(hasattr(m, p) for p in n if p)), None)
        if names is None:
            known = "; ".join("/".join(n for n in names if n) for names in _PROJECTION_NAMES)
            fail("projections", "names of the module's (q, k, v, out) linear layers", f"a module with none of the name sets {known}", "pass projections=('wq', 'wk', 'wv', 'wo')")
        for n in names:
            if n and not isinstance(getattr(m, n, None), nn.Linear):
                got = f"{n} is {type(getattr(m, n, None)).__name__}"
                fail("projections", "names of the module's nn.Linear layers (q, k, v, out or None)", got, "pass projections=('wq', 'wk', 'wv', 'wo')", exc=TypeError)
        q_lin, k_lin, v_lin = (getattr(m, n) for n in names[:3])
        H = num_heads or next((getattr(m, a) for a in ("num_heads", "num_attention_heads") if isinstance(getattr(m, a, None), int)), None)
        if H is None:
            fail("num_heads", "the number of query heads", "None (not found on the module)", "pass num_heads=...")
        if H < 1 or q_lin.out_features < H or q_lin.out_features % H:
            fail("num_heads", f"a positive divisor of the query projection's {q_lin.out_features} outputs", H, "pass num_heads=...")
        hd = q_lin.out_features // H
        Hkv = k_lin.out_features // hd
        E_in = q_lin.in_features
        if k_lin.out_features % hd or Hkv < 1 or H % Hkv or v_lin.out_features != k_lin.out_features:
            got = f"q {q_lin.out_features}, k {k_lin.out_features}, v {v_lin.out_features} outputs with {H} heads"
            fail("module", f"key and value projections of Hkv heads of {hd} features, Hkv dividing {H}", got, "pass num_heads=... or projections=...")
        if k_lin.in_features != E_in or v_lin.in_features != E_in:
            fail("module", f"q, k and v projections reading the same {E_in} features", f"{k_lin.in_features} and {v_lin.in_features}", "probe a self-attention module")
        out_features = q_lin.out_features if names[3] is None else getattr(m, names[3]).out_features
    L = min(length, hd)  # keys = queries (self-attention); at most hd so each head's V is invertible
    Wq = torch.randn(H * hd, E_in, generator=gen, dtype=torch.float64) / math.sqrt(E_in)
    Wk = torch.randn(Hkv * hd, E_in, generator=gen, dtype=torch.float64) / math.sqrt(E_in)
    Wv = torch.randn(Hkv * hd, E_in, generator=gen, dtype=torch.float64) / math.sqrt(E_in)
    if out_features < H * hd:
        fail("module", f"an output projection that keeps all {H * hd} head features", f"{out_features} outputs", "probe the attention core (call=...) instead")
    Wo = torch.eye(out_features, H * hd, dtype=torch.float64)  # keeps every head's output readable
    x = torch.randn(1, L, E_in, generator=gen, dtype=torch.float64)  # (B, L, E)
    with torch.no_grad():
        if isinstance(m, nn.MultiheadAttention):
            m.in_proj_weight.copy_(torch.cat([Wq, Wk, Wv]))
            m.in_proj_bias.zero_()
            m.out_proj.weight.copy_(Wo)
            m.out_proj.bias.zero_()
        else:
            linears = [q_lin, k_lin, v_lin] + ([] if names[3] is None else [getattr(m, names[3])])
            for lin, W in zip(linears, [Wq, Wk, Wv, Wo]):
                lin.weight.copy_(W)
                if lin.bias is not None:
                    lin.bias.zero_()

    def run() -> object:
        with torch.no_grad():  # grad mode is per thread: set it where the module runs
            return (call or _default_call)(m, x)

    out = call_with_timeout(run, timeout)
    if not isinstance(out, Tensor) or out.shape[:2] != (1, L) or out.dim() != 3 or out.shape[-1] < H * hd:
        fail(
            "call",
            f"call(module, x) returning a (B, L, E') tensor with E' >= {H * hd}, here x has shape (1, {L}, {E_in})",
            f"returned {type(out).__name__} {tuple(getattr(out, 'shape', ()))}",
            "pass call=lambda module, x: ... that runs self-attention on x and returns its output tensor",
        )
    out = out[..., : H * hd].double()  # (B, L, H * hd)
    q = (x @ Wq.T).unflatten(-1, (H, hd)).transpose(1, 2)  # (B, H, L, hd)
    k = (x @ Wk.T).unflatten(-1, (Hkv, hd)).transpose(1, 2)  # (B, Hkv, S, hd)
    v = (x @ Wv.T).unflatten(-1, (Hkv, hd)).transpose(1, 2)  # (B, Hkv, S, hd)
    heads_out = out.unflatten(-1, (H, hd)).transpose(1, 2)  # (B, H, L, hd)
    v_per_query_head = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, S, hd)
    weights = heads_out @ torch.linalg.pinv(v_per_query_head)  # (B, H, L, S): out = weights @ v
    fit = fit_logit_scale(q, k, weights, min_prob=1e-9)
    expected = 1.0 / math.sqrt(hd)
    return ModuleProbe(fit=fit, head_dim=hd, num_heads=H, expected=expected, diagnosis=diagnose_scale(fit.mean_scale, hd, H))
