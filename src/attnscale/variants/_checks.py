"""Argument checks shared by the variants; every failure goes through ``attnscale._validate.fail``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch
from torch import Tensor

from .._validate import FLOAT_DTYPES, fail

_NO_VALUE = object()  # check_qkv without a value tensor (int8_logits)


def check_int(arg: str, value: object, *, minimum: int) -> int:
    """An integer >= ``minimum``: a Python or NumPy int, never a bool; returned as a Python int."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        fail(arg, f"an int >= {minimum}", repr(value), f"pass e.g. {arg}={max(minimum, 1)}", exc=TypeError)
    if value < minimum:
        fail(arg, f"an int >= {minimum}", repr(value), f"pass e.g. {arg}={max(minimum, 1)}")
    return int(value)


def check_float(arg: str, value: object, *, positive: bool = True) -> float:
    """A finite float, > 0 (``positive``) or >= 0."""
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, Real):
        fail(arg, f"a finite float {bound}", repr(value), f"pass a float {bound}", exc=TypeError)
    value = float(value)
    if not math.isfinite(value) or value < 0.0 or (positive and value == 0.0):
        fail(arg, f"a finite float {bound}", repr(value), f"pass a float {bound}")
    return value


def check_float_tensor(arg: str, t: object, *, min_ndim: int = 3) -> Tensor:
    if not isinstance(t, Tensor) or t.dtype not in FLOAT_DTYPES:
        got = f"dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        fail(arg, "a floating torch.Tensor", got, f"convert it, e.g. torch.as_tensor({arg}).float()", exc=TypeError)
    if t.ndim < min_ndim:
        layout = "(..., heads, length, head_dim)" if min_ndim >= 3 else "(..., rows, dim)"
        fail(arg, f"at least {min_ndim} dims {layout}", f"shape {tuple(t.shape)}", f"add the missing dims, e.g. {arg}.unsqueeze(0)")
    return t


def check_same_device(arg: str, t: Tensor, device: torch.device, *, owner: str = "the query's") -> None:
    if t.device != device:
        fail(arg, f"{owner} device {device}", f"device {t.device}", f"move it: {arg}.to({device.type!r})")


@dataclass(frozen=True)
class QKVShapes:
    """Sizes of a validated call, in the shape legend: batch (broadcast), H, Hkv, L, S, D, Dv (None without a value)."""

    batch: tuple[int, ...]
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    Dv: int | None


def check_qkv(query: object, key: object, value: object = _NO_VALUE, *, names: tuple[str, str, str] = ("query", "key", "value")) -> QKVShapes:
    """Check the query (..., H, L, D) / key (..., Hkv, S, D) / value (..., Hkv, S, Dv) contract, before any compute.

    As ``scaled_dot_product_attention`` with GQA always on: floating tensors of one dtype, device and
    rank; ``D >= 1``; ``Hkv >= 1`` dividing H; key and value share heads and length; batch dims
    broadcast. ``value`` left out: only query and key are checked (``Dv`` is None).
    """
    nq, nk, nv = names
    given = [(nq, query), (nk, key)] + ([] if value is _NO_VALUE else [(nv, value)])
    for name, t in given:
        check_float_tensor(name, t)
    assert isinstance(query, Tensor) and isinstance(key, Tensor)
    for name, t in given[1:]:
        assert isinstance(t, Tensor)
        if t.dtype != query.dtype:
            fail(name, f"the {nq}'s dtype {query.dtype}", f"dtype {t.dtype}", f"cast it: {name}.to({nq}.dtype)", exc=TypeError)
        check_same_device(name, t, query.device, owner=f"the {nq}'s")
        if t.ndim != query.ndim:
            fail(name, f"{query.ndim} dims like the {nq}", f"shape {tuple(t.shape)}", f"give {', '.join(n for n, _ in given)} the same number of dims (unsqueeze for broadcast batch dims)")
    H, L, D = query.shape[-3:]
    Hkv, S = key.shape[-3], key.shape[-2]
    if D == 0:
        fail(nq, "head dim D >= 1 (the last dim)", f"shape {tuple(query.shape)}", "D = 0 has no dot product; check the head split")
    if key.shape[-1] != D:
        fail(nk, f"last dim D = {D} like the {nq}'s", f"shape {tuple(key.shape)}", f"{nq} and {nk} must share the head dim D")
    if Hkv == 0 or H % Hkv != 0:
        fail(nk, f"a number of heads (dim -3) >= 1 dividing the {nq}'s {H}", f"{Hkv} heads", "use Hkv in the divisors of H (GQA: query head h reads key head h // (H // Hkv))")
    Dv = None
    batches = [query.shape[:-3], key.shape[:-3]]
    if value is not _NO_VALUE:
        assert isinstance(value, Tensor)
        if value.shape[-3] != Hkv or value.shape[-2] != S:
            fail(nv, f"(..., Hkv={Hkv}, S={S}, Dv) like the {nk}", f"shape {tuple(value.shape)}", f"{nk} and {nv} must share heads and length")
        Dv = value.shape[-1]
        batches.append(value.shape[:-3])
    try:
        batch = torch.broadcast_shapes(*batches)
    except RuntimeError:
        got = ", ".join(f"{n} {tuple(b)}" for (n, _), b in zip(given[1:], batches[1:]))
        fail(nk, f"batch dims broadcastable with the {nq}'s {tuple(query.shape[:-3])}", got, "make the leading dims equal or 1")
    return QKVShapes(batch=tuple(batch), H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv)
