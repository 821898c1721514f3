"""Input checks shared by every entry point: they run before any compute.

Each failure names the argument, what was expected, what arrived, and how to fix it.
Wrong types raise ``TypeError``; wrong values or shapes raise ``ValueError``. From
:func:`attnscale.scaled_dot_product_attention` they come as :class:`InputTypeError` and
:class:`InputError` (:func:`as_input_error`), also ``RuntimeError`` as torch's SDPA raises for the
same calls, so that code written against torch (``except RuntimeError``) catches them too.
"""

from __future__ import annotations

import dataclasses
import math
from enum import StrEnum
from numbers import Integral, Real
from typing import NamedTuple, NoReturn

import torch
from torch import Tensor

from .dense import accumulation_dtype
from .kernels import checks as kernel_checks
from .masks import CausalAlignment, query_offset
from .score import ScorePath

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SCORE_MAX = {dtype: torch.finfo(accumulation_dtype(dtype)).max for dtype in FLOAT_DTYPES}  # largest logit each input dtype's scores hold

MAX_WINDOW = 2**62 - 1
"""Largest finite window side: sides are added to int64 key positions, which stay below 2**62 for
any sequence that fits in memory, so a larger side could overflow int64 (and means no limit)."""


class Backend(StrEnum):
    """Which implementation computes attention (see ``scaled_dot_product_attention``)."""

    AUTO = "auto"
    TORCH = "torch"
    MATH = "math"
    TILED = "tiled"
    FUSED = "fused"
    FLEX = "flex"


class InputError(ValueError, RuntimeError):
    """A value or shape attention cannot take: a ValueError, and a RuntimeError as torch raises."""


class InputTypeError(TypeError, RuntimeError):
    """An argument of the wrong type for attention: a TypeError, and a RuntimeError as torch raises."""


def as_input_error(exc: ValueError | TypeError) -> Exception:
    """``exc`` as :class:`InputError` or :class:`InputTypeError`, the message and traceback
    unchanged (one already a RuntimeError is returned as it is)."""
    if isinstance(exc, RuntimeError):
        return exc
    kind = InputTypeError if isinstance(exc, TypeError) else InputError
    return kind(*exc.args).with_traceback(exc.__traceback__)


def fail(arg: str, expected: str, got: object, fix: str, *, exc: type[Exception] = ValueError) -> NoReturn:
    raise exc(f"{arg}: expected {expected}, got {got}. Fix: {fix}")


def _shape(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}"


def check_choice(arg: str, value: object, enum: type[StrEnum]) -> StrEnum:
    if isinstance(value, enum):
        return value
    if isinstance(value, str) and value in enum._value2member_map_:  # no iteration over the enum: torch 2.11's dynamo cannot trace one
        return enum(value)
    choices = ", ".join(repr(m.value) for m in enum)
    if not isinstance(value, str):
        fail(arg, f"one of {choices}", repr(value), f"pass one of {choices}", exc=TypeError)
    fail(arg, f"one of {choices}", repr(value), f"pass one of {choices}")


def check_finite(arg: str, value: object) -> float | None:
    """None, or a finite float (of any sign: a negative or zero scale is a formula like any other)."""
    if value is None or (type(value) is float and -math.inf < value < math.inf):  # the common case first
        return value
    if isinstance(value, bool) or not isinstance(value, Real):
        fail(arg, "a finite float", repr(value), f"pass a float, e.g. {arg}=0.125", exc=TypeError)
    value = float(value)
    if not math.isfinite(value):
        fail(arg, "a finite float", repr(value), "pass a finite float (or None for the default)")
    return value


