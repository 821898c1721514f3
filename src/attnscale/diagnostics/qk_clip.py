"""QK-Clip (Kimi K2, 2025, the clip of MuonClip): keep each head's largest attention logit at most tau.

After an optimizer step, every head ``h`` whose max logit ``S_max(h)`` in the step exceeded ``tau``
gets ``gamma_h = tau / S_max(h)``, and its query and key projections are rescaled in place so
that ``q_h . k_h`` shrinks by exactly ``gamma_h``:

* one key head per query head (H = Hkv): the rows of ``W_q`` and ``W_k`` that produce head ``h``
  (and their biases) are multiplied by ``sqrt(gamma_h)`` each;
* shared key heads (GQA / MQA, Hkv < H): key head ``j`` serves query heads ``j*G .. j*G + G-1``,
  so rescaling it would move heads under tau too. The query rows of head ``h`` take the whole
  ``gamma_h`` and the keys stay as they are.

Heads at or under tau are multiplied by exactly 1, so their outputs are bit for bit what they
were. Biases of the projections are rescaled with their rows, so
``q = W_q x + b_q`` scales exactly. The max logit is read after the scale; the clip then
makes ``scale * q.k`` at most tau for the same inputs. Additive terms that are not q.k (ALiBi,
a float mask, T5's position bias) and a softcap are not rescaled: with them ``S_max`` after the
clip is only approximately tau. RoPE commutes with the rescale (a rotation of each pair).
QK-Norm normalises q and k after the projections, so rescaling them does nothing: such layers
are refused.

The max logits come from :func:`attnscale.monitor` (a :class:`~attnscale.diagnostics.monitor.StepRecord`
or :class:`~attnscale.diagnostics.monitor.MonitorReport`, recorded every step) or from a mapping
``{layer name: (H,) max logits}``. Layers are found by the qualified names the monitor records:

* :class:`attnscale.MultiHeadAttention` (``q_proj`` / ``k_proj``);
* HuggingFace BERT-style self-attention (``query`` / ``key`` Linear, ``num_attention_heads``);
* HuggingFace GPT-2 (``c_attn``, the fused Conv1D whose first two thirds of columns are q and k);
* HuggingFace Llama-family attention (``q_proj`` / ``k_proj``, GQA from the config);
* multi-head latent attention (DeepSeek-V2/V3, Kimi K2: ``q_b_proj`` or ``q_proj``,
  ``kv_a_proj_with_mqa``, ``kv_b_proj``). Each head's query is ``[q_nope | q_rope]`` and its key
  ``[k_nope | k_rope]``, where ``k_nope`` is the head's own (rows of ``kv_b_proj``) and ``k_rope``
  one vector shared by every head (``kv_a_proj_with_mqa``). The clip multiplies head ``h``'s
  ``q_nope`` and ``k_nope`` rows by ``sqrt(gamma_h)`` each and its ``q_rope`` rows by ``gamma_h``,
  and leaves the shared ``k_rope`` (and the values) as they are, so that both parts of
  ``q_h . k_h`` shrink by exactly ``gamma_h`` and no other head moves. The norms on the latent
  vectors (``q_a_layernorm``, ``kv_a_layernorm``) come before these projections, so they do not
  undo the rescale.

>>> import torch, attnscale
>>> from attnscale.diagnostics.qk_clip import qk_clip
>>> torch.manual_seed(0) and None
>>> mha = attnscale.MultiHeadAttention(16, num_heads=2)
>>> with torch.no_grad():
...     _ = mha.q_proj.weight.mul_(20.0)
>>> x = torch.randn(1, 8, 16)
>>> with attnscale.monitor(mha) as mon, torch.no_grad():
...     _ = mha(x)
>>> before = [h.max_logit for h in mon.report().heads]
>>> tau = (before[0] + before[1]) / 2  # between the two heads' max logits
>>> qk_clip(mha, mon.report(), tau).count
1
>>> with attnscale.monitor(mha) as mon, torch.no_grad():
...     _ = mha(x)
>>> after = [h.max_logit for h in mon.report().heads]
>>> [round(a / min(b, tau), 5) for a, b in zip(after, before)]
[1.0, 1.0]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._validate import fail
from ..config import QKNormMode
from ..modules import MultiHeadAttention
from .monitor import MonitorReport, StepRecord

__all__ = ["ClipResult", "qk_clip"]


@dataclass(frozen=True)
class _Projections:
    """Views of one layer's q and k parameters whose dim ``dim`` is head-major: (H * D) and (Hkv * D)."""

    q: tuple[tuple[Tensor, int], ...]
    k: tuple[tuple[Tensor, int], ...]
    H: int
    Hkv: int
    D: int


