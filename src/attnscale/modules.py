"""``MultiHeadAttention``: projections around :func:`attnscale.scaled_dot_product_attention`,
with grouped-query attention, a KV cache for incremental decoding, and ``from_torch``.

Shape legend (the one used across attnscale)::

    B batch, L query length, S key length (cached + new keys when a cache is used),
    E = d_model, H query heads, Hkv key/value heads, G = H // Hkv, D = head_dim

Masks use the attnscale polarity, **True = attend**, everywhere. This is the OPPOSITE of
``torch.nn.MultiheadAttention``, whose bool ``key_padding_mask`` and ``attn_mask`` mark the
positions to *ignore*: when porting code (``from_torch``), pass ``key_mask=~key_padding_mask``
and ``attn_mask=~attn_mask`` for bool masks (float masks are added in both and need no change).

Variants (RoPE, ALiBi, QK-Norm, learned or length-dependent scales, softcap, windows, linear /
Performer / INT8 kernels) are chosen by an :class:`attnscale.AttentionConfig`; the order in which
forward applies them is documented in ``attnscale._variant_stack``.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module_hooks

from . import _remembered as memory
from ._validate import FLOAT_DTYPES, Backend, check_attention_call, check_bool, check_choice, check_positive_finite, fail
from ._variant_stack import VariantStack, effective_scale
from .config import AttentionConfig, AttentionKernel, ScaleMode
from .dense import dense_weights
from .functional import record_backend, scaled_dot_product_attention
from .kernels import CHECKS_MAX
from .masks import CausalAlignment, query_offset
from .score import ScorePath
from .stats import AttentionStats

__all__ = ["AttentionOutput", "KVCache", "MultiHeadAttention"]

_transforms_active = torch._C._are_functorch_transforms_active
_SDPA = scaled_dot_product_attention
"""attnscale.scaled_dot_product_attention, which the forward calls by this module's global name."""


@dataclass(frozen=True)
class AttentionOutput:
    """What ``MultiHeadAttention.forward`` returns when ``need_weights`` or ``return_stats`` is set.

    Attributes:
        output: (B, L, E), or (L, B, E) when ``batch_first=False``.
        weights: softmax weights (B, H, L, S), or (B, L, S) with ``average_attn_weights=True``;
            None unless ``need_weights``.
        stats: :class:`AttentionStats`, each field (B, H, L); None unless ``return_stats``.
    """

    output: Tensor
    weights: Tensor | None = None
    stats: AttentionStats | None = None