def check_positive_finite(arg: str, value: object, *, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if type(value) is float and 0.0 < value < math.inf:  # the common case, without the ABC check below
        return value
    if isinstance(value, bool) or not isinstance(value, Real):
        fail(arg, "a finite positive float", repr(value), f"pass a float, e.g. {arg}=0.125", exc=TypeError)
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        fail(arg, "a finite positive float", repr(value), "pass a float > 0 (or None for the default)")
    return value


def check_bool(arg: str, value: object) -> bool:
    if not isinstance(value, bool):
        fail(arg, "a bool", repr(value), f"pass {arg}=True or {arg}=False", exc=TypeError)
    return value


def check_window(window: object) -> tuple[int | None, int | None] | None:
    """Normalise ``window`` to ``(left, right)`` with None for unlimited (-1 is accepted for None).

    Finite sides are at most :data:`MAX_WINDOW` (2**62 - 1)."""
    if window is None:
        return None
    expected = "None or a pair (left, right) of ints in [0, 2**62 - 1], or None / -1 for unlimited"
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        fail("window", expected, repr(window), "pass e.g. window=(128, 0) for a causal sliding window")
    sides = []
    for side in window:
        if side is None or (isinstance(side, int) and not isinstance(side, bool) and side == -1):
            sides.append(None)
        elif isinstance(side, int) and not isinstance(side, bool) and 0 <= side <= MAX_WINDOW:
            sides.append(side)
        elif isinstance(side, int) and not isinstance(side, bool) and side > MAX_WINDOW:
            fail("window", expected, repr(window), "pass None (or -1) for a side without a limit")
        else:
            fail("window", expected, repr(window), "pass e.g. window=(128, 0) for a causal sliding window")
    return (sides[0], sides[1])


def check_alibi_values(slopes: Tensor, dtype: torch.dtype) -> None:
    """Finite ALiBi slopes, as they are used: in the accumulation dtype of ``dtype`` inputs (a
    float64 slope of 1e300 is inf in float32)."""
    acc = accumulation_dtype(dtype)
    if _finite_as(slopes, acc):
        return
    if not bool(torch.isfinite(slopes.detach().to(acc)).all()):
        fail("alibi_slopes", f"finite slopes in {acc}, where {dtype} inputs are scored", "NaN or inf entries (or ones that overflow it)",
             "use attnscale.alibi_slopes(H), or check how the slopes were computed")  # fmt: skip


def _below_inf(t: Tensor) -> bool:
    """Whether no entry of ``t`` is NaN or +inf."""
    kernel = kernel_checks(t)
    return kernel.below_inf(t.detach()) if kernel is not None else float(t.detach().amax()) < math.inf


def _finite_as(t: Tensor, acc: torch.dtype) -> bool:
    """True where ``t`` is known finite in ``acc`` by one call of the compiled kernel (a small CPU
    tensor no wider than ``acc``: widening keeps a finite value finite); False means "not shown"."""
    kernel = kernel_checks(t)
    return kernel is not None and (t.dtype is acc or acc is torch.float64) and kernel.all_finite(t)  # (reads values only: no detach)


def check_sinks(sinks: object, H: int, device: torch.device, *, values: bool = True, dtype: torch.dtype = torch.float64) -> None:
    """``sinks``: None or a float tensor (H,), one logit per query head, finite or -inf (no sink)
    as they are used, in the accumulation dtype of ``dtype`` inputs (a float64 sink of 1e300 is
    +inf in float32); the values are checked only with ``values`` (eager mode: see
    :mod:`attnscale._tracing`)."""
    if sinks is None:
        return
    if not isinstance(sinks, Tensor) or sinks.dtype not in FLOAT_DTYPES:
        got = f"dtype {sinks.dtype}" if isinstance(sinks, Tensor) else type(sinks).__name__
        fail("sinks", f"a float tensor of shape (H,) = ({H},)", got, "pass e.g. torch.zeros(H) (one logit per query head)", exc=TypeError)
    if tuple(sinks.shape) != (H,):
        fail("sinks", f"shape (H,) = ({H},), one logit per query head", _shape(sinks), "pass one sink logit per query head")
    if sinks.device != device:
        fail("sinks", f"the query's device {device}", f"device {sinks.device}", "move it: sinks.to(query.device)")
    if values:
        check_sink_values(sinks, dtype)


def check_sink_values(sinks: Tensor, dtype: torch.dtype) -> None:
    """Sinks (checked as :func:`check_sinks` checks them) finite or -inf in the accumulation dtype of ``dtype`` inputs."""
    if _finite_as(sinks, accumulation_dtype(dtype)):
        return
    used = sinks.detach().to(accumulation_dtype(dtype))
    if used.numel() and float(used.amax()) < math.inf:  # one reduction: amax is NaN where one is, +inf where one is
        return
    bad = torch.isnan(used) | (used == float("inf"))
    if bool(bad.any()):
        acc = accumulation_dtype(dtype)
        fail("sinks", f"finite logits in {acc} (or -inf for a head without a sink)", f"NaN or +inf at heads {bad.nonzero().flatten().tolist()}", "check how the sinks were computed")


class AttentionCall(NamedTuple):
    """A validated call: shapes, the score path and the options that choose a backend (a tuple:
    an uncached call makes one, and a frozen dataclass of these fields costs several times as much)."""

    batch: tuple[int, ...]
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    Dv: int
    path: ScorePath
    alignment: CausalAlignment
    backend: Backend
    dropout_p: float
    alibi: bool
    sinks: bool
    return_stats: bool
    family: AttentionCall | None = None
    """The validated call this one was grown from along S (keys and values of another length, all
    else alike; see :data:`_FAMILIES`), None for one the full checks made."""

    def same_along_s(self) -> AttentionCall | None:
        """The call of this one's family whose choice of torch's kernel, and torch's arguments,
        hold for this one too: where S > 0 and the query offset cannot matter (no causal mask, or
        top-left alignment, whose offset is 0 at every S); else None."""
        family = self.family
        if family is None or self.S == 0 or (self.path.causal and self.alignment is not CausalAlignment.TOP_LEFT):
            return None
        return family


def _check_float_tensor(name: str, t: object) -> None:
    """``t`` a dense torch.Tensor of a floating dtype attention takes."""
    if not isinstance(t, Tensor):
        fail(name, "a torch.Tensor", type(t).__name__, f"convert with torch.as_tensor({name})", exc=TypeError)
    if t.is_nested or t.layout is not torch.strided:  # a nested or sparse tensor has no sizes to read
        got = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        fail(name, "a dense (strided) tensor", got, "pad it (torch.nested.to_padded_tensor), or use torch's SDPA for it", exc=TypeError)
    if t.dtype not in FLOAT_DTYPES:
        fail(name, "a floating dtype (float16, bfloat16, float32 or float64)", f"dtype {t.dtype}", f"cast it, e.g. {name}.float()", exc=TypeError)


def _check_like(name: str, t: Tensor, query: Tensor, owner: str) -> None:
    """``t`` of the query's dtype and device (``owner``: how messages name the query's, e.g. "q's")."""
    if t.dtype != query.dtype:
        who = owner.removeprefix("the ").removesuffix("'s")
        fail(name, f"{owner} dtype {query.dtype}", f"dtype {t.dtype}", f"cast it: {name}.to({who}.dtype)", exc=TypeError)
    if not (t.is_cpu and query.is_cpu) and t.device != query.device:  # two CPU tensors: no torch.device made
        who = owner.removeprefix("the ").removesuffix("'s")
        fail(name, f"{owner} device {query.device}", f"device {t.device}", f"move it: {name}.to({who}.device)")


def check_tensors(query: object, key: object, value: object) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_float_tensor(name, t)
        assert isinstance(t, Tensor)
        if t.ndim < 3:
            fail(name, "at least 3 dims (..., heads, length, head_dim)", _shape(t), f"add a heads dim: {name}.unsqueeze(-3)")
    assert isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)
    for name, t in (("key", key), ("value", value)):
        _check_like(name, t, query, "the query's")
        if t.ndim != query.ndim:
            fail(name, f"{query.ndim} dims like the query", _shape(t), "give query, key and value the same number of dims (use unsqueeze for broadcast batch dims)")