def _linear_views(linear: nn.Module) -> tuple[tuple[Tensor, int], ...]:
    views = [(linear.weight, 0)]  # (out, in): one row per output feature
    if getattr(linear, "bias", None) is not None:
        views.append((linear.bias, 0))
    return tuple(views)


_QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm", "q_ln", "k_ln")
"""Names HF attention layers give the norms they apply to q and k after the projections (Qwen3,
Gemma 3, OLMo 2, Cohere, Chameleon, Persimmon, ...)."""


@dataclass(frozen=True)
class _Latent:
    """One multi-head latent attention layer: per head, ``nope + rope`` rows of ``q`` and ``nope + v``
    rows of ``kv_b`` (head-major)."""

    q: nn.Linear
    kv_b: nn.Linear
    H: int
    nope: int
    rope: int
    v: int


def _latent(layer: str, module: nn.Module) -> _Latent | None:
    q = getattr(module, "q_b_proj", None) or getattr(module, "q_proj", None)
    kv_b = getattr(module, "kv_b_proj", None)
    if not (isinstance(q, nn.Linear) and isinstance(kv_b, nn.Linear) and isinstance(getattr(module, "kv_a_proj_with_mqa", None), nn.Linear)):
        return None
    config = getattr(module, "config", None)
    dims = [getattr(module, n, None) or getattr(config, n, None) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    H = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None)
    if not all(isinstance(d, int) for d in [*dims, H]):
        fail("model", "a latent attention layer with qk_nope_head_dim, qk_rope_head_dim, v_head_dim and num_heads", f"{type(module).__name__} at {layer!r}", "clip it by hand: q_nope and k_nope rows by sqrt(gamma), q_rope rows by gamma", exc=TypeError)
    nope, rope, v = dims
    if q.out_features != H * (nope + rope) or kv_b.out_features != H * (nope + v):
        fail("model", f"q rows H x (nope + rope) = {H * (nope + rope)} and kv_b rows H x (nope + v) = {H * (nope + v)}", f"{q.out_features} and {kv_b.out_features} at {layer!r}", "clip it by hand", exc=TypeError)
    return _Latent(q, kv_b, H, nope, rope, v)


def _scale_latent(proj: _Latent, gamma: Tensor) -> None:
    """Head h: q_nope and k_nope rows times sqrt(gamma_h), q_rope rows times gamma_h; the shared
    k_rope and the values untouched."""
    root, H = gamma.sqrt(), proj.H
    q_factor = torch.cat([root[:, None].expand(H, proj.nope), gamma[:, None].expand(H, proj.rope)], dim=1).reshape(-1)
    k_factor = torch.cat([root[:, None].expand(H, proj.nope), torch.ones(H, proj.v, dtype=gamma.dtype)], dim=1).reshape(-1)
    for linear, factor in ((proj.q, q_factor), (proj.kv_b, k_factor)):
        linear.weight.mul_(factor.to(linear.weight.dtype)[:, None])
        if linear.bias is not None:
            linear.bias.mul_(factor.to(linear.bias.dtype))


def _projections(layer: str, module: nn.Module) -> _Projections | _Latent:
    norms = [name for name in _QK_NORMS if isinstance(getattr(module, name, None), nn.Module)]
    if norms:
        # A norm after the projection undoes a scale on its rows (per head, or across heads where
        # it spans them): the clip would report heads clipped while their logits stay put.
        fail("model", f"attention layers without QK-Norm ({layer!r} normalises q and k after the projections: {', '.join(norms)})", f"{type(module).__name__} with {', '.join(norms)}", "QK-Norm already bounds the logits; do not clip this model")
    if isinstance(module, MultiHeadAttention):
        if module.config.qk_norm is not QKNormMode.NONE:
            fail("model", f"attention layers without QK-Norm ({layer!r} normalises q and k after the projections)", f"qk_norm={module.config.qk_norm.value!r}", "QK-Norm already bounds the logits; do not clip this model")
        return _Projections(_linear_views(module.q_proj), _linear_views(module.k_proj), module.num_heads, module.num_kv_heads, module.head_dim)
    if isinstance(getattr(module, "query", None), nn.Linear) and isinstance(getattr(module, "key", None), nn.Linear) and hasattr(module, "num_attention_heads"):
        H = module.num_attention_heads
        return _Projections(_linear_views(module.query), _linear_views(module.key), H, H, module.attention_head_size)
    c_attn = getattr(module, "c_attn", None)
    if c_attn is not None and hasattr(module, "split_size") and not getattr(module, "is_cross_attention", False):
        E = module.split_size
        w, b = c_attn.weight, c_attn.bias  # Conv1D: weight (E_in, 3E), columns q | k | v
        q = ((w[:, :E], 1), (b[:E], 0))
        k = ((w[:, E : 2 * E], 1), (b[E : 2 * E], 0))
        return _Projections(q, k, module.num_heads, module.num_heads, module.head_dim)
    latent = _latent(layer, module)
    if latent is not None:
        return latent
    config = getattr(module, "config", None)
    if isinstance(getattr(module, "q_proj", None), nn.Linear) and isinstance(getattr(module, "k_proj", None), nn.Linear) and config is not None:
        H = config.num_attention_heads
        Hkv = getattr(config, "num_key_value_heads", None) or H
        return _Projections(_linear_views(module.q_proj), _linear_views(module.k_proj), H, Hkv, module.head_dim)
    fail(
        "model",
        "attention layers with named q and k projections (attnscale.MultiHeadAttention, BERT, GPT-2, Llama-family or latent attention)",
        f"{type(module).__name__} at {layer!r}",
        "clip only models of these kinds, or rescale the projections yourself by sqrt(tau / max_logit) per head",
        exc=TypeError,
    )


