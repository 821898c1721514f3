"""The effective attention scale of a transformers model, measured end to end, layer by layer and
position by position; and the census of every model type of the installed transformers.

What is measured. For every attention layer, hooks read the raw projections ``q_i = W_q x_i`` and
``k_j = W_k x_j`` (split into heads) and the softmax weights ``p_ij`` the layer returns; the
*effective multiplier* ``m`` of a head is the slope in

    log p_ij = m * (q_i . k_j) + b * (i - j) + c_i

fitted by least squares within each query row (``c_i`` is the row's log-sum-exp; ``b`` absorbs a
linear position bias such as ALiBi). Everything the model does between the projections and the
softmax - RoPE, YaRN's attention factor, a temperature that grows with position, a multiplier on q
or k, the ``scaling`` constant - shows up in ``m``. RoPE would too, as noise, so every token of a
probe is given the same position id: rotations at equal positions cancel in ``q . k``, and the
position ladder (0 up to 4x every length threshold of the config) reads ``m`` as a function of the
query's position. A layer whose weights do not move when q and k are scaled (QK-norm) is found by
running the probe again with the projections' outputs doubled; its multiplier *after* the norm is
fitted in the same way against the q and k the model hands to attention, where the model uses
transformers' attention interface.

The census (:func:`census`) builds every model type small from its config (random weights,
nothing downloaded), probes it, and classifies it (:func:`classify`; the lab's verdict over the
classes is :mod:`attnscale.lab.census_verdict`); a type that cannot be built, driven or probed is
kept with its reason.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .probe import ScaleFit, fit_logit_scale

__all__ = [
    "CensusRow",
    "LayerScale",
    "NoAttention",
    "ProbeFailed",
    "TooLarge",
    "UnusableFolder",
    "census",
    "folder_config",
    "model_types",
    "position_ladder",
    "probe_model",
    "probe_pretrained",
    "probe_type",
    "tiny_config",
]

TOLERANCE = 0.03
"""A multiplier within 3% of another is the same multiplier (the rule's tolerance)."""
MIN_R2 = 0.99
"""Below this the weights are not one multiplier times q.k (plus a linear position bias)."""
GAIN = 2.0
"""The factor on the projections' outputs of the second probe (the QK-norm test)."""
NORMALISED_RESPONSE = 0.75
"""A layer whose multiplier falls below this share when q and k are doubled normalises them: 1
without a norm, 1/2 with one of q and k normalised, 1/4 with both."""
NO_SIGNAL_R2 = 0.1
"""Below this fit of the weights against the raw q.k (and with no fit after a norm), the probe's
weights do not follow q.k at all (a decoder layer of RT-DETR and its kin, built small, fits with
R^2 0): the multiplier is then noise, and so is its response to doubled q and k (whose 1/4 is
also what weights blind to q.k give), so no norm is inferred from it. Layers the gain test reads
as normalised and whose fit after the norm falls short (swinv2, inkling_text, prophetnet) fit the
raw q.k with R^2 0.47 or more."""


def _responds_as_normalised(gain_response: float | None, r2: float, after_norm_r2: float | None) -> bool:
    """Whether doubled q and k shrink the multiplier as a norm would, where the weights follow q.k."""
    blind = r2 < NO_SIGNAL_R2 and (after_norm_r2 is None or after_norm_r2 < MIN_R2)
    return gain_response is not None and gain_response < NORMALISED_RESPONSE and not blind

SQRT = "1/sqrt(head_dim)"
OTHER_CONSTANT = "another constant"
POSITION = "position-dependent"
LAYER = "layer-dependent"
HEAD = "head-dependent"
NORMALISED = "after QK-norm"
CLIPPED = "clipped"
LEARNED = "learned"
NOT_MEASURABLE = "not measurable"

CLIP_REACH = 100.0
"""The clip test drives each layer's q until its largest entry is this (12.5x the clip_qkv of 8 in
OLMo 1.7 7B and DBRX) and shrinks k by the same factor, so that q.k, and with it every weight of
a layer without a clamp, is unchanged."""
PERTURBED = (1.5, 0.25)
"""The learned-scale test sets every parameter of an attention module outside its projections to
1.5 p + 0.25 (an additive table shifts every logit of a row alike, which the fit's row constant
absorbs; a multiplier on q or k moves the fitted multiplier)."""


class ProbeFailed(RuntimeError):
    """A model could not be probed; the message says why, in one line."""


def _first_line(exc: BaseException) -> str:
    """``Type: the first non-blank line of the message``."""
    line = next((text.strip() for text in str(exc).splitlines() if text.strip()), "")
    return f"{type(exc).__name__}: {line}"


class NoAttention(ProbeFailed):
    """The model has no attention at all (its modeling code defines no attention module): it is
    outside the census, not a failure of it."""


class TooLarge(ProbeFailed):
    """A model over the census's bounds (:data:`MAX_PARAMETERS`, :data:`MAX_MODULES`); raised
    while it is being built, before it is built whole."""


class UnusableFolder(ValueError):
    """A checkpoint folder that cannot be read as a model of the installed transformers (no JSON
    object in ``config.json``, or a ``model_type`` transformers does not know); nothing was loaded."""


# ----------------------------------------------------------------------------------------------
# Finding the projections

# (query, key) child names of an attention module whose outputs are q and k, all heads side by side
_PAIRS = (
    ("q_proj", "k_proj"),
    ("query", "key"),
    ("q", "k"),
    ("q_lin", "k_lin"),
    ("linear_q", "linear_k"),
    ("query_proj", "key_proj"),
    ("Wq", "Wk"),
    ("project_q", "project_k"),
    ("projection_query", "projection_key"),
    ("to_query", "to_key"),
)
# fused q/k/v projections: the child's name
_FUSED = ("qkv_proj", "qkv", "c_attn", "query_key_value", "Wqkv", "in_proj")


@dataclass
class _Tap:
    """How to read one attention module's raw q and k from its children's outputs."""

    module: nn.Module
    name: str
    kind: str  # "pair", "fused", "mla"
    children: tuple[str, ...]
    outputs: dict[str, Tensor] = field(default_factory=dict)


def _linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def find_taps(model: nn.Module) -> list[_Tap]:
    """The attention modules of ``model`` whose q and k projections can be read, in order."""
    taps: list[_Tap] = []
    for name, module in model.named_modules():
        kids = {n: c for n, c in module.named_children() if _linear(c)}
        if "kv_b_proj" in kids and "kv_a_proj_with_mqa" in kids and ("q_b_proj" in kids or "q_proj" in kids):
            q = "q_b_proj" if "q_b_proj" in kids else "q_proj"
            taps.append(_Tap(module, name, "mla", (q, "kv_a_proj_with_mqa", "kv_b_proj")))
            continue
        pair = next(((a, b) for a, b in _PAIRS if a in kids and b in kids), None)
        if pair is not None:
            taps.append(_Tap(module, name, "pair", pair))
            continue
        fused = next((n for n in _FUSED if n in kids), None)
        if fused is not None and "Attention" in type(module).__name__:
            taps.append(_Tap(module, name, "fused", (fused,)))
    return taps


def _heads(x: Tensor, dim: int) -> Tensor:
    """(B, L, H * dim) -> (B, H, L, dim)."""
    B, L, _ = x.shape
    return x.reshape(B, L, -1, dim).transpose(1, 2)


def _raw_qk(tap: _Tap, heads: int, config: Any) -> list[tuple[Tensor, Tensor]]:
    """Candidate (q, k) pairs, each (B, H, L, D) and (B, Hk, L, D), from the recorded outputs: one
    for a plain pair, one per plausible layout for a fused projection (the fit keeps the best)."""
    out = {n: t.flatten(0, -3) if t.dim() > 3 else t for n, t in tap.outputs.items()}
    if tap.kind == "pair":
        q, k = out[tap.children[0]], out[tap.children[1]]
        if q.shape[-1] % heads:
            return []
        d = q.shape[-1] // heads
        candidates = [(_heads(q, d), _heads(k, d))] if k.shape[-1] % d == 0 else []
        text = getattr(config, "text_config", None)
        kv = getattr(config, "num_key_value_heads", None) or getattr(text, "num_key_value_heads", None)
        if isinstance(kv, int) and kv > 0 and k.shape[-1] % kv == 0 and d == 2 * (k.shape[-1] // kv):
            # each head's query beside its output gate, [q | gate] (Qwen3-Next's gated attention)
            half = d // 2
            gated = q.reshape(*q.shape[:-1], heads, 2, half)[..., 0, :].transpose(1, 2)
            candidates.append((gated, _heads(k, half)))
        return candidates
    if tap.kind == "mla":
        q, a, b = (out[n] for n in tap.children)
        nope, rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        q = _heads(q, nope + rope)
        kv = _heads(b, b.shape[-1] // heads)  # (B, H, L, nope + v)
        k_rot = a[..., a.shape[-1] - rope :].unsqueeze(1).expand(-1, heads, -1, -1)
        n = min(kv.shape[-2], k_rot.shape[-2])  # the probe's own tokens (a cache may add earlier ones)
        return [(q, torch.cat([kv[..., -n:, :nope], k_rot[..., -n:, :]], dim=-1))]
    fused = out[tap.children[0]]
    return [layout(fused) for layout in _fused_layouts(fused.shape[-1], heads, config)]


Layout = Callable[[Tensor], tuple[Tensor, Tensor]]
"""One way of reading a fused projection's output (B, L, width) as q (B, H, L, d) and k (B, Hk, L, d)."""


def _fused_layouts(width: int, heads: int, config: Any) -> list[Layout]:
    """Every plausible layout of a fused q/k/v projection of ``width`` outputs (the fit keeps the
    best); applied to ``arange(width)``, a layout names the columns that hold q and k."""
    layouts: list[Layout] = []
    kv_heads = [h for h in (heads, getattr(config, "num_key_value_heads", None), getattr(config, "multi_query_group_num", None), 1) if h]
    for hk in dict.fromkeys(kv_heads):
        if width % (heads + 2 * hk):
            continue
        d = width // (heads + 2 * hk)
        layouts.append(lambda t, d=d, hk=hk: (_heads(t[..., : heads * d], d), _heads(t[..., heads * d : (heads + hk) * d], d)))  # [q | k | v]
        if hk == heads:  # per head [q k v] side by side (GPT-NeoX, BLOOM)

            def per_head(t: Tensor, d: int = d) -> tuple[Tensor, Tensor]:
                per = t.reshape(*t.shape[:-1], heads, 3, d)
                return per[..., 0, :].transpose(1, 2), per[..., 1, :].transpose(1, 2)

            layouts.append(per_head)
            for shards in (2, 4, 8):  # model-parallel shards of [q v k] each (CodeGen)
                if heads % shards == 0:

                    def sharded(t: Tensor, d: int = d, shards: int = shards) -> tuple[Tensor, Tensor]:
                        per = t.reshape(*t.shape[:-1], shards, 3, heads // shards * d)
                        return _heads(per[..., 0, :].flatten(-2), d), _heads(per[..., 2, :].flatten(-2), d)

                    layouts.append(sharded)
        else:  # per key/value group [q ... q k v] (Falcon's new architecture)

            def grouped(t: Tensor, d: int = d, hk: int = hk) -> tuple[Tensor, Tensor]:
                g = heads // hk
                per = t.reshape(*t.shape[:-1], hk, g + 2, d)
                return per[..., :g, :].flatten(-3, -2).transpose(1, 2), per[..., g, :].transpose(1, 2)

            layouts.append(grouped)
    return layouts


# ----------------------------------------------------------------------------------------------
# The fit: attnscale.diagnostics.fit_logit_scale with a position bias


def _fit(query: Tensor, key: Tensor, weights: Tensor) -> ScaleFit:
    """``log p_ij = m q_i.k_j + b (i - j) + c_i`` per head (masked entries, weight 0, left out)."""
    return fit_logit_scale(query, key, weights, min_prob=1e-30, position_bias=True)


# ----------------------------------------------------------------------------------------------
# Probing one model


@dataclass
class LayerScale:
    """One attention layer's effective scale at each probed position."""

    layer: str
    """The attention module's qualified name."""
    head_dim: int
    heads: int
    positions: list[int]
    multiplier: list[float]
    """The median over heads of ``m`` at each position (query and key at that position)."""
    head_spread: float
    """max / min - 1 of ``m`` over heads, the largest over positions."""
    r2: float
    """The worst fit over heads and positions."""
    bias_slope: float
    """The largest |b| over heads (a linear position bias: ALiBi), at position 0."""
    gain_response: float | None
    """m with the projections' outputs doubled / m without: 1 plain, 1/4 with q and k both normalised."""
    after_norm: list[float] | None = None
    """The multiplier fitted against the q and k handed to attention, per position (None where the
    model does not hand them through transformers' attention interface)."""
    after_norm_r2: float | None = None
    through_cache: bool = False
    """Whether positions > 0 were also set through a filled cache (else by position ids alone)."""
    clip_response: float | None = None
    """m with q driven to :data:`CLIP_REACH` and k shrunk alike / m (1 without a clamp; None for
    latent attention, which the clip test does not drive, or where that pass failed)."""
    clip_r2: float | None = None
    parameter_response: float | None = None
    """m with the attention module's own parameters perturbed / m (None where it has none)."""
    parameters: list[str] = field(default_factory=list)
    """The attention module's own parameters outside its projections and norms (what the learned
    test moves)."""

    @property
    def normalised(self) -> bool:
        return _responds_as_normalised(self.gain_response, self.r2, self.after_norm_r2)

    @property
    def clipped(self) -> bool:
        """Whether a clamp on q or k binds under the clip test (in a layer that is not normalised)."""
        if self.normalised or self.clip_response is None or self.r2 < MIN_R2:
            return False
        return abs(self.clip_response - 1) > TOLERANCE or (self.clip_r2 or 0.0) < MIN_R2

    @property
    def learned(self) -> bool:
        """Whether the multiplier moves with the module's own parameters (outside its projections
        and norms): a learned temperature, before or after a QK-norm."""
        return self.parameter_response is not None and abs(self.parameter_response - 1) > TOLERANCE

    @property
    def effective(self) -> list[float] | None:
        """What the rule compares with 1/sqrt(head_dim): ``multiplier``, or ``after_norm`` when normalised."""
        return self.after_norm if self.normalised else self.multiplier


def position_ladder(config: Any, *, rotary: bool, limit: int | None = None) -> list[int]:
    """Query positions to probe: 0, 1, 15, and 1/2, 1, 2 and 4 times every length threshold of the
    config (``floor_scale``, ``original_max_position_embeddings``, a RoPE scaling's original length
    and its factor times it), below ``limit`` where position ids index a table."""
    found: list[int] = []

    def scan(obj: Any, depth: int = 0) -> None:
        if depth > 3:
            return
        items = obj.items() if isinstance(obj, dict) else vars(obj).items() if hasattr(obj, "__dict__") else ()
        for name, value in items:
            if isinstance(value, bool):
                continue
            if isinstance(value, int) and name in ("floor_scale", "original_max_position_embeddings") and value > 0:
                found.append(value)
            elif isinstance(value, dict) and name in ("rope_parameters", "rope_scaling"):
                scan(value, depth + 1)
                orig, factor = value.get("original_max_position_embeddings"), value.get("factor")
                if isinstance(orig, int) and isinstance(factor, (int, float)) and factor > 1:
                    found.append(int(orig * factor))
    scan(config)
    ladder = {0, 1, 15}
    if rotary:
        for t in found:
            ladder.update({t // 2, t, 2 * t, 4 * t})
    if limit is not None:
        ladder = {p for p in ladder if p < limit}
    return sorted(ladder)


_SIGNALS = ("pixel_values", "input_values", "input_features", "past_values")
"""Non-token inputs the census drives with random values (images, waveforms, spectrogram features,
time series)."""


def _signal(config: Any, name: str, batch: int, generator: torch.Generator) -> Tensor:
    """A random ``name`` input of the shape ``config`` expects (its vision or audio sub-config where
    it has one)."""
    if name == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        size = getattr(vision, "image_size", None) or 224
        h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        return torch.randn(batch, int(getattr(vision, "num_channels", 3) or 3), int(h), int(w), generator=generator)
    if name == "input_values":
        return torch.randn(batch, 4000, generator=generator)  # a quarter second at 16 kHz
    if name == "past_values":  # a time series (TimesFM): 12 patches
        return torch.randn(batch, 12 * int(getattr(config, "patch_length", 32) or 32), generator=generator)
    audio = getattr(config, "audio_config", None) or config
    bins = next((v for v in (getattr(audio, n, None) for n in ("num_mel_bins", "feature_size", "input_feat_per_channel")) if isinstance(v, int)), 80)
    source = getattr(audio, "max_source_positions", None)
    frames = 2 * source if isinstance(source, int) and source <= 1500 else 64  # Whisper's encoder wants exactly 2x
    if isinstance(getattr(audio, "input_feat_per_channel", None), int):  # Speech2Text: (batch, frames, features)
        return torch.randn(batch, frames, bins * int(getattr(audio, "input_channels", 1) or 1), generator=generator)
    return torch.randn(batch, bins, frames, generator=generator)


def _takes(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` has a parameter ``name``."""
    import inspect

    return name in inspect.signature(model.forward).parameters


def _main_input(model: nn.Module) -> str:
    main = getattr(model, "main_input_name", "input_ids")
    if main != "input_ids" and main not in _SIGNALS:
        raise ProbeFailed(f"input {main!r} is not driven by the census (token ids, images, waveforms, audio features and time series only)")
    return main


def _inputs(model: nn.Module, *, batch: int, length: int, position: int | None, seed: int, extra: Sequence[str] = ()) -> dict:
    """Random token ids (the same for every position), every token at ``position`` (None: the
    model's own positions), no padding; the same ids as decoder input for an encoder-decoder. A
    model whose main input is an image or audio gets a random one instead of ids; ``extra`` names
    further such inputs (a dual encoder's image beside its text)."""
    config = model.config
    main = _main_input(model)
    generator = torch.Generator().manual_seed(seed)
    inputs: dict[str, Tensor] = {}
    if main != "input_ids":
        inputs[main] = _signal(config, main, batch, generator)
        if main == "past_values":  # no padding, the first frequency class where the model takes one
            inputs["past_values_padding"] = torch.zeros_like(inputs[main], dtype=torch.long)
            if _takes(model, "freq"):
                inputs["freq"] = torch.zeros(batch, 1, dtype=torch.long)
    else:
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None) or 100
        ids = torch.randint(3, max(4, min(int(vocab), 1000)), (batch, length), generator=generator)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if position is not None:
            inputs["position_ids"] = torch.full_like(ids, position)
    for name in extra:
        inputs[name] = _signal(config, name, batch, generator)
    if _takes(model, "output_attentions"):  # attention codes of their own return weights only when asked
        inputs["output_attentions"] = True
    if getattr(config, "is_encoder_decoder", False):
        ids = torch.randint(3, 100, (batch, length), generator=generator) if main != "input_ids" else inputs["input_ids"]
        inputs["decoder_input_ids"] = ids
        inputs["decoder_attention_mask"] = torch.ones_like(ids)
    return inputs


CACHE_LIMIT = 40_000
"""Positions up to this are also set through a cache that says so many tokens came before (for a
model that reads the position from its cache's length rather than from position ids)."""


CACHE_BYTES = 1 << 29
"""A filled cache larger than this (512 MiB) is not built: positions by position ids alone."""


def _cache_argument(model: nn.Module) -> str | None:
    return next((name for name in ("cache", "past_key_values") if _takes(model, name)), None)


def _filled_cache(model: nn.Module, inputs: dict, position: int) -> Any | None:
    """transformers' own cache after a one-token pass, each layer's keys and values replaced by
    zeros as if ``position`` tokens came before (None where the model's cache is not of that kind).
    Zero keys add columns of logit 0: the fit reads only the columns of the probe's own tokens."""
    if "decoder_input_ids" in inputs:
        return None
    one = {"input_ids": inputs["input_ids"][:, :1], "attention_mask": inputs["attention_mask"][:, :1]}
    cache = getattr(model(**one, use_cache=True), "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    size = 0
    for layer in layers:
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, Tensor) or keys.dim() != 4 or not isinstance(getattr(layer, "values", None), Tensor):
            return None
        size += position * (keys[:, :, :1].numel() + layer.values[:, :, :1].numel()) * keys.element_size()
    if size > CACHE_BYTES:
        return None
    for layer in layers:
        keys = layer.keys
        window = getattr(layer, "sliding_window", None)
        kept = min(position, window - 1) if isinstance(window, int) and window > 0 else position
        layer.keys = keys.new_zeros(*keys.shape[:2], kept, keys.shape[-1])
        layer.values = layer.values.new_zeros(*layer.values.shape[:2], kept, layer.values.shape[-1])
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = position
    return cache


Gains = float | dict[tuple[int, str], "float | Tensor"]
"""A factor on every tap's children's outputs, or one per (id(tap module), child) (1 where absent;
a tensor: one per output column)."""


@contextlib.contextmanager
def _recording(taps: Sequence[_Tap], gain: Gains) -> Iterator[dict[int, list]]:
    """Record each tap's children outputs (scaled by ``gain``) and the weights each tapped module
    returns; yields {id(module): [weights...]}."""
    weights: dict[int, list] = {id(t.module): [] for t in taps}
    handles = []
    try:
        for tap in taps:
            for child in tap.children:
                factor = gain if isinstance(gain, float) else gain.get((id(tap.module), child), 1.0)

                def keep(mod, args, out, tap=tap, child=child, factor=factor):
                    out = out * factor.to(out.dtype) if isinstance(factor, Tensor) else out * factor if factor != 1.0 else out
                    tap.outputs[child] = out.detach().clone()  # OLMo clamps q and k in place
                    return out

                handles.append(tap.module.get_submodule(child).register_forward_hook(keep))

            def take(mod, args, out, key=id(tap.module)):
                found = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, Tensor) and o.dim() == 4]
                if found:
                    weights[key].append(found[-1].detach())

            handles.append(tap.module.register_forward_hook(take))
        yield weights
    finally:
        for h in handles:
            h.remove()


_HANDED: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
INTERFACE = "attnscale_census"


def _census_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: the module's own eager attention, with the q and k it was
    handed and the weights it returned kept for the fit after the norm."""
    modeling = sys.modules[type(module).__module__]
    eager = getattr(modeling, "eager_attention_forward", None) or getattr(modeling, "simple_eager_attention_forward", None)  # TimesFM's name
    if eager is None:
        raise ProbeFailed("its modeling code has no eager_attention_forward")
    out, weights = eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    _HANDED[id(module)] = (query.detach(), key.detach(), weights.detach())
    return out, weights


def _register_interface(transformers: Any) -> None:
    """The census's attention function, with eager attention's mask (an additive float mask: without
    a mask function of its own transformers would build no mask at all for an unknown name)."""
    from transformers.masking_utils import eager_mask

    transformers.AttentionInterface.register(INTERFACE, _census_attention)
    transformers.AttentionMaskInterface.register(INTERFACE, eager_mask)


def _forward(model: nn.Module, taps: Sequence[_Tap], gain: Gains, inputs: dict) -> dict[int, list]:
    """One forward pass, recording every tap; the weights each tapped module returned."""
    for tap in taps:
        tap.outputs.clear()
    _HANDED.clear()
    with _recording(taps, gain) as weights, torch.no_grad():
        try:
            model(**inputs)
        except ProbeFailed:
            raise
        except Exception as exc:
            raise ProbeFailed(f"the forward pass failed: {_first_line(exc)}"[:200]) from None
    return weights


def _wants_image(model: nn.Module) -> bool:
    main = getattr(model, "main_input_name", "input_ids")
    return main == "input_ids" and _takes(model, "pixel_values") and hasattr(model.config, "vision_config")


class _BestFit(NamedTuple):
    """:func:`_best_fit`'s result: the fit, the head dim it implies, the layout's index in :func:`_raw_qk`."""

    fit: ScaleFit
    head_dim: int
    layout: int


def _best_fit(tap: _Tap, weights: Tensor, config: Any) -> _BestFit | None:
    """The fit of ``weights`` against the tap's raw q and k (the best-fitting layout of a fused
    projection), the head dim it implies and the layout's index in :func:`_raw_qk`; None where no
    layout matches the weights' shape."""
    heads = weights.shape[1]
    best = None
    for index, (q, k) in enumerate(_raw_qk(tap, heads, config)):
        w = weights[..., -k.shape[-2] :] if weights.shape[-1] > k.shape[-2] else weights  # a filled cache's columns come first
        if q.shape[1] != heads or q.shape[-2] != w.shape[-2] or k.shape[-2] != w.shape[-1] or heads % k.shape[1]:
            continue
        fit = _fit(q, k, w)
        if best is None or min(fit.r2) > min(best.fit.r2):
            best = _BestFit(fit, head_dim=q.shape[-1], layout=index)
    return best


def _spread(values: Sequence[float]) -> float:
    """max / min - 1 (infinite when the smallest is not positive)."""
    return max(values) / min(values) - 1 if min(values) > 0 else math.inf


def probe_model(
    model: nn.Module,
    *,
    positions: Sequence[int] | None = None,
    batch: int = 2,
    length: int = 12,
    seed: int = 0,
) -> list[LayerScale]:
    """Each attention layer's effective scale at each of ``positions`` (all tokens at one position;
    None: the model's own positions 0..length-1, then only position-free effects are meaningful),
    with the QK-norm test (q and k doubled), the clip test (q driven to :data:`CLIP_REACH`, k shrunk
    alike) and the learned test (the attention modules' own parameters moved) at the first position.

    Raises :class:`ProbeFailed` when no attention layer can be read or the model cannot be run."""
    config = model.config
    taps = find_taps(model)
    if not taps:
        modeling = sys.modules.get(type(model).__module__)
        if modeling is not None and not any(isinstance(v, type) and issubclass(v, nn.Module) and "attention" in k.lower() for k, v in vars(modeling).items()):
            raise NoAttention("no attention: its modeling code defines no attention module")
        raise ProbeFailed("no attention module with query/key projections the census can read")
    positions = list(positions) if positions is not None else [None]  # type: ignore[list-item]
    by_tap: dict[int, dict] = {id(t.module): {"m": [], "r2": [], "b": [], "spread": [], "after": [], "after_r2": [], "after_spread": [], "dim": None, "heads": None} for t in taps}
    gain_m: dict[int, float] = {}
    drive: dict[int, dict] = {}  # each tap's clip-test factors (_clip_gains), from the first position
    cache_argument = _cache_argument(model)
    cached: bool | None = None if cache_argument else False  # positions also set through a cache? (None: not tried yet)
    model.eval()
    extra: tuple[str, ...] = ()
    for gain in (1.0, GAIN):
        for position in positions if gain == 1.0 else positions[:1]:
            inputs = _inputs(model, batch=batch, length=length, position=position, seed=seed, extra=extra)
            through_cache = bool(position) and position <= CACHE_LIMIT and cached is not False
            weights = None
            if not (through_cache and cached):  # by position ids (once the cache is known to work, by it alone)
                try:
                    weights = _forward(model, taps, gain, inputs)
                except ProbeFailed:
                    # a dual encoder (CLIP and kin) runs only with its image beside the text: once, with one
                    if extra or not _wants_image(model):
                        raise
                    extra = ("pixel_values",)
                    inputs = _inputs(model, batch=batch, length=length, position=position, seed=seed, extra=extra)
                    weights = _forward(model, taps, gain, inputs)
            if through_cache:
                # with a cache that says ``position`` tokens came before; kept where it runs
                try:
                    with torch.no_grad():
                        cache = _filled_cache(model, inputs, position)
                    if cache is None:
                        cached = False
                    else:
                        extended = {**inputs, "attention_mask": torch.ones(batch, position + length, dtype=inputs["attention_mask"].dtype)}
                        weights = _forward(model, taps, gain, {**extended, cache_argument: cache, "use_cache": True})
                        cached = True
                except Exception:  # a cache the model does not take: positions by position ids alone
                    cached = False
            if weights is None or cached is False and through_cache:
                weights = _forward(model, taps, gain, inputs)
            for tap in taps:
                key = id(tap.module)
                found, w = _tap_fit(tap, weights, config)
                if gain == 1.0 and found is not None and key not in drive:
                    drive[key] = _clip_gains(tap, w.shape[1], config, found.layout)
                tap.outputs.clear()
                if found is None:
                    continue
                fit, dim = found.fit, found.head_dim
                rec = by_tap[key]
                if gain != 1.0:
                    gain_m[key] = statistics.median(fit.scale)
                    continue
                rec["dim"], rec["heads"] = dim, len(fit.scale)
                rec["m"].append(statistics.median(fit.scale))
                rec["r2"].append(min(fit.r2))
                rec["b"].append(max(abs(b) for b in fit.bias_slope))
                rec["spread"].append(_spread(fit.scale))
                hq, hk, hw = _HANDED.get(key, (None, None, None))
                if hq is not None and hq.shape[1] == len(fit.scale) and hq.shape[-2] == hw.shape[-2]:
                    after = _fit(hq, hk, hw)
                    rec["after"].append(statistics.median(after.scale))
                    rec["after_r2"].append(min(after.r2))
                    rec["after_spread"].append(_spread(after.scale))
    first = _inputs(model, batch=batch, length=length, position=positions[0], seed=seed, extra=extra)
    factors = {child: factor for gains in drive.values() for child, factor in gains.items()}
    clipped, moved, owned = {}, {}, {}
    with contextlib.suppress(ProbeFailed):  # a pass the model refuses leaves its test unanswered (None)
        clipped = _fits(taps, _forward(model, taps, factors, first), config) if factors else {}
    with contextlib.suppress(ProbeFailed):
        moved, owned = _parameter_test(model, taps, first, config)
    layers = []
    for tap in taps:
        rec = by_tap[id(tap.module)]
        if not rec["m"] or len(rec["m"]) != len(positions):
            continue
        m0 = rec["m"][0]
        response = gain_m[id(tap.module)] / m0 if id(tap.module) in gain_m and m0 != 0 else None
        clip = clipped.get(id(tap.module))
        perturbed = moved.get(id(tap.module))
        complete = len(rec["after"]) == len(positions)
        normalised = _responds_as_normalised(response, min(rec["r2"]), min(rec["after_r2"]) if complete else None)
        layers.append(
            LayerScale(
                layer=tap.name,
                head_dim=int(rec["dim"]),
                heads=int(rec["heads"]),
                positions=[-1 if p is None else int(p) for p in positions],
                multiplier=rec["m"],
                head_spread=max(rec["after_spread"] if normalised and complete else rec["spread"]),
                r2=min(rec["r2"]),
                bias_slope=rec["b"][0],
                gain_response=response,
                after_norm=rec["after"] if complete else None,
                after_norm_r2=min(rec["after_r2"]) if complete else None,
                through_cache=bool(cached),
                clip_response=statistics.median(clip.scale) / m0 if clip is not None and m0 != 0 else None,
                clip_r2=min(clip.r2) if clip is not None else None,
                parameter_response=statistics.median(perturbed.scale) / m0 if perturbed is not None and m0 != 0 else None,
                parameters=owned.get(id(tap.module), []),
            )
        )
    if not layers:
        raise ProbeFailed("no attention layer returned weights the census could fit (no 4-D weights from the attention modules)")
    return layers


def _tap_fit(tap: _Tap, weights: dict[int, list], config: Any) -> tuple[_BestFit | None, Tensor | None]:
    """One tap's best fit (:func:`_best_fit`) of a forward pass's attention weights against its
    recorded raw q and k, and the weights it read (the module's last returned ones, else those a
    handed-over kernel recorded); (None, None) where it has neither. The record is left for the
    caller to read further and clear."""
    key = id(tap.module)
    w = weights[key][-1] if weights[key] else (_HANDED[key][2] if key in _HANDED else None)
    return (_best_fit(tap, w, config) if w is not None and tap.outputs else None), w


def _fits(taps: Sequence[_Tap], weights: dict[int, list], config: Any) -> dict[int, ScaleFit]:
    """Each tap's fit of one forward pass's weights against its recorded raw q and k."""
    fits = {}
    for tap in taps:
        found, _ = _tap_fit(tap, weights, config)
        tap.outputs.clear()
        if found is not None:
            fits[id(tap.module)] = found.fit
    return fits


def _clip_gains(tap: _Tap, heads: int, config: Any, layout: int) -> dict[tuple[int, str], float | Tensor]:
    """The clip test's factors on one tap's recorded outputs: q driven until its largest entry is
    :data:`CLIP_REACH`, k shrunk by the same factor, so that q.k is unchanged and a clamp between the
    projections and the softmax (OLMo's and MPT's ``clip_qkv``) binds and moves the multiplier. A
    fused projection gets one factor per column (its q and k columns from the best-fitting layout);
    latent attention is not driven (empty)."""
    if tap.kind == "mla":
        return {}
    q, _ = _raw_qk(tap, heads, config)[layout]
    top = float(q.abs().max())
    if not top > 0:
        return {}
    g = CLIP_REACH / top
    if tap.kind == "pair":
        return {(id(tap.module), tap.children[0]): g, (id(tap.module), tap.children[1]): 1 / g}
    width = tap.outputs[tap.children[0]].shape[-1]
    columns = torch.arange(width, dtype=torch.float64).expand(1, 1, width)
    q_cols, k_cols = _fused_layouts(width, heads, config)[layout](columns)
    factor = torch.ones(width, dtype=q.dtype)
    factor[q_cols.flatten().long()] = g
    factor[k_cols.flatten().long()] = 1 / g
    return {(id(tap.module), tap.children[0]): factor}


def _own_parameters(tap: _Tap) -> list[tuple[str, nn.Parameter]]:
    """The attention module's floating parameters outside its linear layers (its projections) and
    its norms (a QK-norm's gain is read by the fit after the norm), biases left out: a bias adds to
    q, k or the logit, it does not multiply (DeBERTa's q_bias, zero at initialisation, moved to
    0.25 adds 0.25 sum_d k_jd to every logit of key j and moved the fit by 4%)."""
    inside = {
        id(p)
        for child in tap.module.modules()
        if child is not tap.module and (_linear(child) or "norm" in type(child).__name__.lower())
        for p in child.parameters()
    }
    return [
        (name, p)
        for name, p in tap.module.named_parameters()
        if id(p) not in inside and p.is_floating_point() and "bias" not in name.rsplit(".", 1)[-1]
    ]


def _parameter_test(model: nn.Module, taps: Sequence[_Tap], inputs: dict, config: Any) -> tuple[dict[int, ScaleFit], dict[int, list[str]]]:
    """The fit with every attention module's own parameters perturbed (:data:`PERTURBED`), and their
    names: a learned multiplier (TimesFM's per-dimension softplus on q) moves the fit."""
    owned = {id(tap.module): _own_parameters(tap) for tap in taps}
    owned = {key: params for key, params in owned.items() if params}
    if not owned:
        return {}, {}
    factor, shift = PERTURBED
    kept = list({id(p): (p, p.detach().clone()) for params in owned.values() for _, p in params}.values())
    try:
        with torch.no_grad():
            for p, _ in kept:
                p.mul_(factor).add_(shift)
        fits = _fits(taps, _forward(model, taps, 1.0, inputs), config)
    finally:
        with torch.no_grad():
            for p, value in kept:
                p.copy_(value)
    return {key: fit for key, fit in fits.items() if key in owned}, {key: [name for name, _ in params] for key, params in owned.items()}


# ----------------------------------------------------------------------------------------------
# Classifying


def _same(values: Sequence[float]) -> bool:
    lo, hi = min(values), max(values)
    return lo > 0 and hi / lo - 1 <= TOLERANCE


def classify(layers: Sequence[LayerScale]) -> tuple[str, str]:
    """The type's class and a line on why, from its layers (the first that applies: not measurable,
    clipped, learned, after QK-norm without a fit after the norm, position-, layer- or head-dependent,
    after QK-norm, 1/sqrt(head_dim), another constant)."""
    normed = [lay for lay in layers if lay.normalised]
    bad = [lay for lay in layers if not lay.normalised and lay.r2 < MIN_R2]
    if bad:
        return NOT_MEASURABLE, f"{bad[0].layer}: weights are not one multiplier times q.k (R^2 {bad[0].r2:.3f})"
    clipped = [lay for lay in layers if lay.clipped]
    if clipped:
        lay = clipped[0]
        below = lay.multiplier[0] * math.sqrt(lay.head_dim)
        return CLIPPED, (
            f"{lay.layer}: with q driven to |q| <= {CLIP_REACH:g} (k shrunk alike) the multiplier falls to "
            f"{lay.clip_response:.3g}x (fit R^2 {lay.clip_r2:.3f}); below the clamp x sqrt(head_dim) = {below:.4g}"
        )
    learned = [lay for lay in layers if lay.learned]
    if learned:
        lay = learned[0]
        at_init = "" if lay.normalised else f"; at initialisation x sqrt(head_dim) = {lay.multiplier[0] * math.sqrt(lay.head_dim):.4g}"
        return LEARNED, f"{lay.layer}: the multiplier moves {lay.parameter_response:.3g}x with its own parameters ({', '.join(lay.parameters[:3])}){at_init}"
    if any(lay.after_norm is None or (lay.after_norm_r2 or 0) < MIN_R2 for lay in normed):
        return NORMALISED, "q/k are normalised before attention; the multiplier after the norm could not be fitted"
    effective = [lay.effective for lay in layers]
    moving = [lay for lay, e in zip(layers, effective) if e is not None and not _same(e)]
    if moving:
        lay = moving[0]
        e = lay.effective
        return POSITION, f"{lay.layer}: x sqrt(head_dim) = {e[0] * math.sqrt(lay.head_dim):.4g} at position {lay.positions[0]}, {e[-1] * math.sqrt(lay.head_dim):.4g} at {lay.positions[-1]}"
    ratios = [e[0] * math.sqrt(lay.head_dim) for lay, e in zip(layers, effective) if e is not None]
    if not _same(ratios):
        return LAYER, f"x sqrt(head_dim) from {min(ratios):.4g} to {max(ratios):.4g} over {len(layers)} layers"
    spread = max(lay.head_spread for lay in layers)
    if spread > TOLERANCE:
        return HEAD, f"heads differ by up to {spread:.1%}"
    ratio = ratios[0]
    if normed:
        return NORMALISED, f"q/k normalised; after the norm x sqrt(head_dim) = {ratio:.4g}"
    if abs(ratio - 1) <= TOLERANCE:
        return SQRT, f"x sqrt(head_dim) = {ratio:.4g}"
    return OTHER_CONSTANT, f"x sqrt(head_dim) = {ratio:.4g} (divisor {1 / (ratios[0] / math.sqrt(layers[0].head_dim)):.4g})"


# ----------------------------------------------------------------------------------------------
# Building small


_SMALL = {
    "hidden_size": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "num_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "n_group": 1,
    "topk_group": 1,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "max_source_positions": 64,
}
LAYERS = 4
"""Layers kept: enough for a pattern such as Llama 4's every-fourth-layer NoPE."""


def _shrink(config: Any, layers: int, depth: int = 0) -> None:
    from transformers import PretrainedConfig

    for name, value in _SMALL.items():
        current = getattr(config, name, None)
        if isinstance(current, int) and not isinstance(current, bool):
            with contextlib.suppress(Exception):
                setattr(config, name, value)
    old = getattr(config, "num_hidden_layers", None)  # through the config's attribute map (GPT-J's n_layer)
    if isinstance(old, int) and not isinstance(old, bool) and old > layers:
        with contextlib.suppress(Exception):
            config.num_hidden_layers = layers
        for name, value in list(vars(config).items()):
            if isinstance(value, list) and len(value) == old:
                setattr(config, name, value[:layers])
    size = vars(config).get("image_size")
    if isinstance(size, int) and not isinstance(size, bool) and size > 224:  # EfficientNet's 600: cost, not scale
        config.image_size = 224
    for name in ("use_timm_backbone", "use_pretrained_backbone"):  # a backbone of its own, nothing downloaded
        if vars(config).get(name) is True:
            setattr(config, name, False)
    if isinstance(vars(config).get("num_experts_per_tok"), int):
        config.num_experts_per_tok = min(config.num_experts_per_tok, 2)
    ids = [v for n, v in vars(config).items() if n.endswith("token_id") and isinstance(v, int) and not isinstance(v, bool)]
    vocab = vars(config).get("vocab_size")
    if isinstance(vocab, int) and vocab > 512:
        config.vocab_size = max([512, *(i + 1 for i in ids)])
    for value in list(vars(config).values()):
        if isinstance(value, PretrainedConfig) and depth < 3:
            _shrink(value, layers, depth + 1)


def tiny_config(model_type: str, overrides: dict | None = None, *, layers: int = LAYERS) -> Any:
    """transformers' default config of ``model_type``, shrunk (width 64, 4 heads of 16, ``layers``
    layers, small vocabulary), then ``overrides`` set on it."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    _shrink(config, layers)
    for name, value in (overrides or {}).items():
        *path, last = name.split(".")  # "text_config.hidden_size": a sub-config's field
        target = config
        for part in path:
            target = getattr(target, part)
        setattr(target, last, value)
    return config


def _load(make: Callable[[str], nn.Module], what: str) -> nn.Module:
    """``make(attn_implementation)`` with the census's attention function (q and k after the norm
    are then read too), else with eager attention; :class:`ProbeFailed` saying ``what`` failed."""
    import transformers

    _register_interface(transformers)
    with warnings.catch_warnings(), _bounded():
        warnings.simplefilter("ignore")
        try:
            return make(INTERFACE)
        except TooLarge:
            raise
        except Exception:
            pass
        try:
            return make("eager")
        except TooLarge:
            raise
        except Exception as exc:
            raise ProbeFailed(f"{what}: {_first_line(exc)}"[:200]) from None


def build(config: Any) -> nn.Module:
    """The base model of ``config`` with random weights. Weight matrices that the config's
    initialisation leaves near zero (BLIP's vision tower: initializer_range 1e-10) are redrawn with
    std 0.02, so that q.k varies enough to read the multiplier (which they do not change)."""
    import transformers

    model = _load(lambda implementation: transformers.AutoModel.from_config(config, attn_implementation=implementation), "cannot be built small")
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and param.is_floating_point() and param.numel() > 1 and float(param.std()) < 1e-4:
                nn.init.normal_(param, std=0.02)
    return model


def _zero_position_tables(model: nn.Module) -> None:
    """Learned relative position biases (T5's buckets, Swin's and BEiT's tables) set to zero: they add
    to the logit, they do not multiply it, and with random values they would read as noise in the fit."""
    for name, param in model.named_parameters():
        if "relative_attention_bias" in name or "relative_position_bias_table" in name:  # T5; Swin, BEiT
            nn.init.zeros_(param)


def _rotary(model: nn.Module, config: Any) -> bool:
    if any("rotary" in type(m).__name__.lower() or "rope" in type(m).__name__.lower() for m in model.modules()):
        return True
    return any(k in vars(config) for k in ("rope_parameters", "rope_theta", "rotary_dim", "rotary_pct"))


@dataclass
class CensusRow:
    """One probed model type (or a released config of one)."""

    model_type: str
    label: str
    cls: str
    why: str
    layers: list[LayerScale]
    fields: dict[str, Any]
    """The config's scale-relevant fields as the type sets them."""
    released: bool = False
    seconds: float = 0.0

    @property
    def below_clip_sqrt(self) -> bool | None:
        """For a clipped type: whether below the clamp every layer's multiplier is 1/sqrt(head_dim)
        within the tolerance at every position (None for any other class)."""
        if self.cls != CLIPPED:
            return None
        return self._at_sqrt(lambda lay: lay.multiplier)

    @property
    def after_norm_sqrt(self) -> bool | None:
        normed = [lay for lay in self.layers if lay.normalised]
        if not normed or any(lay.after_norm is None for lay in normed):
            return None
        return self._at_sqrt(lambda lay: lay.effective or [])

    def _at_sqrt(self, values: Callable[[LayerScale], Sequence[float]]) -> bool:
        """Whether every layer's ``values`` are 1/sqrt(head_dim) within the tolerance."""
        return all(abs(v * math.sqrt(lay.head_dim) - 1) <= TOLERANCE for lay in self.layers for v in values(lay))

    def as_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "label": self.label,
            "class": self.cls,
            "why": self.why,
            "after_norm_sqrt": self.after_norm_sqrt,
            "below_clip_sqrt": self.below_clip_sqrt,
            "released": self.released,
            "fields": self.fields,
            "seconds": round(self.seconds, 3),
            "layers": [asdict(lay) for lay in self.layers],
        }


_FIELDS = (
    "head_dim",
    "query_pre_attn_scalar",
    "attention_multiplier",
    "attn_scale",
    "floor_scale",
    "attn_temperature_tuning",
    "llama_4_scaling_beta",
    "key_multiplier",
    "scale_attn_by_inverse_layer_idx",
    "scale_attn_weights",
    "clip_qkv",
    "attn_logit_softcapping",
    "use_qk_norm",
    "qk_layernorm",
    "rope_parameters",
)


def _fields(config: Any) -> dict[str, Any]:
    found = {}
    for name in _FIELDS:
        value = vars(config).get(name)
        if value is not None:
            found[name] = value if isinstance(value, (int, float, str, bool)) else repr(value)[:120]
    return found


MAX_PARAMETERS = 150_000_000
"""A type still larger than this when built small (sub-models the shrinking does not reach) is
not probed: it would cost more memory and time than the rest of the census."""


def _probe_loaded(model: nn.Module) -> list[LayerScale]:
    """Probe a loaded model over its config's position ladder (T5-style bias tables zeroed)."""
    _zero_position_tables(model)
    config = model.config
    rotary = _rotary(model, config)
    table = getattr(config, "max_position_embeddings", None)
    if _main_input(model) != "input_ids":  # an image or a sound: its tokens' positions are its own
        return probe_model(model, positions=None)
    positions = position_ladder(config, rotary=rotary, limit=None if rotary else (table if isinstance(table, int) else 16))
    return probe_model(model, positions=positions)


MAX_MODULES = 50_000
"""A model that makes more submodules than this while it is built is refused then (BERT makes 18 a
layer: 2,700 layers; building on the meta device takes about 4 s to get there), so that no config,
however deep, holds the check for long or fills memory with module objects."""


@contextlib.contextmanager
def _bounded(*, parameters: bool = True) -> Iterator[None]:
    """Within: building a model raises :class:`TooLarge` at the first submodule past
    :data:`MAX_MODULES` or (with ``parameters``) the first parameter past :data:`MAX_PARAMETERS`
    entries (each parameter counted once), whatever the config's fields are called (torch's global
    registration hooks). On the meta device, where nothing is allocated, only modules cost."""
    from torch.nn.modules import module as registry

    modules, entries = 0, 0
    seen: set[int] = set()

    def on_module(parent: nn.Module, name: str, child: nn.Module | None) -> None:
        nonlocal modules
        modules += 1
        if modules > MAX_MODULES:
            raise TooLarge(f"too large: more than {MAX_MODULES} modules (limit of attnscale check)")

    def on_parameter(parent: nn.Module, name: str, param: nn.Parameter | None) -> None:
        nonlocal entries
        if parameters and param is not None and id(param) not in seen:  # a tied weight counts once
            seen.add(id(param))
            entries += param.numel()
            if entries > MAX_PARAMETERS:
                raise TooLarge(f"too large: more than {MAX_PARAMETERS / 1e6:.0f}M parameters (limit of attnscale check)")

    handles = (registry.register_module_module_registration_hook(on_module), registry.register_module_parameter_registration_hook(on_parameter))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _size(config: Any) -> int | None:
    """Parameters of the base model of ``config``, counted on the meta device (nothing allocated;
    :class:`TooLarge` past :data:`MAX_MODULES`); None where the model cannot be built there."""
    import transformers

    try:
        with warnings.catch_warnings(), torch.device("meta"), _bounded(parameters=False):
            warnings.simplefilter("ignore")
            model = transformers.AutoModel.from_config(config)
    except TooLarge:
        raise
    except Exception:
        return None
    return sum(p.numel() for p in model.parameters())


def _probe_config(config: Any) -> list[LayerScale]:
    size = _size(config)
    if size is None:  # counted after building instead
        model = build(config)
        size = sum(p.numel() for p in model.parameters())
    else:
        model = None
    if size > MAX_PARAMETERS:
        raise ProbeFailed(f"too large when built small: {size / 1e6:.0f}M parameters (limit {MAX_PARAMETERS / 1e6:.0f}M)")
    return _probe_loaded(model if model is not None else build(config))


MAX_LAYERS = 48
"""A hybrid whose attention layers all lie past the first :data:`LAYERS` is built with all of its
layers, up to this many."""


def _fallbacks(model_type: str, config: Any, overrides: dict, reason: str) -> Iterator[tuple[dict, int | None]]:
    """Further (overrides, layers) to try after a small build failed with ``reason``: as many
    key/value heads as query heads (multi-head latent attention codes), the config's own head dim
    (rotary sections and rotary_dim sized for it), and every layer (hybrids with attention late)."""
    values = vars(config)
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(values.get("num_key_value_heads"), int) and isinstance(heads, int) and "num_key_value_heads" not in overrides:
        yield {**overrides, "num_key_value_heads": heads}, None
    import transformers

    original = transformers.AutoConfig.for_model(model_type)
    for prefix in ("", "text_config."):  # the model's own config, or its text tower's
        small, old = config, original
        if prefix:
            small, old = getattr(config, "text_config", None), getattr(original, "text_config", None)
            if small is None or old is None:
                continue
        old_heads, old_width = getattr(old, "num_attention_heads", None), getattr(old, "hidden_size", None)
        dim = getattr(old, "head_dim", None)
        if not isinstance(dim, int) and isinstance(old_heads, int) and isinstance(old_width, int) and old_heads:
            dim = old_width // old_heads
        width, count = getattr(small, "hidden_size", None), getattr(small, "num_attention_heads", None)
        if isinstance(dim, int) and isinstance(count, int) and isinstance(width, int) and dim * count != width:
            yield {f"{prefix}hidden_size": dim * count, **overrides}, None
    depth = getattr(original, "num_hidden_layers", None)
    if "no attention module" in reason and isinstance(depth, int) and depth > LAYERS:
        yield overrides, min(depth, MAX_LAYERS)


def probe_type(model_type: str, overrides: dict | None = None, *, label: str = "", released: bool = False, layers: int = LAYERS) -> CensusRow:
    """Build ``model_type`` small (with ``overrides``), probe it over its position ladder and
    classify it. Where the small build fails, a few fallbacks are tried (:func:`_fallbacks`); raises
    :class:`ProbeFailed` with the first failure's reason where none works."""
    start = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    overrides = dict(overrides or {})
    try:
        config = tiny_config(model_type, overrides, layers=layers)
    except Exception as exc:
        raise ProbeFailed(f"no config: {type(exc).__name__}: {exc}"[:200]) from None
    try:
        found = _probe_config(config)
    except NoAttention:
        raise
    except ProbeFailed as first:
        for more, depth in _fallbacks(model_type, config, overrides, str(first)):
            try:
                config = tiny_config(model_type, more, layers=depth or layers)
                found = _probe_config(config)
                break
            except Exception:
                continue
        else:
            raise first from None
    cls, why = classify(found)
    return CensusRow(model_type, label, cls, why, found, _fields(config), released, time.perf_counter() - start)


def folder_config(path: str | os.PathLike[str]) -> Any:
    """The config of a local checkpoint folder, read as data: ``config.json`` must be a JSON object
    whose ``model_type`` the installed transformers knows. Code the folder ships (an ``auto_map``
    naming its own classes) is never imported: every load passes ``trust_remote_code=False``, so
    transformers neither runs it nor asks on the terminal whether to. Raises
    :class:`UnusableFolder` (nothing loaded) or :class:`ProbeFailed` (a config transformers refuses)."""
    import json

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UnusableFolder(f"{file}: expected a JSON object, got a file that does not parse ({_first_line(exc)}). Fix: point at a HuggingFace model folder") from None
    if not isinstance(data, dict):
        raise UnusableFolder(f"{file}: expected a JSON object, got a JSON {type(data).__name__}. Fix: point at a HuggingFace model folder")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        code = "; the folder's own code (its auto_map) is never run by attnscale" if "auto_map" in data else ""
        raise UnusableFolder(
            f"{file}: expected a model_type of transformers {transformers.__version__}, got {model_type!r}{code}. "
            "Fix: a model type transformers knows (attnscale check hf:MODEL_TYPE lists close ones)"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoConfig.from_pretrained(os.fspath(path), trust_remote_code=False, local_files_only=True)
    except Exception as exc:
        raise ProbeFailed(f"cannot read {file}: {_first_line(exc)}"[:200]) from None


def probe_pretrained(path: str | os.PathLike[str]) -> CensusRow:
    """Probe a local HuggingFace checkpoint folder (offline; its own weights; none of its code run,
    :func:`folder_config`): each layer's effective scale over its position ladder, and the class.
    Counted on the meta device first, a model past :data:`MAX_PARAMETERS` is refused before it is
    built. Raises :class:`UnusableFolder` or :class:`ProbeFailed` where it cannot."""
    start = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import copy

    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = folder_config(path)
    size = _size(config)
    if size is not None and size > MAX_PARAMETERS:
        raise TooLarge(f"too large: {size / 1e6:.0f}M parameters (limit of attnscale check {MAX_PARAMETERS / 1e6:.0f}M)")

    def make(implementation: str) -> nn.Module:
        return transformers.AutoModel.from_pretrained(
            os.fspath(path), config=copy.deepcopy(config), attn_implementation=implementation, local_files_only=True, trust_remote_code=False
        )

    model = _load(make, f"cannot load {os.fspath(path)!r}")
    # in float64: rounded to float32, a trained model's peaked softmax moves the fit by an amount
    # that depends on the CPU's rounding; in float64 it holds the 1e-10 that test_check_model tests
    found = _probe_loaded(model.double())
    cls, why = classify(found)
    return CensusRow(str(config.model_type), os.fspath(path), cls, why, found, _fields(config), True, time.perf_counter() - start)


def model_types() -> list[str]:
    """Every model type of the installed transformers that has a base model class."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return sorted(MODEL_MAPPING_NAMES)


def census(types: Sequence[str] | None = None, *, progress: Callable[[int, int], None] | None = None) -> tuple[list[CensusRow], list[dict]]:
    """Probe every type (default: :func:`model_types`); returns (rows, not probed with reasons).
    A type without attention is among the second, with ``no_attention`` true."""
    import transformers

    transformers.logging.set_verbosity_error()
    types = list(types) if types is not None else model_types()
    rows, missed = [], []
    for i, model_type in enumerate(types):
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows.append(probe_type(model_type))
        except Exception as exc:  # foreign code: any failure is a reason, never the end of the census
            reason = str(exc) if isinstance(exc, ProbeFailed) else f"{type(exc).__name__}: {exc}"[:200]
            missed.append(
                {
                    "model_type": model_type,
                    "reason": reason,
                    "no_attention": isinstance(exc, NoAttention),
                    "seconds": round(time.perf_counter() - start, 3),
                }
            )
        if progress is not None:
            progress(i + 1, len(types))
    return rows, missed