def _check_values(query: Tensor, attn_mask: Tensor | None, alibi_slopes: Tensor | None, sinks: Tensor | None) -> None:
    """What a call's signature cannot prove: a float mask's entries finite or -inf, finite slopes
    and sinks (eager mode only: see :mod:`attnscale._tracing`)."""
    # one reduction: the largest entry is NaN where one is (amax propagates NaN), +inf where one is
    # (for a small float32 or float64 mask, one kernel call)
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.numel() and not _below_inf(attn_mask):
        fail("attn_mask", "float values that are finite or -inf", "NaN or +inf entries", "use -inf (or a bool mask) for hidden keys")
    if alibi_slopes is not None:
        check_alibi_values(alibi_slopes, query.dtype)
    if sinks is not None:
        check_sink_values(sinks, query.dtype)


def _meta(t: object) -> object:
    """What validation reads of a tensor argument (None for None); :data:`_UNCACHED` for anything
    but a plain dense tensor (a subclass, a nested tensor, which has no shape to read, or no tensor
    at all): such calls are checked in full every time."""
    if t is None:
        return None
    if type(t) is not Tensor or t.is_nested:
        return _UNCACHED
    return (t.shape, t.dtype, t.layout, t.device)


_UNCACHED = object()
_SIGNATURES: dict[tuple, AttentionCall] = {}
_SIGNATURES_MAX = 512  # distinct call signatures a program makes: a handful per layer shape