def _scale_heads(views: Sequence[tuple[Tensor, int]], factor: Tensor, D: int) -> None:
    """Multiply head h's slice (head-major along ``dim``) of each view by ``factor[h]``, in place."""
    for t, dim in views:
        per_feature = factor.to(t.dtype).repeat_interleave(D)  # (heads * D,)
        shape = [1] * t.ndim
        shape[dim] = per_feature.numel()
        t.mul_(per_feature.view(shape))


@dataclass(frozen=True)
class ClipResult:
    """Which heads were clipped, per layer, and by what factor ``gamma = tau / S_max`` of their logits."""

    clipped: Mapping[str, tuple[tuple[int, float], ...]]

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.clipped.values())


def _max_logits(source: object) -> dict[str, list[float | None]]:
    if isinstance(source, (StepRecord, MonitorReport)):
        out: dict[str, list[float | None]] = {}
        for h in source.heads:
            row = out.setdefault(h.layer, [])
            row.extend([None] * (h.head + 1 - len(row)))
            row[h.head] = h.max_logit
        return out
    if isinstance(source, Mapping):
        out = {}
        for layer, values in source.items():
            values = values.detach().double().flatten().tolist() if isinstance(values, Tensor) else list(values)
            out[layer] = [None if v is None else float(v) for v in values]
        return out
    fail("max_logits", "a StepRecord, a MonitorReport or a mapping {layer: per-head max logits}", type(source).__name__, "pass mon.step() or mon.report() of attnscale.monitor", exc=TypeError)


def qk_clip(model: nn.Module, max_logits: StepRecord | MonitorReport | Mapping[str, Tensor | Sequence[float]], tau: float) -> ClipResult:
    """Rescale, in place, the q and k projections of every head whose max logit exceeded ``tau``
    (see the module docstring). Call it after the optimizer step, with the max logits of that
    step's forward pass. Returns the clipped heads. Everything is checked before any weight changes."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        fail("tau", "a finite float > 0 (the largest logit to allow)", repr(tau), "pass e.g. tau=100.0")
    if not isinstance(model, nn.Module):
        fail("model", "a torch.nn.Module", type(model).__name__, "pass the model the monitor watched", exc=TypeError)
    logits = _max_logits(max_logits)
    # The monitor names the model itself, when it is the attention layer, by its class name.
    modules = {name or type(model).__name__: m for name, m in model.named_modules()}
    plan = []
    for layer, values in logits.items():
        if layer not in modules:
            fail("max_logits", f"layer names of this model (e.g. {next(iter(modules))!r})", repr(layer), "record the max logits of this model with attnscale.monitor(model)")
        proj = _projections(layer, modules[layer])
        if len(values) != proj.H:
            fail("max_logits", f"{proj.H} per-head values for {layer!r}", f"{len(values)}", "pass one max logit per query head")
        over = [(h, tau / v) for h, v in enumerate(values) if v is not None and math.isfinite(v) and v > tau]
        if over:
            plan.append((layer, proj, over))
    with torch.no_grad():
        for _, proj, over in plan:
            gamma = torch.ones(proj.H, dtype=torch.float64)
            for h, g in over:
                gamma[h] = g
            if isinstance(proj, _Latent):
                _scale_latent(proj, gamma)
            elif proj.Hkv == proj.H:
                _scale_heads(proj.q, gamma.sqrt(), proj.D)
                _scale_heads(proj.k, gamma.sqrt(), proj.D)
            else:
                _scale_heads(proj.q, gamma, proj.D)
    return ClipResult({layer: tuple(over) for layer, _, over in plan})
