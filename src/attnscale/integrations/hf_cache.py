"""An int8 KV cache for HuggingFace transformers: :class:`Int8Cache`.

Each layer keeps its keys and values as an :class:`attnscale.QuantizedKV` (int8 codes, K smoothed
by the mean of the first keys it was given, scales per key and group of channels for K and per
value vector for V), in buffers that grow by doubling so that a decoding step writes only its own
token's codes. ``update`` returns the layer's int8 key and value codes; attnscale's attention
function (``attn_implementation="attnscale"``) recognises them and computes attention over the
record in the compiled kernel (:func:`attnscale.quantized_attention`), which never dequantizes the
cache whole::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnscale")
    out = model.generate(**inputs, cache=attnscale.Int8Cache(), max_new_tokens=20)

Other attention implementations would receive int8 tensors as keys and values; they refuse them
(torch's SDPA names the dtype). Beam search and assisted decoding (``reorder_cache``, ``crop``)
are supported; dropout and an active :func:`attnscale.monitor` are not (attnscale's attention
function says so).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary
from transformers.cache_utils import Cache, CacheLayerMixin

from .._validate import fail
from ..quantized import GROUP, QuantizedKV, quantize_codes

__all__ = ["Int8Cache", "Int8Layer", "record_of"]

_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""The int8 key codes a layer's ``update`` returned -> the record they belong to."""


def record_of(key: Tensor) -> QuantizedKV | None:
    """The :class:`attnscale.QuantizedKV` whose key codes ``key`` is (as an :class:`Int8Layer`'s
    ``update`` returned them), or None for any other tensor."""
    return _RECORDS.get(key) if key.dtype is torch.int8 else None


class Int8Layer(CacheLayerMixin):
    """One layer's int8 keys and values (see :mod:`attnscale.integrations.hf_cache`). Its ``keys``
    and ``values`` are int8 codes; ``record`` holds them with their scales and mean
    (``record.dequantize()`` gives them as floats)."""

    is_sliding = False
    is_croppable = True

    def __init__(self, group: int = GROUP) -> None:
        super().__init__()
        self.group = group
        self.length = 0
        self.record: QuantizedKV | None = None
        self._buffers: tuple[Tensor, ...] = ()  # k, k_scale, v, v_scale at their capacity
        self.mean: Tensor | None = None  # (B, Hkv, 1, D): K's smoothing

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        """Quantize the new keys and values (the first call's keys set the mean K is smoothed by),
        append them, and return the layer's int8 key and value codes (B, Hkv, S, .)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._buffers:
            held = (*self._buffers[0].shape[:2], self._buffers[0].shape[3], self._buffers[2].shape[3])
            given = (*key_states.shape[:2], key_states.shape[-1], value_states.shape[-1])
            if held != given:
                fail("key_states, value_states", f"(B, Hkv, D, Dv) = {held}, as the cache holds", given, "start a new Int8Cache for another batch or model")
        if self.length == 0:
            wide = key_states.float()
            self.mean = wide.mean(dim=-2, keepdim=True) if key_states.shape[-2] else torch.zeros_like(wide[..., :1, :])
        parts = quantize_codes(key_states, value_states, group=self.group, mean=self.mean)
        new = key_states.shape[-2]
        self._reserve(self.length + new, parts)
        for buffer, part in zip(self._buffers, parts, strict=True):
            buffer[:, :, self.length : self.length + new].copy_(part)
        self.length += new
        return self._publish()

    def _reserve(self, length: int, like: tuple[Tensor, ...]) -> None:
        """Buffers (k, k_scale, v, v_scale, shaped as ``like``) that hold ``length`` keys: doubled,
        the held keys copied, where they do not."""
        if self._buffers and length <= self._buffers[0].shape[2]:
            return
        capacity = max(length, 2 * (self._buffers[0].shape[2] if self._buffers else 0), 16)
        grown = tuple(part.new_zeros(*part.shape[:2], capacity, part.shape[3]) for part in like)
        for old, new in zip(self._buffers, grown, strict=False):
            new[:, :, : self.length].copy_(old[:, :, : self.length])
        self._buffers = grown

    def _publish(self) -> tuple[Tensor, Tensor]:
        """The record of the first ``length`` keys (views of the buffers) and its codes, registered."""
        k, k_scale, v, v_scale = (b[:, :, : self.length] for b in self._buffers)
        self.record = QuantizedKV.trusted(k, k_scale, self.mean, v, v_scale, k.shape[-1] // k_scale.shape[-1])
        _RECORDS[k] = self.record
        self.keys, self.values = k, v
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length, self.record, self._buffers, self.keys, self.values = 0, None, (), None, None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` keys (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            fail("tokens_to_remove", "a negative count of keys to drop", tokens_to_remove, "pass -n to drop the last n keys")
        if tokens_to_remove and self.length:
            self.length = max(0, self.length + tokens_to_remove)
            self._publish()

    def _select(self, index: Tensor) -> None:
        if self.length:
            self._buffers = tuple(b.index_select(0, index.to(b.device)) for b in self._buffers)
            self.mean = self.mean.index_select(0, index.to(self.mean.device))
            self._publish()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            self._select(torch.arange(self._buffers[0].shape[0], device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.length:
            self._select(torch.as_tensor(indices, device=self.device).reshape(-1))


class Int8Cache(Cache):
    """A transformers ``Cache`` that keeps every layer's keys and values in int8 (:class:`Int8Layer`,
    ``group`` channels of K per scale): pass it as ``cache`` (``past_key_values`` before transformers 5) to ``generate`` of a model loaded with
    ``attn_implementation="attnscale"``."""

    def __init__(self, group: int = GROUP) -> None:
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            fail("group", "a positive int (channels of K per scale)", repr(group), f"pass e.g. group={GROUP}")
        super().__init__(layer_class_to_replicate=lambda: Int8Layer(group))  # type: ignore[arg-type]
        self.group = group

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's record (its keys so far, not the buffers' spare room)."""
        return sum(layer.record.nbytes for layer in self.layers if isinstance(layer, Int8Layer) and layer.record is not None)