def check_attention_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
    causal_alignment: object,
    backend: object,
    softcap: object,
    alibi_slopes: object,
    window: object,
    return_stats: object,
    sinks: object = None,
    values: bool = True,
) -> AttentionCall:
    """Validate a call before any compute. Shapes, dtypes, devices and options always; with
    ``values`` (eager mode, see :mod:`attnscale._tracing`) also what needs the tensors' values:
    finite ALiBi slopes and sinks, float-mask entries that are finite or -inf.

    In eager mode a call whose signature (every tensor's shape, dtype, layout and device, every
    option) passed before takes that result, and only the value checks run again: what the
    signature proved is not checked twice."""
    signature = None
    if values:
        tensors = (_meta(query), _meta(key), _meta(value), _meta(attn_mask), _meta(alibi_slopes), _meta(sinks))
        if _UNCACHED not in tensors:  # (a meta is None or a tuple: its == with the marker is identity)
            # identity only: an odd option's == is never asked (its type is in the key)
            options = (dropout_p, is_causal, scale, enable_gqa, causal_alignment, backend, softcap, window, return_stats)
            signature = (*tensors, *map(type, options), *options)
            try:
                call = _SIGNATURES.get(signature)
            except TypeError:  # an option that cannot be a key (a list for window): checked every time
                signature, call = None, None
            if call is not None:
                if attn_mask is not None or alibi_slopes is not None or sinks is not None:
                    _check_values(query, attn_mask, alibi_slopes, sinks)  # type: ignore[arg-type]
                return call
            family = _family(signature, key, value) if signature is not None and attn_mask is None else None
            template = _FAMILIES.get(family) if family is not None else None
            if template is not None and key.shape[-2] == value.shape[-2]:  # (else the full path says why)
                call = _grown(template, key.shape[-2])
                if alibi_slopes is not None or sinks is not None:
                    _check_values(query, None, alibi_slopes, sinks)  # type: ignore[arg-type]
                remember(_SIGNATURES, signature, call)
                return call
    check_tensors(query, key, value)
    H, L, D = query.shape[-3:]
    Hkv, S, Dk = key.shape[-3:]
    Hv, Sv, Dv = value.shape[-3:]
    if Dk != D:
        fail("key", f"last dim D = {D} like the query's", _shape(key), "query and key must share the head dim D")
    if Hkv == 0 and H > 0:  # (no query heads and none of keys: the empty output, as torch gives)
        fail("key", "at least one head (dim -3)", _shape(key), "give key and value Hkv >= 1 heads; check the head split")
    if Sv != S:
        fail("value", f"length S = {S} (dim -2) like the key's", _shape(value), "key and value must have the same number of positions")
    if Hv != Hkv:
        fail("value", f"{Hkv} heads (dim -3) like the key's", _shape(value), "key and value must have the same number of heads")
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    if H != Hkv:
        if not enable_gqa and Hkv != 1:  # one key/value head broadcasts to every query head, as in torch
            fail(
                "key",
                f"{H} heads (dim -3) like the query's",
                f"{Hkv} heads",
                "pass enable_gqa=True for grouped-query attention (a single key/value head broadcasts without it)",
            )
        if Hkv == 0 or H % Hkv != 0:
            fail("key", f"a number of heads that divides the query's {H}", f"{Hkv} heads", "use Hkv in the divisors of H")  # fmt: skip
    try:
        batch = query.shape[:-3]
        if not batch == key.shape[:-3] == value.shape[:-3]:  # broadcast_shapes costs ~0.1 ms a call
            batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    except RuntimeError:
        fail(
            "key",
            f"batch dims broadcastable with the query's {tuple(query.shape[:-3])}",
            f"key {tuple(key.shape[:-3])}, value {tuple(value.shape[:-3])}",
            "make the leading dims equal or 1",
        )
    target = (*batch, H, L, S)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            fail("attn_mask", "None or a torch.Tensor", type(attn_mask).__name__, "pass a bool (True = attend) or float tensor", exc=TypeError)
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES:
            fail("attn_mask", "dtype bool (True = attend) or a float dtype (added to the logits)", f"dtype {attn_mask.dtype}", "use mask.bool() for a 0/1 mask", exc=TypeError)
        if attn_mask.device != query.device:
            fail("attn_mask", f"the query's device {query.device}", f"device {attn_mask.device}", "move it: attn_mask.to(query.device)")
        try:
            ok = torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            fail("attn_mask", f"a shape broadcastable to (..., H, L, S) = {target}", _shape(attn_mask), "use (L, S), (B, 1, L, S) or (B, 1, 1, S) for padding")
    if type(dropout_p) is not float and (isinstance(dropout_p, bool) or not isinstance(dropout_p, Real)):
        fail("dropout_p", "a float in [0, 1)", repr(dropout_p), "pass e.g. dropout_p=0.1, or 0.0 at inference", exc=TypeError)
    if not 0.0 <= float(dropout_p) < 1.0:
        fail("dropout_p", "a float in [0, 1)", repr(dropout_p), "pass e.g. dropout_p=0.1, or 0.0 at inference")
    is_causal = check_bool("is_causal", is_causal)
    scale = check_finite("scale", scale)
    softcap = check_positive_finite("softcap", softcap)
    for arg, value in (("scale", scale), ("softcap", softcap)):
        # Python floats are float64: a value beyond float32's range would become inf in the score path.
        if value is not None and abs(value) > _SCORE_MAX[query.dtype]:
            acc = accumulation_dtype(query.dtype)
            fail(arg, f"a value that fits {acc} (at most {_SCORE_MAX[query.dtype]:.4g}), where {query.dtype} inputs are scored", repr(value), f"pass a smaller {arg}, or float64 inputs")
    alignment = check_choice("causal_alignment", causal_alignment, CausalAlignment)
    backend = check_choice("backend", backend, Backend)
    window = check_window(window)
    return_stats = check_bool("return_stats", return_stats)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor) or alibi_slopes.dtype not in FLOAT_DTYPES:
            fail("alibi_slopes", "a float tensor of shape (H,) or (B, H)", repr(alibi_slopes)[:60], "use attnscale.alibi_slopes(H)", exc=TypeError)
        try:
            ok = torch.broadcast_shapes(alibi_slopes.shape, (*batch, H)) == torch.Size((*batch, H))
        except RuntimeError:
            ok = False
        if not ok or alibi_slopes.ndim == 0:
            fail("alibi_slopes", f"shape (H,) or (B, H) broadcastable to {(*batch, H)}", _shape(alibi_slopes), "use attnscale.alibi_slopes(H)")
        if alibi_slopes.device != query.device:
            fail("alibi_slopes", f"the query's device {query.device}", f"device {alibi_slopes.device}", "move it to the query's device")
    if sinks is not None:
        check_sinks(sinks, H, query.device, values=False)
    if values:
        _check_values(query, attn_mask, alibi_slopes, sinks)
    path = ScorePath(
        # D = 0: every logit is the empty sum 0 whatever the scale (torch's answer: uniform weights);
        # 1 keeps 0 * scale from being 0 * inf
        scale=1.0 if D == 0 else scale if scale is not None else 1.0 / math.sqrt(D),
        softcap=softcap,
        causal=is_causal,
        window=window,
        q_offset=query_offset(L, S, alignment),
    )
    call = AttentionCall(
        batch=tuple(batch),
        H=H,
        Hkv=Hkv,
        L=L,
        S=S,
        D=D,
        Dv=Dv,
        path=path,
        alignment=alignment,
        backend=backend,
        dropout_p=float(dropout_p),
        alibi=alibi_slopes is not None,
        sinks=sinks is not None,
        return_stats=return_stats,
    )
    if signature is not None:
        remember(_SIGNATURES, signature, call)
        family = _family(signature, key, value) if attn_mask is None else None
        if family is not None:
            remember(_FAMILIES, family, call)
    return call


