"""Argument checks shared by the variants; every failure goes through ``attnscale._validate.fail``."""

from __future__ import annotations

import math
from numbers import Real

from torch import Tensor

from .._validate import FLOAT_DTYPES, fail


def check_int(arg: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(arg, f"an int >= {minimum}", repr(value), f"pass e.g. {arg}={max(minimum, 1)}", exc=TypeError)
    if value < minimum:
        fail(arg, f"an int >= {minimum}", repr(value), f"pass e.g. {arg}={max(minimum, 1)}")
    return value


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
        fail(arg, f"at least {min_ndim} dims (..., heads, length, head_dim)", f"shape {tuple(t.shape)}", f"add a heads dim: {arg}.unsqueeze(-3)")
    return t


def check_qkv_heads(query: Tensor, key: Tensor, value: Tensor | None = None) -> tuple[int, int]:
    """Check the (..., H, L, D) / (..., Hkv, S, D) / (..., Hkv, S, Dv) contract; return (H, Hkv)."""
    check_float_tensor("query", query)
    check_float_tensor("key", key)
    H, D = query.shape[-3], query.shape[-1]
    Hkv, S = key.shape[-3], key.shape[-2]
    if key.shape[-1] != D:
        fail("key", f"last dim D = {D} like the query's", f"shape {tuple(key.shape)}", "query and key must share the head dim D")
    if key.dtype != query.dtype:
        fail("key", f"the query's dtype {query.dtype}", f"dtype {key.dtype}", "cast it: key.to(query.dtype)", exc=TypeError)
    if Hkv == 0 or H % Hkv != 0:
        fail("key", f"a number of heads (dim -3) dividing the query's {H}", f"{Hkv} heads", "use Hkv in the divisors of H (GQA)")
    if value is not None:
        check_float_tensor("value", value)
        if value.shape[-3] != Hkv or value.shape[-2] != S:
            fail("value", f"(..., Hkv={Hkv}, S={S}, Dv) like the key", f"shape {tuple(value.shape)}", "key and value must share heads and length")
        if value.dtype != query.dtype:
            fail("value", f"the query's dtype {query.dtype}", f"dtype {value.dtype}", "cast it: value.to(query.dtype)", exc=TypeError)
    return H, Hkv
