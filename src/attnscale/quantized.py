"""Int8 keys and values: :class:`QuantizedKV`, :func:`quantize_kv` and :func:`quantized_attention`.

A KV cache in symmetric int8 holds about half of bfloat16's bytes. The layout (B batch, Hkv key
heads, S keys, D key dim, Dv value dim, G channels per group of K)::

    k        int8     (B, Hkv, S, D)       round((k - k_mean) / k_scale), in [-127, 127]
    k_scale  float32  (B, Hkv, S, D // G)  one scale per key and group of G channels
    k_mean   float32  (B, Hkv, 1, D)       the mean over the keys the record was made from
    v        int8     (B, Hkv, S, Dv)      round(v / v_scale)
    v_scale  float32  (B, Hkv, S, 1)       one scale per value vector

K is smoothed by its mean over keys before it is quantized: a channel whose keys share a large
offset (the outlier channels of trained models) then spends its 8 bits on how the keys differ,
not on the offset. Subtracting one vector from every key changes each row's logits by one constant
(``q . m`` times the scale), which softmax ignores; this module adds the mean back when it
dequantizes, so every score-path feature (softcap, statistics) means what it means in
:func:`attnscale.scaled_dot_product_attention`. Appended keys are smoothed by the same mean.

:func:`quantized_attention` means attention over the record's dequantized keys and values, as
:func:`attnscale.scaled_dot_product_attention` computes it (its checks, options and guard). The
compiled kernel computes it over the codes themselves (``kernels/csrc/quantized.h``): each key
tile is dequantized as it is reached, to the floats :meth:`QuantizedKV.dequantize` gives, and the
query heads that share a key head take it together; for the few query rows of a decoding step the
codes are multiplied in registers, never written out as floats. A bfloat16 or float16 query's
decoding step (its output rounded to 16 bits) takes q.k in integers: each row of q rounded to
int16 codes at a step of its own (max |q_r| / 32767), each group's products summed exactly in
int32 (AVX512-VNNI's vpdpwssd where the CPU has it), what the float64 reference computes over q's
rounded rows. A bfloat16 prefill (many query rows, where torch's brgemm runs) rounds the
dequantized K and V to bfloat16 for the bfloat16 kernel's products instead. Where the kernel
cannot take a call (float64 queries, a gradient asked of the query, a trace, no compiler) or
flags a row (non-finite, or all zeros), the specification computes it: the dequantized K and V
in float32 through :func:`attnscale.scaled_dot_product_attention`. Each agrees with the float64
reference over the dequantized K and V up to float32 rounding (a 16-bit query's decoding step:
over its int16 rows), the bfloat16 prefill up to bfloat16's (tests/test_quantized_kernel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._validate import FLOAT_DTYPES, Backend, check_attention_call, fail
from .functional import record_backend, scaled_dot_product_attention
from .kernels import fused
from .masks import CausalAlignment, slopes_learned
from .stats import AttentionStats

__all__ = ["QuantizedKV", "quantize_codes", "quantize_kv", "quantized_attention"]

QMAX = 127
"""Symmetric int8: codes in [-127, 127] (-128 unused, so that negation stays in range)."""
GROUP = 64
"""Default channels per scale of K: one float32 scale per 64 int8 codes, 1/16 of a byte per
channel; K and V together at 0.523x of bfloat16's bytes for D = Dv = 128 (tests/test_quantized.py)."""