_FAMILIES: dict[tuple, AttentionCall] = {}
"""Validated calls without a mask by their signature less the key length S (the same keys and
values, grown or shrunk along S, as a decoding step over a growing cache makes them): nothing
validation checks turns on S but that k and v share it, and the spec takes it (and, aligned
bottom-right, the query offset S - L)."""


def _family(signature: tuple, key: Tensor, value: Tensor) -> tuple | None:
    """``signature`` with the key's and value's S left out (their metas are its entries 1 and 2;
    None where either has fewer than 2 dims)."""
    k_meta, v_meta = signature[1], signature[2]
    if not (isinstance(k_meta, tuple) and isinstance(v_meta, tuple) and len(k_meta[0]) >= 2 and len(v_meta[0]) >= 2):
        return None
    return (signature[0], (k_meta[0][:-2], k_meta[0][-1], *k_meta[1:]), (v_meta[0][:-2], v_meta[0][-1], *v_meta[1:]), *signature[3:])


def _grown(template: AttentionCall, S: int) -> AttentionCall:
    """The validated call of ``template``'s family whose keys and values hold S positions."""
    path = template.path
    offset = query_offset(template.L, S, template.alignment)
    if offset != path.q_offset:
        path = dataclasses.replace(path, q_offset=offset)
    return template._replace(S=S, path=path, family=template)