class KVCache:
    """Projected keys and values of earlier decoding steps, each (B, Hkv, S_cached, D).

    Keys are stored as attention uses them: after QK-Norm and RoPE (rotated at their absolute
    positions) when the module's config has them.

    Start with an empty ``KVCache()`` and pass the same object as ``cache=`` to every step:
    ``forward`` appends the step's projected keys and values, then attends over all of them.
    With ``is_causal=True`` the step's L queries are the last L positions (bottom-right causal
    alignment), so feeding a sequence token by token, or in chunks, gives the full-sequence
    causal output. Tensors are kept as given, with their autograd history: decode under
    ``torch.no_grad()`` unless gradients through the cache are wanted.

    Where no gradient flows (grad mode off, or no tensor that requires grad), an append writes into
    room kept behind the cached positions, which doubles when full, so a decoding step copies only
    its own keys and values (amortised), not the whole cache as a concatenation does; ``keys`` and
    ``values`` are then views of the first ``len(cache)`` positions of that room (a tensor that
    requires grad is concatenated, as autograd needs). Views handed out earlier keep their values:
    an append writes only behind them. Assigning ``keys`` or ``values`` is respected: the next
    append starts new room from them.
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None  # (B, Hkv, S_cached, D)
        self.values: Tensor | None = None  # (B, Hkv, S_cached, D)
        self._room: tuple[Tensor, Tensor, int] | None = None  # (B, Hkv, capacity, D) each, and the positions written: keys and values are views of them

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def reset(self) -> None:
        """Forget every cached position."""
        self.keys = None
        self.values = None
        self._room = None

    def check_compatible(self, keys: Tensor) -> None:
        """Raise unless ``keys`` (B, Hkv, S_new, D) can be appended to this cache."""
        if self.keys is None:
            return
        cached = self.keys
        if (cached.shape[0], cached.shape[1], cached.shape[3]) != (keys.shape[0], keys.shape[1], keys.shape[3]):
            fail(
                "cache",
                f"cached keys with (B, Hkv, D) = {(keys.shape[0], keys.shape[1], keys.shape[3])} like this step's",
                f"cached shape {tuple(cached.shape)}",
                "use one KVCache per sequence batch and module, or call cache.reset()",
            )
        if cached.dtype != keys.dtype or cached.device != keys.device:
            fail(
                "cache",
                f"cached keys of dtype {keys.dtype} on {keys.device} like this step's",
                f"dtype {cached.dtype} on {cached.device}",
                "call cache.reset() after moving or casting the module",
            )

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append (B, Hkv, S_new, D) keys and values; return all of them, (B, Hkv, S_cached + S_new, D)."""
        self.check_compatible(keys)
        cached_keys, cached_values = self.keys, self.values
        if cached_keys is None or cached_values is None:
            self.keys, self.values, self._room = keys, values, None
        elif torch.is_grad_enabled() and any(t.requires_grad for t in (cached_keys, cached_values, keys, values)):
            self.keys = torch.cat([cached_keys, keys], dim=-2)  # (B, Hkv, S, D), with autograd history
            self.values = torch.cat([cached_values, values], dim=-2)
            self._room = None
        else:
            self.keys, self.values = self._write(cached_keys, cached_values, keys, values)
        return self.keys, self.values

    def _write(self, cached_keys: Tensor, cached_values: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The cached and new positions as views of the room, the new ones written into it (new
        room, twice what they need, where the old is too small, was made under ``torch.inference_mode``
        and this append is outside it, or the cached tensors are not the views of all it holds: the
        first append, tensors a caller assigned, or a shortened view, behind which positions handed
        out before must keep their values)."""
        S, end = cached_keys.shape[-2], cached_keys.shape[-2] + keys.shape[-2]
        room = self._room
        ours = room is not None and room[2] == S and _views_of(cached_keys, room[0], S) and _views_of(cached_values, room[1], S)
        writable = room is not None and (torch.is_inference_mode_enabled() or not room[0].is_inference())  # (made under inference_mode: read-only outside it)
        if room is None or not ours or not writable or room[0].shape[-2] < end:
            capacity = 2 * end
            room = (
                cached_keys.new_empty(*cached_keys.shape[:-2], capacity, cached_keys.shape[-1]),
                cached_values.new_empty(*cached_values.shape[:-2], capacity, cached_values.shape[-1]),
                S,
            )
            room[0][..., :S, :].copy_(cached_keys)
            room[1][..., :S, :].copy_(cached_values)
        room[0][..., S:end, :].copy_(keys)
        room[1][..., S:end, :].copy_(values)
        self._room = (room[0], room[1], end)
        return room[0][..., :end, :], room[1][..., :end, :]


def _views_of(cached: Tensor, room: Tensor, S: int) -> bool:
    """Whether ``cached`` is the view of ``room``'s first S positions that an append handed out."""
    return cached.data_ptr() == room.data_ptr() and cached.stride() == room.stride() and cached.shape == (*room.shape[:-2], S, room.shape[-1])


def _hooked(modules: tuple[nn.Module, ...]) -> bool:
    """Whether calling these modules runs more than their class's ``forward``: a hook of theirs or
    a global one (forward or backward, as ``nn.Module.__call__`` asks), a ``forward`` set on the
    instance (as accelerate's hooks set it), or ``module.compile()``'s compiled call."""
    hooks = _module_hooks
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks or hooks._global_backward_pre_hooks:
        return True
    for m in modules:  # (a loop, not any() over a generator: a hot path)
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks or "forward" in m.__dict__ or m._compiled_call_impl is not None:
            return True
    return False


def _call_linear(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)``; for a plain ``Linear`` that runs nothing but its forward (:func:`_hooked`)
    its ``F.linear`` directly (what ``nn.Module.__call__`` would run, without its bookkeeping: a
    hot path)."""
    if type(module) is nn.Linear and not _hooked((module,)):
        return F.linear(x, module._parameters["weight"], module._parameters["bias"])
    return module(x)


def _consecutive(parts: tuple[Tensor | None, ...]) -> Tensor | None:
    """One tensor over ``parts`` where they are consecutive rows of one storage, as
    :meth:`MultiHeadAttention._pack_projections` lays them out (a view: nothing is copied), else
    None: a part missing, not a plain contiguous ``Parameter``, or in memory of its own."""
    first = parts[0]
    if type(first) is not nn.Parameter or not first.is_contiguous():
        return None
    end, rows = first.data_ptr(), 0
    for part in parts:
        if (
            type(part) is not nn.Parameter or part.data_ptr() != end or not part.is_contiguous()
            or part.dtype != first.dtype or part.device != first.device or part.shape[1:] != first.shape[1:]
        ):  # fmt: skip
            return None
        end += part.numel() * part.element_size()
        rows += part.shape[0]
    sizes = (rows, *first.shape[1:])
    strides = [1] * len(sizes)  # the contiguous strides of the sizes (a part of one row may carry any stride in its first dim)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    try:  # a view of the first part's storage, past its own rows: the storage's bounds are checked
        return first.detach().as_strided(sizes, strides)
    except RuntimeError:  # the rows after it are another storage's that happens to follow in memory
        return None


def _check_dim(arg: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        fail(arg, "a positive int", repr(value), f"pass e.g. {arg}=64")
    return int(value)


def _check_optional_dim(arg: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        fail(arg, "a positive int or None", repr(value), f"pass e.g. {arg}=64, or None for the default")
    return int(value)


def _check_input(arg: str, t: object, width: int, width_name: str, batch_first: bool, dtype: torch.dtype) -> Tensor:
    layout = "(B, L, E)" if batch_first else "(L, B, E)"
    if not isinstance(t, Tensor):
        fail(arg, "a torch.Tensor", type(t).__name__, f"convert with torch.as_tensor({arg})", exc=TypeError)
    if t.ndim != 3 or t.shape[-1] != width:
        fail(arg, f"shape {layout} with E = {width_name} = {width}", f"shape {tuple(t.shape)}", f"pass a 3-dim {layout} tensor")
    if t.dtype != dtype:
        fail(arg, f"the module's dtype {dtype}", f"dtype {t.dtype}", f"cast it ({arg}.to({dtype})) or the module", exc=TypeError)
    return t


def _resolve_alignment(causal_alignment: object, *, with_cache: bool) -> CausalAlignment:
    if causal_alignment is None:
        return CausalAlignment.BOTTOM_RIGHT if with_cache else CausalAlignment.TOP_LEFT
    alignment = check_choice("causal_alignment", causal_alignment, CausalAlignment)
    if with_cache and alignment is not CausalAlignment.BOTTOM_RIGHT:
        fail("causal_alignment", "'bottom_right' (or None) with a cache", repr(causal_alignment), "new queries follow the cached ones; drop the argument")
    return CausalAlignment(alignment)


def _check_key_mask(key_mask: object, B: int, S: int, device: torch.device, *, with_cache: bool) -> None:
    if key_mask is None:
        return
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
        got = f"dtype {key_mask.dtype}" if isinstance(key_mask, Tensor) else type(key_mask).__name__
        fail("key_mask", "a bool tensor (B, S), True = real token", got, "for a torch key_padding_mask pass ~key_padding_mask", exc=TypeError)
    if tuple(key_mask.shape) != (B, S):
        counted = " (S counts the cached keys)" if with_cache else ""
        fail("key_mask", f"shape (B, S) = {(B, S)}{counted}", f"shape {tuple(key_mask.shape)}", "one entry per key, True = real token")
    if key_mask.device != device:
        fail("key_mask", f"the query's device {device}", f"device {key_mask.device}", "move it: key_mask.to(query.device)")


def _merge_masks(attn_mask: Tensor | None, key_mask: Tensor | None) -> Tensor | None:
    """One mask for SDPA: bool (True = attend) or float (added), broadcastable to (B, H, L, S)."""
    if key_mask is None:
        return attn_mask
    keep = key_mask[:, None, None, :]  # (B, 1, 1, S)
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return torch.where(keep, attn_mask, float("-inf"))


def _attention_weights(
    q: Tensor, k: Tensor, mask: Tensor | None, path: ScorePath, alibi_slopes: Tensor | None, sinks: Tensor | None
) -> Tensor:
    """Softmax weights (B, H, L, S) for validated q (B, H, L, D), k (B, Hkv, S, D): the math
    backend's own weights, so ``weights @ v`` is the output of ``backend="math"``. With sinks a
    row's weights sum to one minus the sink's share."""
    weights, _ = dense_weights(q, k, path=path, attn_mask=mask, alibi_slopes=alibi_slopes, sinks=sinks)
    return weights  # (B, H, L, S)


def _resolve_config(config: object, scale: float | None) -> AttentionConfig:
    if config is None:
        config = AttentionConfig()
    if not isinstance(config, AttentionConfig):
        fail("config", "None or an attnscale.AttentionConfig", type(config).__name__, "pass config=attnscale.AttentionConfig(...)", exc=TypeError)
    if scale is None:
        return config
    if config.scale is not ScaleMode.INVERSE_SQRT:
        fail("scale", f"None when config.scale is {config.scale.value!r} (two scales would conflict)", repr(scale), "drop scale=, or set the scale in the config (scale='fixed', fixed_scale=...)")
    return config.with_fixed_scale(scale)


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention with the per-head scale ``1/sqrt(head_dim)``, GQA/MQA and a KV cache.

    ::

        q = q_proj(query)  -> (B, H, L, D)      D = head_dim = d_model // num_heads by default
        k = k_proj(key)    -> (B, Hkv, S, D)    key defaults to query (self-attention)
        v = v_proj(value)  -> (B, Hkv, S, D)
        out = out_proj(concat_h scaled_dot_product_attention(q, k, v, scale=scale))

    The default ``scale`` is ``1/sqrt(head_dim)`` = ``1/sqrt(d_model / num_heads)``: the d_k of the
    formula is the **per-head** dimension, never ``d_model``. Pass ``scale=`` to override it (e.g.
    ``scale=1.0`` for no scaling, or ``scale=d_model ** -0.5``).

    ``config`` (:class:`attnscale.AttentionConfig`) selects a variant; with the default (None)
    the module is exactly the plain one above. Its ``forward`` then runs, in this order::

        projections -> qk_norm -> rope -> (keys join the cache) -> temperature / length factor
        folded into q -> kernel: scaled_dot_product_attention(scale, softcap, ALiBi, window)
                                 or linear / Performer / INT8 attention

    RoPE rotates the normalised q and k (Qwen3, OLMo 2), query row i at its aligned position
    ``i' = i + q_offset`` (the one causal masks, windows and ALiBi use: ``S_cached`` when decoding)
    and new key j at ``S_cached + j``; the cache keeps keys normalised and rotated. The scale acts
    last, on the logits of the normalised, rotated vectors.

    Args:
        d_model: model width E of the query and of the output.
        num_heads: H, the number of query heads.
        num_kv_heads: Hkv, key/value heads; must divide H. ``None`` means H (multi-head);
            1 is multi-query attention, anything in between grouped-query attention
            (query head h reads key/value head ``h // (H // Hkv)``).
        head_dim: D; ``None`` means ``d_model // num_heads``, which must then divide exactly.
        bias: whether the four projections have biases.
        dropout: dropout probability on the attention weights, active in training mode only.
        batch_first: inputs and outputs are (B, L, E) if True, (L, B, E) if False (like torch).
        scale: finite positive multiplier of q.k; ``None`` means ``1/sqrt(head_dim)``. The same
            as ``config.with_fixed_scale(scale)``; rejected when ``config.scale`` is not the
            default ``"inverse_sqrt"``.
        config: the attention variant; ``None`` means ``AttentionConfig()``, standard attention.
        kdim: width of ``key`` for cross-attention (default ``d_model``).
        vdim: width of ``value`` for cross-attention (default ``d_model``).

    Projections are ``nn.Linear`` with its default initialisation; the q, k and v projections'
    weights are views of one tensor, as torch's packed ``in_proj`` (each still its own
    ``Parameter`` and state-dict entry), so that self-attention without gradient projects in one
    matrix product. ``self.scale`` is the float multiplier the kernel receives (learned and
    length-dependent factors are folded into q; see :mod:`attnscale.config`); ``self.config`` is
    the resolved config and ``self.variant`` holds its parts (QK-Norm gains, learned scales, the
    Performer projection).

    >>> import torch, attnscale
    >>> mha = attnscale.MultiHeadAttention(64, num_heads=8, num_kv_heads=2)
    >>> mha.scale == 1 / 8 ** 0.5  # head_dim = 64 / 8
    True
    >>> mha(torch.randn(2, 5, 64), is_causal=True).shape
    torch.Size([2, 5, 64])
    >>> cfg = attnscale.AttentionConfig(positional="rope", qk_norm="rms", window=(16, 0))
    >>> qwen_like = attnscale.MultiHeadAttention(64, num_heads=8, num_kv_heads=2, config=cfg)
    >>> qwen_like(torch.randn(2, 5, 64), is_causal=True).shape
    torch.Size([2, 5, 64])
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = True,
        *,
        scale: float | None = None,
        config: AttentionConfig | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d_model = _check_dim("d_model", d_model)
        num_heads = _check_dim("num_heads", num_heads)
        num_kv_heads = _check_optional_dim("num_kv_heads", num_kv_heads) or num_heads
        if num_heads % num_kv_heads != 0:
            fail("num_kv_heads", f"a divisor of num_heads = {num_heads}", num_kv_heads, "use 1 (MQA), num_heads (MHA) or a divisor in between (GQA)")
        head_dim = _check_optional_dim("head_dim", head_dim)
        if head_dim is None:
            if d_model % num_heads != 0:
                fail("num_heads", f"a divisor of d_model = {d_model}", num_heads, "choose num_heads dividing d_model, or pass head_dim explicitly")
            head_dim = d_model // num_heads
        check_bool("bias", bias)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            fail("dropout", "a float in [0, 1)", repr(dropout), "pass e.g. dropout=0.1, or 0.0")
        check_bool("batch_first", batch_first)
        resolved_scale = check_positive_finite("scale", scale)
        kdim = _check_optional_dim("kdim", kdim) or d_model
        vdim = _check_optional_dim("vdim", vdim) or d_model
        if dtype is not None and dtype not in FLOAT_DTYPES:
            fail("dtype", "None or a floating dtype", dtype, "pass e.g. dtype=torch.float32", exc=TypeError)
        config = _resolve_config(config, resolved_scale)
        if config.kernel is not AttentionKernel.SOFTMAX and dropout > 0.0:
            fail("dropout", f"0.0 with kernel={config.kernel.value!r} (dropout acts on softmax weights)", repr(dropout), "pass dropout=0.0, or use kernel='softmax'")

        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.kdim, self.vdim = kdim, vdim
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.config = config
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias, **factory)
        self.variant = VariantStack(config, num_heads=num_heads, head_dim=head_dim, factory=factory)
        self.scale: float = effective_scale(config, head_dim)
        # config.sinks: one learned logit per query head in every softmax denominator (gpt-oss);
        # at 0 a sink takes 1 / (n + 1) of a row whose n keys all have logit 0.
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if config.sinks else None
        self._packed: tuple[list, tuple[Tensor, Tensor | None] | None] | None = None  # (see _packed_projection)
        self._pack_projections()

    def _pack_projections(self) -> None:
        """Lay the q, k and v projections' weights out as consecutive rows of one tensor, and
        their biases likewise, each ``Linear`` keeping its own ``Parameter`` (a view of it: the
        state dict, optimizers and ``from_torch`` see three projections as before). Self-attention
        that needs no gradient of them then projects in one matrix product, as torch's packed
        ``in_proj`` does (:meth:`_project`). Run at construction and after every ``_apply``
        (``.to()``, ``.half()``, ...), which gives each parameter memory of its own; where the
        widths differ (``kdim``, ``vdim``) or a projection is not a plain ``Linear`` nothing moves."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if self.kdim != self.d_model or self.vdim != self.d_model or any(type(p) is not nn.Linear for p in projections):
            return
        for parts in ([p.weight for p in projections], [p.bias for p in projections]):
            if any(type(t) is not nn.Parameter for t in parts) or _consecutive(tuple(parts)) is not None:
                continue
            if len({(t.dtype, t.device, t.shape[1:]) for t in parts}) != 1:
                continue
            packed = torch.cat([t.detach() for t in parts])  # (rows of q, k, v, ...)
            start = 0
            for t in parts:  # the same Parameter objects: anything holding them holds the views
                t.data = packed[start : start + t.shape[0]]
                start += t.shape[0]

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  (nn.Module's signature)
        applied = super()._apply(fn, recurse)
        self._packed = None  # (views of the memory the parameters left)
        self._pack_projections()
        return applied

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_packed": None}  # a copy or a pickle carries no views of the parameters

    def __setstate__(self, state: dict) -> None:
        super().__setstate__({"_packed": None, **state})
        self._pack_projections()  # copy.deepcopy clones each parameter apart

    def _packed_projection(self) -> tuple[Tensor, Tensor | None] | None:
        """The packed q, k, v weight ((H + 2 Hkv) D, E) and bias, views of the projections'
        parameters where they are consecutive in memory and the projections plain ``Linear`` that
        run nothing but their forward (:func:`_hooked`), else None. Remembered with what it was
        built from (each parameter's address, dtype and shape): the memory it views is the
        parameters' own, kept no longer than until a call finds them moved (``_apply`` lets go at
        once)."""
        modules = self._modules  # (no nn.Module.__getattr__: a hot path)
        projections = (modules["q_proj"], modules["k_proj"], modules["v_proj"])
        if not type(projections[0]) is type(projections[1]) is type(projections[2]) is nn.Linear or _hooked(projections):
            return None
        pq, pk, pv = projections[0]._parameters, projections[1]._parameters, projections[2]._parameters
        wq, bq, wk, bk, wv, bv = pq["weight"], pq["bias"], pk["weight"], pk["bias"], pv["weight"], pv["bias"]
        key = [(t.data_ptr(), t.dtype, t.shape) for t in (wq, bq, wk, bk, wv, bv) if t is not None and type(t) is nn.Parameter]
        if len(key) != 6 - (bq is None) - (bk is None) - (bv is None):  # (a tensor subclass's, a fake tensor's address is not read)
            return None
        if self._packed is not None and self._packed[0] == key:
            return self._packed[1]
        found = None
        biased = (bq is not None) + (bk is not None) + (bv is not None)  # all three or none
        weight, bias = _consecutive((wq, wk, wv)), _consecutive((bq, bk, bv)) if biased == 3 else None
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        rows = (H * D, Hkv * D, Hkv * D)  # each part's, where the split of the packed product takes them
        if (
            weight is not None and weight.ndim == 2 and (biased == 0 or bias is not None)
            and (wq.shape[0], wk.shape[0], wv.shape[0]) == rows and (biased == 0 or (bias.ndim == 1 and (bq.shape[0], bk.shape[0], bv.shape[0]) == rows))
        ):  # fmt: skip
            found = (weight, bias)
        self._packed = (key, found)
        return found

    def _project(self, query: Tensor, key: Tensor, value: Tensor, *, self_attention: bool) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, L, D), k (B, Hkv, S_new, D), v (B, Hkv, S_new, D) from (B, L, E) query and
        (B, S_new, kdim / vdim) key and value: one matrix product over the packed weights
        (:meth:`_pack_projections`) for self-attention whose projections need no gradient, outside
        tracing and torch.func transforms; otherwise each ``Linear`` itself."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        packed = None
        if self_attention and not (torch.is_grad_enabled() or torch.compiler.is_compiling() or _transforms_active()):
            packed = self._packed_projection()
        if packed is not None:
            heads = F.linear(query, *packed).view(*query.shape[:2], H + 2 * Hkv, D).transpose(1, 2)  # (B, H + 2 Hkv, L, D)
            return heads.split_with_sizes((H, Hkv, Hkv), 1)  # type: ignore[return-value]  (three views)
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        return q.unflatten(-1, (H, D)).transpose(1, 2), k.unflatten(-1, (Hkv, D)).transpose(1, 2), v.unflatten(-1, (Hkv, D)).transpose(1, 2)

    def _remembered_forward(self, query: object) -> Tensor | None:
        """The forward of a plain self-attention call (every argument but ``query`` at its
        default) in one compiled call, where the forward below would take the packed projection
        (:meth:`_project`) and its call of :func:`attnscale.scaled_dot_product_attention` would
        take a remembered answer (:mod:`attnscale._remembered`): the same ops on the same tensors
        (``remembered_module_call`` in ``kernels/fused.cpp``, which finds the projections packed
        as :func:`_consecutive` does, and answers None for a query the checks of the forward below
        would refuse). None elsewhere, and where the attention is not remembered or its checks of
        values do not pass: then the forward below runs."""
        remembered = memory.module_call
        if remembered is None or torch.is_grad_enabled() or not memory.may_take(self.dropout if self.training else 0.0, Backend.AUTO):
            return None
        if scaled_dot_product_attention is not _SDPA:  # (replaced, as attnscale.monitor replaces it: the forward below calls the replacement)
            return None
        modules = self._modules  # (no nn.Module.__getattr__: a hot path)
        if not modules["variant"].identity:  # (softmax attention of q and k as projected)
            return None
        projections = (modules["q_proj"], modules["k_proj"], modules["v_proj"], modules["out_proj"])
        if not type(projections[0]) is type(projections[1]) is type(projections[2]) is type(projections[3]) is nn.Linear or _hooked(projections):
            return None
        if not self.batch_first:
            if not isinstance(query, Tensor):
                return None
            query = query.transpose(0, 1)  # (B, L, E)
        pq, pk, pv, po = projections[0]._parameters, projections[1]._parameters, projections[2]._parameters, projections[3]._parameters
        H, Hkv = self.num_heads, self.num_kv_heads
        hit = remembered(
            query, pq["weight"], pq["bias"], pk["weight"], pk["bias"], pv["weight"], pv["bias"], po["weight"], po["bias"], H, Hkv, self.head_dim,
            self.scale, Hkv != H, CausalAlignment.TOP_LEFT, self.config.softcap, self.config.window, self.sinks, CHECKS_MAX,
        )  # fmt: skip  (by position, in the binding's order: a hot path)
        if hit is None:
            return None
        out, backend, why = hit
        record_backend(backend, why)
        return out if self.batch_first else out.transpose(0, 1)  # (B, L, E) or (L, B, E)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> MultiHeadAttention:
        """A copy of ``torch.nn.MultiheadAttention``'s weights, layout, dropout and train/eval mode.

        The result computes what ``mha`` computes, with attnscale's mask polarity: call it with
        ``key_mask=~key_padding_mask`` and ``attn_mask=~attn_mask`` (bool masks), and
        ``average_attn_weights=True`` to get torch's default head-averaged weights. Torch's
        ``add_bias_kv`` and ``add_zero_attn`` have no counterpart and are rejected.

        >>> import torch, attnscale
        >>> mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        >>> ours = attnscale.MultiHeadAttention.from_torch(mha)
        >>> x = torch.randn(2, 3, 16)
        >>> torch.allclose(ours(x), mha(x, x, x, need_weights=False)[0], atol=1e-6)
        True
        """
        if not isinstance(mha, nn.MultiheadAttention):
            fail("mha", "a torch.nn.MultiheadAttention", type(mha).__name__, "pass the torch module itself", exc=TypeError)
        if mha.bias_k is not None or mha.bias_v is not None:
            fail("mha", "a module built with add_bias_kv=False", "add_bias_kv=True", "attnscale has no learned extra key/value; retrain without it")
        if mha.add_zero_attn:
            fail("mha", "a module built with add_zero_attn=False", "add_zero_attn=True", "attnscale has no zero-attention slot; use key_mask for padding")
        weight = mha.out_proj.weight
        bias = mha.in_proj_bias is not None
        ours = cls(
            mha.embed_dim,
            mha.num_heads,
            bias=bias,
            dropout=float(mha.dropout),
            batch_first=mha.batch_first,
            kdim=mha.kdim,
            vdim=mha.vdim,
            device=weight.device,
            dtype=weight.dtype,
        )
        if mha.in_proj_weight is not None:
            wq, wk, wv = mha.in_proj_weight.chunk(3)  # each (E, E)
        else:
            wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
        with torch.no_grad():
            for proj, w in ((ours.q_proj, wq), (ours.k_proj, wk), (ours.v_proj, wv), (ours.out_proj, weight)):
                proj.weight.copy_(w)
            if bias:
                bq, bk, bv = mha.in_proj_bias.chunk(3)  # each (E,)
                for proj, b in ((ours.q_proj, bq), (ours.k_proj, bk), (ours.v_proj, bv), (ours.out_proj, mha.out_proj.bias)):
                    proj.bias.copy_(b)
        return ours.train(mha.training)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.6g}, dropout={self.dropout}, batch_first={self.batch_first}"
        )

    def _batch_first_inputs(self, query: object, key: object, value: object) -> tuple[Tensor, Tensor, Tensor]:
        """Validated (B, L, E) query and (B, S, kdim) / (B, S, vdim) key and value views."""
        projection = self._modules["q_proj"]  # (its weight's dtype without two nn.Module.__getattr__ where it is a Parameter: a hot path)
        weight = projection._parameters.get("weight") if type(projection) is nn.Linear else None
        dtype = (projection.weight if weight is None else weight).dtype
        query = _check_input("query", query, self.d_model, "d_model", self.batch_first, dtype)
        if key is None and value is None:  # self-attention: key and value are the query
            query = query if self.batch_first else query.transpose(0, 1)  # (B, L, E)
            return query, query, query
        if (key is None) != (value is None):
            missing = "value" if value is None else "key"
            fail(missing, "a tensor when the other of key/value is given", "None", "pass both key and value, or neither for self-attention")
        key = _check_input("key", key, self.kdim, "kdim", self.batch_first, dtype)
        value = _check_input("value", value, self.vdim, "vdim", self.batch_first, dtype)
        if key.shape[:2] != value.shape[:2]:
            fail("value", f"the key's leading dims {tuple(key.shape[:2])}", f"shape {tuple(value.shape)}", "key and value must describe the same positions")
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)  # (B, L, E)
        if key.shape[0] != query.shape[0] or key.device != query.device:
            fail("key", f"batch size {query.shape[0]} on {query.device} like the query", f"batch size {key.shape[0]} on {key.device}", "give query, key and value the same batch and device")
        return query, key, value

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        causal_alignment: CausalAlignment | str | None = None,
        need_weights: bool = False,
        average_attn_weights: bool = False,
        cache: KVCache | None = None,
        return_stats: bool = False,
    ) -> Tensor | AttentionOutput:
        r"""Attend from ``query`` to ``key``/``value`` (both None: self-attention on ``query``).

        Args:
            query: (B, L, E), or (L, B, E) when ``batch_first=False``; E = d_model.
            key: (B, S, kdim) (seq-first likewise), or None with ``value`` None.
            value: (B, S, vdim) (seq-first likewise), or None with ``key`` None.
            key_mask: bool (B, S), **True = real token** (attend). The opposite of torch's
                ``key_padding_mask``: convert with ``key_mask=~key_padding_mask``.
            attn_mask: bool (**True = attend**; torch's MHA uses True = ignore) or float (added to
                the logits, ``-inf`` hides a key), broadcastable to (B, H, L, S): e.g. (L, S),
                (B, 1, L, S) or (B, H, L, S). Combined with ``key_mask`` and ``is_causal``.
            is_causal: hide keys after each query's aligned position.
            causal_alignment: ``"top_left"`` or ``"bottom_right"`` when L != S (see
                :class:`attnscale.CausalAlignment`). ``None`` means ``"top_left"`` without a
                cache and ``"bottom_right"`` with one; a cache requires ``"bottom_right"``.
            need_weights: also return the softmax weights that produced the output.
            average_attn_weights: return weights averaged over heads, (B, L, S), like torch's
                default (attnscale's default keeps the heads: (B, H, L, S)).
            cache: a :class:`KVCache`. This step's projected keys/values are appended to it and
                attention runs over all cached positions, so with a cache S = S_cached + S_new
                and ``key_mask`` / ``attn_mask`` cover all S keys. Causal alignment is bottom-right:
                the L new queries sit at positions S - L .. S - 1, drawn for S_cached = 3, L = 2::

                        keys 0 1 2 3 4
                    q3       x x x x .
                    q4       x x x x x

            return_stats: also return :class:`attnscale.AttentionStats` per (B, H, L) row.

        Returns:
            The output tensor (B, L, E) (or (L, B, E)) when neither ``need_weights`` nor
            ``return_stats`` is set; otherwise an :class:`AttentionOutput` with ``output``,
            ``weights`` and ``stats`` (unrequested fields are None).

        A query row with no visible key outputs ``out_proj``'s bias (zero attention), never NaN;
        its weights are all 0. With ``need_weights`` the math backend runs and the weights are
        built by the same steps (``ScorePath`` logits, ``masked_softmax``), so without dropout
        ``weights @ v`` is the attention output to rounding; with dropout the weights are those
        before dropout (torch returns them after). Otherwise ``backend="auto"`` picks the
        fastest exact backend.

        With ``config.kernel`` other than ``"softmax"`` there are no softmax weights and no
        masks beyond ``is_causal``: ``need_weights``, ``return_stats``, ``attn_mask`` and
        ``key_mask`` raise. Linear and Performer attention also reject a ``cache`` (their running
        sums are not cached) and ``is_causal`` with L != S; INT8 decodes with a cache like softmax.
        """
        self_attention = key is None and value is None
        if self_attention and (
            key_mask is None and attn_mask is None and cache is None and causal_alignment is None
            and is_causal is False and need_weights is False and average_attn_weights is False and return_stats is False
        ):  # fmt: skip
            out = self._remembered_forward(query)
            if out is not None:
                return out
        query, key, value = self._batch_first_inputs(query, key, value)  # (B, L, E), (B, S_new, kdim), (B, S_new, vdim)
        B, L, S_new = query.shape[0], query.shape[1], key.shape[1]
        is_causal = check_bool("is_causal", is_causal)
        need_weights = check_bool("need_weights", need_weights)
        average_attn_weights = check_bool("average_attn_weights", average_attn_weights)
        return_stats = check_bool("return_stats", return_stats)
        if cache is not None and not isinstance(cache, KVCache):
            fail("cache", "None or an attnscale.KVCache", type(cache).__name__, "pass cache=attnscale.KVCache()", exc=TypeError)
        alignment = _resolve_alignment(causal_alignment, with_cache=cache is not None)
        S = S_new + (len(cache) if cache is not None else 0)
        _check_key_mask(key_mask, B, S, query.device, with_cache=cache is not None)
        if isinstance(attn_mask, Tensor) and attn_mask.ndim == 3 and attn_mask.shape[0] == B * self.num_heads and B > 1:
            fail("attn_mask", f"a shape broadcastable to (B, H, L, S) = {(B, self.num_heads, L, S)}", f"shape {tuple(attn_mask.shape)}", "reshape torch's (B*H, L, S) mask to (B, H, L, S)")
        variant, config = self.variant, self.config
        if not variant.identity:  # (its steps below are then no-ops: a hot path skips their calls)
            variant.check_call(
                L=L,
                S=S,
                is_causal=is_causal,
                need_weights=need_weights,
                return_stats=return_stats,
                masked=attn_mask is not None or key_mask is not None,
                cached=cache is not None,
            )

        q, k, v = self._project(query, key, value, self_attention=self_attention)  # (B, H, L, D), (B, Hkv, S_new, D) twice
        options = {
            "dropout_p": self.dropout if self.training else 0.0,
            "is_causal": is_causal,
            "scale": self.scale,
            "enable_gqa": self.num_kv_heads != self.num_heads,
            "causal_alignment": alignment,
            "return_stats": return_stats,
        }
        slopes = None if variant.identity else variant.slopes(q.device)  # (H,) or None
        score_options = {"softcap": config.softcap, "alibi_slopes": slopes, "window": config.window, "sinks": self.sinks}
        call = None
        if cache is not None or need_weights or attn_mask is not None or key_mask is not None or config.kernel is not AttentionKernel.SOFTMAX:
            # Validate against all S keys before the cache changes; only shapes are read, so with a
            # cache a zero-copy expanded view stands in for the keys and values (without one they
            # are k and v). A call whose kernel reads q, k and v alone (softmax, no cache, no mask,
            # no weights) is validated by scaled_dot_product_attention itself, on the same tensors.
            all_keys, all_values = k, v
            if cache is not None:
                cache.check_compatible(k)
                all_keys = all_values = k.new_empty(()).expand(B, self.num_kv_heads, S, self.head_dim)  # (B, Hkv, S, D)
            call = check_attention_call(q, all_keys, all_values, attn_mask=attn_mask, backend="auto", **score_options, **options)
        if not variant.identity:
            q, k = variant.transform_qk(q, k, q_start=query_offset(L, S, alignment), k_start=len(cache) if cache is not None else 0)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, Hkv, S, D)
        mask = _merge_masks(attn_mask, key_mask)
        if not variant.identity:
            q = variant.fold_scale(q, k, is_causal=is_causal, alignment=alignment, mask=mask)
        if config.kernel is AttentionKernel.SOFTMAX:
            backend = Backend.MATH if need_weights else Backend.AUTO  # (the enum: a remembered call of torch's kernel takes only it)
            result = scaled_dot_product_attention(q, k, v, mask, backend=backend, **score_options, **options)
            out, stats = result if isinstance(result, tuple) else (result, None)
        else:
            out, stats = variant.attend(q, k, v, scale=self.scale, is_causal=is_causal, alignment=alignment), None  # (B, H, L, D)
        out = _call_linear(self._modules["out_proj"], out.transpose(1, 2).flatten(-2))  # (B, H, L, D) -> (B, L, H * D) -> (B, L, E)
        if not self.batch_first:
            out = out.transpose(0, 1)  # (L, B, E)
        if not need_weights and not return_stats:
            return out
        weights = None
        if need_weights:
            assert call is not None  # (validated above, with the weights asked for)
            weights = _attention_weights(q, k, mask, call.path, slopes, self.sinks).to(q.dtype)  # (B, H, L, S)
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (B, L, S)
        return AttentionOutput(output=out, weights=weights, stats=stats)