@dataclass(frozen=True)
class QuantizedKV:
    """Keys and values in int8 with their float32 scales (the layout in :mod:`attnscale.quantized`).
    Made by :func:`quantize_kv`; :meth:`append` returns a longer record."""

    k: Tensor
    k_scale: Tensor
    k_mean: Tensor
    v: Tensor
    v_scale: Tensor
    group: int

    def __post_init__(self) -> None:
        _check_record(self)

    @classmethod
    def trusted(cls, k: Tensor, k_scale: Tensor, k_mean: Tensor, v: Tensor, v_scale: Tensor, group: int) -> QuantizedKV:
        """A record of tensors this module made (:func:`quantize_codes`' output, or views of a cache
        filled with it), without the record's checks (a pass over every scale): for caches that
        publish a record of their first S keys at every decoding step."""
        record = object.__new__(cls)
        for name, value in zip(("k", "k_scale", "k_mean", "v", "v_scale", "group"), (k, k_scale, k_mean, v, v_scale, group), strict=True):
            object.__setattr__(record, name, value)
        return record

    @property
    def length(self) -> int:
        """S, the number of keys held."""
        return self.k.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor of the record."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.k_scale, self.k_mean, self.v, self.v_scale))

    def dequantize(self) -> tuple[Tensor, Tensor]:
        """(k, v) in float32: codes times their scales, the mean added back to k."""
        *lead, S, D = self.k.shape
        groups = self.k.float().reshape(*lead, S, D // self.group, self.group) * self.k_scale.unsqueeze(-1)
        return groups.reshape(*lead, S, D) + self.k_mean, self.v.float() * self.v_scale

    def append(self, k: Tensor, v: Tensor) -> QuantizedKV:
        """This record with ``k`` (B, Hkv, S_new, D) and ``v`` (B, Hkv, S_new, Dv) after its keys,
        quantized with this record's mean and group (the held codes are not touched)."""
        _check_kv(k, v)
        for name, t, held in (("k", k, self.k), ("v", v, self.v)):
            if t.shape[:-2] != held.shape[:-2] or t.shape[-1] != held.shape[-1]:
                fail(name, f"(B, Hkv, S_new, {held.shape[-1]}) with (B, Hkv) = {tuple(held.shape[:-2])}, as the record holds", f"shape {tuple(t.shape)}", "append keys and values of the record's batch, heads and head dims")
            if t.device != held.device:
                fail(name, f"the record's device {held.device}", f"device {t.device}", f"move it: {name}.to({held.device})")
        k_codes, k_scale = _quantize(k.float() - self.k_mean, self.group)
        v_codes, v_scale = _quantize(v.float(), v.shape[-1])
        return QuantizedKV(
            torch.cat([self.k, k_codes], dim=-2), torch.cat([self.k_scale, k_scale], dim=-2), self.k_mean,
            torch.cat([self.v, v_codes], dim=-2), torch.cat([self.v_scale, v_scale], dim=-2), self.group,
        )  # fmt: skip


def quantize_kv(k: Tensor, v: Tensor, *, group: int = GROUP, smooth: bool = True) -> QuantizedKV:
    """K and V in symmetric int8: k (B, Hkv, S, D) smoothed by its mean over the S keys (``smooth``)
    and scaled per key and group of ``group`` channels (all D where D < ``group``), v (B, Hkv, S,
    Dv) per value vector. An all-zero group keeps scale 1 (its codes are 0).

    >>> import torch, attnscale
    >>> k, v = torch.randn(1, 2, 16, 64), torch.randn(1, 2, 16, 64)
    >>> kv = attnscale.quantize_kv(k, v)
    >>> k_back, v_back = kv.dequantize()
    >>> bool((k_back - k).abs().max() <= kv.k_scale.max() / 2 + 1e-6)
    True
    """
    _check_kv(k, v)
    wide = k.float()
    mean = wide.mean(dim=-2, keepdim=True) if smooth and k.shape[-2] else torch.zeros_like(wide[..., :1, :])
    k_codes, k_scale, v_codes, v_scale = _codes(k, v, group, mean)
    return QuantizedKV(k_codes, k_scale, mean, v_codes, v_scale, k.shape[-1] // k_scale.shape[-1])


def quantize_codes(k: Tensor, v: Tensor, *, group: int, mean: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The int8 codes and scales of :func:`quantize_kv`'s layout for k (B, Hkv, S, D) smoothed by
    ``mean`` (B, Hkv, 1, D) and v (B, Hkv, S, Dv): (k codes, k_scale, v codes, v_scale), ``group``
    channels of K a scale (all D where D < ``group``). For caches that append keys with a mean of
    their own (:class:`attnscale.Int8Cache`)."""
    _check_kv(k, v)
    return _codes(k, v, group, mean)


def _codes(k: Tensor, v: Tensor, group: object, mean: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize_codes` of k and v already checked (:func:`_check_kv`): the group and the mean
    checked here."""
    D = k.shape[-1]
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        fail("group", "a positive int (channels of K per scale)", repr(group), f"pass e.g. group={GROUP}")
    group = min(group, D)
    if D % group:
        fail("group", f"a divisor of the key dim D = {D}", repr(group), f"pass group={math.gcd(D, group)} or {D}")
    if not isinstance(mean, Tensor) or mean.dtype != torch.float32 or tuple(mean.shape) != (*k.shape[:-2], 1, D) or mean.device != k.device:
        fail("mean", f"float32 (B, Hkv, 1, D) = {(*k.shape[:-2], 1, D)} on {k.device}", f"{getattr(mean, 'dtype', type(mean).__name__)} {tuple(getattr(mean, 'shape', ()))}", "pass the mean the cache's keys were smoothed by")
    k_codes, k_scale = _quantize(k.float() - mean, group)
    v_codes, v_scale = _quantize(v.float(), v.shape[-1])
    return k_codes, k_scale, v_codes, v_scale


def _quantize(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """float32 x (..., S, d) as int8 codes and one float32 scale per key and group of channels."""
    *lead, S, d = x.shape
    groups = x.reshape(*lead, S, d // group, group)
    scale = groups.abs().amax(dim=-1) / QMAX  # (..., S, d // group)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: codes 0, scale 1
    codes = torch.round(groups / scale.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes.reshape(*lead, S, d), scale


def _check_kv(k: object, v: object) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dtype not in FLOAT_DTYPES:
            fail(name, "a float tensor (B, Hkv, S, d)", f"dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__, f"pass the projected {name} in a float dtype", exc=TypeError)
        if t.ndim != 4:
            fail(name, "4 dims (B, Hkv, S, d)", f"shape {tuple(t.shape)}", f"reshape {name} to (B, Hkv, S, d)")
        if t.numel() and not bool(torch.isfinite(t).all()):
            fail(name, "finite entries (int8 has no NaN or inf)", "a NaN or inf entry", f"check how {name} was computed; attention over non-finite keys or values has no int8 form")
    assert isinstance(k, Tensor) and isinstance(v, Tensor)
    if k.shape[:-1] != v.shape[:-1]:
        fail("v", f"(B, Hkv, S) = {tuple(k.shape[:-1])} like k's", f"shape {tuple(v.shape)}", "quantize keys and values of the same positions together")
    if v.device != k.device:
        fail("v", f"k's device {k.device}", f"device {v.device}", "move it: v.to(k.device)")


def _check_record(kv: QuantizedKV) -> None:
    """A record's tensors consistent with one another (a hand-made one included)."""
    k, v = kv.k, kv.v
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dtype != torch.int8 or t.ndim != 4:
            fail(name, "int8 codes (B, Hkv, S, d)", f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}", "make the record with attnscale.quantize_kv")
    B, Hkv, S, D = k.shape
    if isinstance(kv.group, bool) or not isinstance(kv.group, int) or kv.group < 1 or D % kv.group:
        fail("group", f"a divisor of the key dim D = {D}", repr(kv.group), "make the record with attnscale.quantize_kv")
    want = {
        "k_scale": (kv.k_scale, (B, Hkv, S, D // kv.group)),
        "k_mean": (kv.k_mean, (B, Hkv, 1, D)),
        "v_scale": (kv.v_scale, (B, Hkv, S, 1)),
    }
    if v.shape[:-1] != (B, Hkv, S):
        fail("v", f"(B, Hkv, S) = {(B, Hkv, S)} like k's", f"shape {tuple(v.shape)}", "make the record with attnscale.quantize_kv")
    for name, (t, shape) in want.items():
        if not isinstance(t, Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
            fail(name, f"float32 of shape {shape}", f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}", "make the record with attnscale.quantize_kv")
        if t.device != k.device:
            fail(name, f"k's device {k.device}", f"device {t.device}", "keep the record's tensors on one device")
    for name in ("k_scale", "v_scale"):
        t = want[name][0]
        if t.numel() and not bool(((t > 0) & torch.isfinite(t)).all()):
            fail(name, "finite positive scales", "a zero, negative or non-finite scale", "make the record with attnscale.quantize_kv (an all-zero group has scale 1)")
    if not bool(torch.isfinite(kv.k_mean).all()):
        fail("k_mean", "finite entries", "a NaN or inf", "make the record with attnscale.quantize_kv")


def quantized_attention(
    query: Tensor,
    kv: QuantizedKV,
    attn_mask: Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    causal_alignment: CausalAlignment | str = CausalAlignment.TOP_LEFT,
    enable_gqa: bool = False,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, AttentionStats]:
    """Attention of ``query`` (B, H, L, D) over the int8 keys and values of ``kv``: what
    :func:`attnscale.scaled_dot_product_attention` computes over ``kv.dequantize()``, every option
    (``attn_mask`` among them: bool, True = attend, or float, added) meaning what it means there
    (``scale=None`` is ``1/sqrt(D)``), accumulated in float32 (float64 for float64 queries), the
    output in the query's dtype as torch's SDPA gives it; its error against float attention is the
    quantization's (tests/test_quantized.py).

    >>> import torch, attnscale
    >>> q, k, v = torch.randn(1, 4, 3, 64), torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    >>> kv = attnscale.quantize_kv(k, v)
    >>> out = attnscale.quantized_attention(q, kv, is_causal=True, causal_alignment="bottom_right", enable_gqa=True)
    >>> want = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right", enable_gqa=True)
    >>> bool((out - want).abs().max() < 0.05)
    True
    """
    if not isinstance(kv, QuantizedKV):
        fail("kv", "an attnscale.QuantizedKV", type(kv).__name__, "make one with attnscale.quantize_kv(k, v)", exc=TypeError)
    if not isinstance(query, Tensor) or query.dtype not in FLOAT_DTYPES:
        fail("query", "a float tensor (B, H, L, D)", type(query).__name__ if not isinstance(query, Tensor) else f"dtype {query.dtype}", "pass the projected queries", exc=TypeError)
    if query.device != kv.k.device:
        fail("query", f"the record's device {kv.k.device}", f"device {query.device}", f"move it: query.to({kv.k.device})")
    options = dict(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, causal_alignment=causal_alignment, softcap=softcap,
                   alibi_slopes=alibi_slopes, window=window, sinks=sinks, return_stats=return_stats)  # fmt: skip
    if _kernel_takes(query, kv, attn_mask, alibi_slopes):
        done = _in_kernel(query, kv, attn_mask, **options)
        if done is not None:
            return done
    k, v = kv.dequantize()
    if query.dtype == torch.float64:
        k, v = k.double(), v.double()
    out = scaled_dot_product_attention(query if query.dtype == torch.float64 else query.float(), k, v, attn_mask, **options)
    if query.dtype in (torch.float64, torch.float32):
        return out
    return (out[0].to(query.dtype), out[1]) if isinstance(out, tuple) else out.to(query.dtype)


def _kernel_takes(query: Tensor, kv: QuantizedKV, attn_mask: Tensor | None, alibi_slopes: Tensor | None) -> bool:
    """Whether the compiled kernel may compute the call: an eager (B, H, L, D) query of the record's
    batch in float32 or a 16-bit format whose gradient is not asked for, constant slopes, every
    size at least 1. Elsewhere the specification computes it (float64 queries, gradients, traces)."""
    if query.ndim != 4 or query.dtype not in (torch.float32, torch.bfloat16, torch.float16) or query.shape[0] != kv.k.shape[0]:
        return False
    if torch.is_grad_enabled() and query.requires_grad or slopes_learned(alibi_slopes) or torch.compiler.is_compiling():
        return False
    if min(query.shape) == 0 or kv.length == 0 or kv.v.shape[-1] == 0:
        return False
    return fused.supports(query, attn_mask) is None


def _in_kernel(query: Tensor, kv: QuantizedKV, attn_mask: Tensor | None, **options: object) -> Tensor | tuple[Tensor, AttentionStats] | None:
    """The call validated as :func:`attnscale.scaled_dot_product_attention` validates it (the
    record's shapes standing in for its keys and values), then computed by the compiled kernel over
    the int8 codes. None where some output row is non-finite or all zeros: the caller then computes
    the call through the specification, whose guard decides each row."""
    B, Hkv, S, D = kv.k.shape
    stand_in = kv.k_mean.new_empty((), dtype=query.dtype)  # shapes only: validation reads no key or value
    call = check_attention_call(
        query, stand_in.expand(B, Hkv, S, D), stand_in.expand(B, Hkv, S, kv.v.shape[-1]), attn_mask=attn_mask, dropout_p=0.0, backend="auto", **options
    )  # fmt: skip
    out, stats, rows_ok = fused.int8_attention(
        query, (kv.k, kv.k_scale, kv.k_mean, kv.v, kv.v_scale), path=call.path, attn_mask=attn_mask, alibi_slopes=options["alibi_slopes"],
        sinks=options["sinks"], return_stats=call.return_stats,
    )  # fmt: skip
    if not bool(rows_ok):
        return None
    record_backend(Backend.FUSED, "int8 keys and values")
    return (out, stats) if call.return_stats else out