def remember(memo: dict, key: object, value: object) -> None:
    """``memo[key] = value`` in a memo bounded at :data:`_SIGNATURES_MAX` entries (cleared when
    full): the validated calls here, and what backends remember per validated call."""
    if len(memo) >= _SIGNATURES_MAX:
        memo.clear()
    memo[key] = value


# --- packed sequences (attnscale.varlen_attention) ----------------------------------------------

_PACKED_LEGEND = {"q": "(total_q, H, D)", "k": "(total_k, Hkv, D)", "v": "(total_k, Hkv, Dv)"}
_CU_FIX = "build it as torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32) from the per-sequence lengths"


def check_packed_call(
    q: object, k: object, v: object, cu_q: object, cu_k: object, max_q: object, max_k: object, *, traced: bool, scale: object, is_causal: object,
    softcap: object, alibi_slopes: object, window: object, sinks: object, return_stats: object, backend: object,
) -> tuple[AttentionCall, list[tuple[int, int, int, int]] | None, Tensor]:
    """Validate a packed call (:func:`attnscale.varlen_attention`) before any compute, reading no
    tensor value while ``traced``. Returns its spec (batch (), L and S the longest query and key
    lengths; while tracing, the totals), its sequences' rows ``(q0, q1, k0, k1)`` (None while
    tracing) and the same as a (B, 4) int64 table.

    In eager mode a call whose signature (every tensor's shape, dtype, layout and device, the
    cumulative lengths' values, every option) passed before takes that result, and only the value
    checks of slopes and sinks run again, as for :func:`check_attention_call`."""
    signature = None
    if not traced:
        metas = (_meta(q), _meta(k), _meta(v), _meta(cu_q), _meta(cu_k), _meta(alibi_slopes), _meta(sinks))
        if _UNCACHED not in metas:
            options = (max_q, max_k, scale, is_causal, softcap, window, return_stats, backend)
            cus = (metas[3], metas[4])  # (shape, dtype, layout, device), or None; readable: integers on q's device (else the full checks say why)
            readable = all(m is not None and m[1] in _CU_DTYPES and m[3] == metas[0][3] for m in cus)  # type: ignore[index]
            small = readable and cu_q.ndim == 1 and cu_k.ndim == 1 and cu_q.numel() <= _PACKED_MEMO_MAX and cu_k.numel() <= _PACKED_MEMO_MAX  # type: ignore[union-attr]
            if small:  # the lengths' values are part of what was validated
                signature = (*metas, *map(type, options), *options, tuple(cu_q.tolist()), tuple(cu_k.tolist()))  # type: ignore[union-attr]
                try:
                    known = _PACKED.get(signature)
                except TypeError:  # an option that cannot be a key: checked every time
                    signature, known = None, None
                if known is not None:
                    if alibi_slopes is not None:
                        check_alibi_values(alibi_slopes, q.dtype)  # type: ignore[arg-type, union-attr]
                    if sinks is not None:
                        check_sink_values(sinks, q.dtype)  # type: ignore[arg-type, union-attr]
                    return known
    checked = _check_packed_call(q, k, v, cu_q, cu_k, max_q, max_k, traced=traced, scale=scale, is_causal=is_causal, softcap=softcap,
                                 alibi_slopes=alibi_slopes, window=window, sinks=sinks, return_stats=return_stats, backend=backend)  # fmt: skip
    if signature is not None:
        remember(_PACKED, signature, checked)
    return checked


_PACKED: dict[tuple, tuple[AttentionCall, list[tuple[int, int, int, int]] | None, Tensor]] = {}
_PACKED_MEMO_MAX = 1025
"""Packed calls of at most this many sequences (plus one) are remembered by their lengths' values."""
_CU_DTYPES = (torch.int32, torch.int64)


def _check_packed_call(
    q: object, k: object, v: object, cu_q: object, cu_k: object, max_q: object, max_k: object, *, traced: bool, scale: object, is_causal: object,
    softcap: object, alibi_slopes: object, window: object, sinks: object, return_stats: object, backend: object,
) -> tuple[AttentionCall, list[tuple[int, int, int, int]] | None, Tensor]:
    H, Hkv, D, Dv = check_packed_tensors(q, k, v)
    assert isinstance(q, Tensor) and isinstance(k, Tensor)
    cu_q_t, cu_k_t = check_cu_seqlens(cu_q, cu_k, q.device)
    rows, L, S = None, q.shape[0], k.shape[0]
    if traced:
        check_sequence_count(cu_q_t, cu_k_t)
    else:  # each one's values first, then their count
        starts_q, starts_k = cu_seqlens_values("cu_seqlens_q", cu_q_t, "q", q.shape[0]), cu_seqlens_values("cu_seqlens_k", cu_k_t, "k", k.shape[0])
        check_sequence_count(cu_q_t, cu_k_t)
        rows = [(starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]) for b in range(len(starts_q) - 1)]
        L, S = max((q1 - q0 for q0, q1, _, _ in rows), default=0), max((k1 - k0 for _, _, k0, k1 in rows), default=0)
    check_max_seqlen("max_seqlen_q", max_q, None if traced else L, "cu_seqlens_q")
    check_max_seqlen("max_seqlen_k", max_k, None if traced else S, "cu_seqlens_k")
    scale = check_finite("scale", scale)
    path = ScorePath(scale=1.0 / math.sqrt(D) if scale is None else scale, softcap=check_positive_finite("softcap", softcap), causal=check_bool("is_causal", is_causal), window=check_window(window))
    return_stats, backend = check_bool("return_stats", return_stats), check_choice("backend", backend, Backend)
    if alibi_slopes is not None:
        check_packed_slopes(alibi_slopes, H, cu_q_t.shape[0] - 1, q.device)
        if not traced:
            check_alibi_values(alibi_slopes, q.dtype)  # type: ignore[arg-type]  # the same rule as scaled_dot_product_attention's
    check_sinks(sinks, H, q.device, values=not traced, dtype=q.dtype)
    spec = AttentionCall(
        batch=(), H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv, path=path, alignment=CausalAlignment.BOTTOM_RIGHT, backend=backend,  # type: ignore[arg-type]
        dropout_p=0.0, alibi=alibi_slopes is not None, sinks=sinks is not None, return_stats=return_stats,
    )  # fmt: skip
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4) if rows is not None else torch.stack([cu_q_t[:-1], cu_q_t[1:], cu_k_t[:-1], cu_k_t[1:]], dim=1).to(torch.int64)
    return spec, rows, table


def check_packed_tensors(q: object, k: object, v: object) -> tuple[int, int, int, int]:
    """q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), H a multiple of Hkv: returns H, Hkv, D, Dv."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float_tensor(name, t)
        assert isinstance(t, Tensor)
        if t.ndim != 3:
            fail(name, f"3 dims {_PACKED_LEGEND[name]}, sequences packed along dim 0", _shape(t), f"pack (B, L, heads, dim) as {name}.flatten(0, 1) and drop the padding rows")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    for name, t in (("k", k), ("v", v)):
        _check_like(name, t, q, "q's")
    _, H, D = q.shape
    total_k, Hkv, Dk = k.shape
    if D == 0:
        fail("q", "head_dim D >= 1 (dim 2)", _shape(q), "D = 0 has no dot product; check the head split")
    if Dk != D:
        fail("k", f"head dim D = {D} (dim 2) like q's", _shape(k), "q and k must share the head dim D")
    if Hkv == 0:
        fail("k", "at least one head (dim 1)", _shape(k), "give k and v Hkv >= 1 heads; check the head split")
    if v.shape[0] != total_k:
        fail("v", f"total_k = {total_k} rows (dim 0) like k's", _shape(v), "k and v must hold the same packed key positions")
    if v.shape[1] != Hkv:
        fail("v", f"{Hkv} heads (dim 1) like k's", _shape(v), "k and v must have the same number of heads")
    if H % Hkv != 0:
        fail("k", f"a number of heads (dim 1) that divides q's H = {H}", f"{Hkv} heads", "use Hkv in the divisors of H (Hkv = H for multi-head, 1 for multi-query)")
    return H, Hkv, D, v.shape[2]


def check_cu_seqlens(cu_q: object, cu_k: object, device: torch.device) -> tuple[Tensor, Tensor]:
    """What can be checked of both cumulative lengths without their values: type, dtype, shape, device."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, Tensor):
            fail(name, "a 1-d int32 or int64 torch.Tensor", type(cu).__name__, _CU_FIX, exc=TypeError)
        if cu.dtype not in (torch.int32, torch.int64):
            fail(name, "dtype int32 or int64", f"dtype {cu.dtype}", f"cast it: {name}.to(torch.int32)", exc=TypeError)
        if cu.ndim != 1 or cu.numel() == 0:
            fail(name, "a 1-d tensor of B + 1 cumulative lengths", _shape(cu), _CU_FIX)
        if cu.device != device:
            fail(name, f"q's device {device}", f"device {cu.device}", f"move it: {name}.to(q.device)")
    assert isinstance(cu_q, Tensor) and isinstance(cu_k, Tensor)
    return cu_q, cu_k


def check_sequence_count(cu_q: Tensor, cu_k: Tensor) -> None:
    if cu_q.shape[0] != cu_k.shape[0]:
        entries = cu_q.shape[0]
        fail("cu_seqlens_k", f"B + 1 = {entries} entries like cu_seqlens_q (one per sequence, plus the 0)", f"{cu_k.shape[0]} entries", "give every sequence a query and a key length (0 is allowed)")


def cu_seqlens_values(name: str, cu: Tensor, packed: str, total: int) -> list[int]:
    """Cumulative lengths ``[0, ..., total]`` of the rows of ``packed``, read from the tensor (eager only)."""
    values = cu.tolist()
    if values[0] != 0:
        fail(name, "a first entry of 0", f"{values[0]} (in {values})", _CU_FIX)
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            fail(name, "non-decreasing entries (sequence lengths >= 0)", f"{values[b]} then {values[b + 1]} at index {b}", _CU_FIX)
    if values[-1] != total:
        fail(name, f"a last entry equal to total_{packed} = {packed}.shape[0] = {total}", f"{values[-1]}", f"give lengths that sum to {packed}'s {total} packed rows")
    return values


def check_max_seqlen(name: str, hint: object, longest: int | None, cu_name: str) -> None:
    """An optional hint of the longest length: None or an int, at least ``longest`` (None: unknown, while tracing)."""
    if hint is None:
        return
    if isinstance(hint, bool) or not isinstance(hint, Integral):
        fail(name, "None or an int", repr(hint), "pass the longest length as an int, or None to leave it out", exc=TypeError)
    if longest is not None and hint < longest:
        fail(name, f"at least the longest sequence in {cu_name}, {longest}", repr(int(hint)), f"pass {name}={longest} or None")


def check_packed_slopes(slopes: object, H: int, B: int, device: torch.device) -> None:
    """ALiBi slopes of a packed call: (H,), or (B, H) one row per sequence (shapes, dtype, device)."""
    shapes = f"(H,) = ({H},) or (B, H) = ({B}, {H})"
    if not isinstance(slopes, Tensor) or slopes.dtype not in FLOAT_DTYPES:
        fail("alibi_slopes", f"a float tensor of shape {shapes}", repr(slopes)[:60], "use attnscale.alibi_slopes(H)", exc=TypeError)
    # size by size, not tuple against tuple: under dynamic shapes the sizes are symbolic
    if not ((slopes.ndim == 1 and slopes.shape[0] == H) or (slopes.ndim == 2 and slopes.shape[0] == B and slopes.shape[1] == H)):
        fail("alibi_slopes", f"shape {shapes}", _shape(slopes), "use attnscale.alibi_slopes(H), or stack one row per sequence")
    if slopes.device != device:
        fail("alibi_slopes", f"q's device {device}", f"device {slopes.device}", "move it: alibi_slopes.to(q.device)")
