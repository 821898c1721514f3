r"""The pieces an :class:`attnscale.AttentionConfig` selects, in the order ``MultiHeadAttention`` applies them.

::

    q (B, H, L, D), k (B, Hkv, S_new, D)   projected
    1. qk_norm      normalise q and k per head over D (optionally q times a learned g)
    2. rope         rotate query row i at its aligned position i' = q_offset + i and new key j
                    at S_cached + j (absolute positions; the cache holds rotated keys)
       -- the new keys and values join the cache: k, v now (B, Hkv, S, D) --
    3. scale        learned temperature or Scalable-Softmax's s * log(n_i), folded into q
    4. kernel       softmax: attnscale.scaled_dot_product_attention(scale, softcap, ALiBi, window)
                    linear | performer | int8: the variant function, with the same scale

RoPE comes after the norm (Qwen3, OLMo 2): normalising rotated vectors would break RoPE's
relative-position property, since the norm's per-dim gain (and LayerNorm's mean) do not commute
with the rotation, so ``q . k`` would no longer depend on the offset alone. The scale comes after
both: a multiplier of q applied before the norm would be normalised away (the rotation commutes
with it), and ``n_i`` counts every key, cached ones included.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ._validate import fail
from .config import AttentionConfig, AttentionKernel, PositionalScheme, QKNormMode, ScaleMode
from .masks import CausalAlignment, alibi_slopes
from .variants import (
    LearnedTemperature,
    PerformerAttention,
    QKNorm,
    RotaryEmbedding,
    ScalableSoftmax,
    apply_rope,
    favor_attention,
    int8_attention,
    linear_attention,
    temperature_qk,
)


def effective_scale(config: AttentionConfig, head_dim: int) -> float:
    """The float multiplier of ``q . k`` handed to the kernel (``MultiHeadAttention.scale``);
    learned and length factors live in q."""
    if config.scale in (ScaleMode.INVERSE_SQRT, ScaleMode.LENGTH_SCALED):
        return 1.0 / math.sqrt(head_dim)
    if config.scale is ScaleMode.FIXED:
        assert config.fixed_scale is not None
        return config.fixed_scale
    return 1.0


class VariantStack(nn.Module):
    """QK-Norm, RoPE, the scale mode and the kernel of one :class:`AttentionConfig`, for H heads of dim D.

    Holds only what the config uses: ``qk_norm`` (:class:`QKNorm`), ``rope``
    (:class:`RotaryEmbedding`), ``temperature`` (:class:`LearnedTemperature`, one log-scale when
    not per head), ``length_scale`` (:class:`ScalableSoftmax`), ``performer``
    (:class:`PerformerAttention`); the rest are None. ALiBi slopes come from :meth:`slopes`.
    """

    def __init__(self, config: AttentionConfig, *, num_heads: int, head_dim: int, factory: dict[str, object]) -> None:
        super().__init__()
        self.config = config
        self.num_heads = num_heads
        self._slopes: dict[torch.device, Tensor] = {}
        H, D = num_heads, head_dim
        inits: dict[str, float] = {}  # learned scalars, re-set in the final dtype below
        self.qk_norm = self.rope = self.temperature = self.length_scale = self.performer = None
        if config.qk_norm is not QKNormMode.NONE:
            norm = config.qk_norm_options
            assert norm is not None
            self.qk_norm = QKNorm(
                D,
                kind=config.qk_norm.value,
                scale="learned" if norm.learned_scale else "none",  # the config's scale mode applies afterwards
                seq_len=norm.seq_len,
                scale_init=norm.scale_init,
            )
            if norm.scale_init is not None:
                inits["qk_norm.logit_scale"] = norm.scale_init
            elif norm.learned_scale and norm.seq_len is not None and config.qk_norm is QKNormMode.L2:
                inits["qk_norm.logit_scale"] = math.log2(norm.seq_len * norm.seq_len - norm.seq_len)
            elif norm.learned_scale:
                inits["qk_norm.logit_scale"] = D**-0.5
        if config.positional is PositionalScheme.ROPE:
            rope = config.rope
            assert rope is not None
            if rope.rotary_dim is not None and rope.rotary_dim > D:
                fail("config.rope.rotary_dim", f"an even int <= head_dim = {D}", repr(rope.rotary_dim), f"pass rotary_dim <= {D}, or None to rotate the whole head")
            self.rope = RotaryEmbedding(D, base=rope.base, rotary_dim=rope.rotary_dim, layout=rope.layout)
        if config.scale is ScaleMode.LEARNED:
            temperature = config.temperature
            assert temperature is not None
            self.temperature = LearnedTemperature(H if temperature.per_head else 1, D)
            inits["temperature.log_scale"] = math.log(temperature.init if temperature.init is not None else 1.0 / math.sqrt(D))
        if config.scale is ScaleMode.LENGTH_SCALED:
            length = config.length_scaled
            assert length is not None
            self.length_scale = ScalableSoftmax(H, D, n_train=length.n_train, s_init=length.s_init, learnable=length.learnable)
            if length.s_init is not None:
                inits["length_scale.s"] = length.s_init
            elif length.n_train is not None:
                inits["length_scale.s"] = 1.0 / math.log(length.n_train)
        if config.kernel is AttentionKernel.PERFORMER:
            performer = config.performer
            assert performer is not None
            self.performer = PerformerAttention(D, performer.num_features, orthogonal=performer.orthogonal, seed=performer.seed)
        self.identity = (
            config.kernel is AttentionKernel.SOFTMAX and config.positional is not PositionalScheme.ALIBI
            and all(part is None for part in (self.qk_norm, self.rope, self.temperature, self.length_scale, self.performer))
        )  # fmt: skip
        """Whether every step is a no-op: no check to make, no slopes, q and k as they come."""
        self.to(**{k: v for k, v in factory.items() if v is not None})
        tensors = dict(self.named_parameters()) | dict(self.named_buffers())
        with torch.no_grad():  # a float64 module gets its exact init, not a float32 rounding of it
            for name, value in inits.items():
                tensors[name].fill_(value)

    def slopes(self, device: torch.device) -> Tensor | None:
        """ALiBi slopes (H,) on ``device``, or None without ALiBi.

        Always float32, not a buffer: casting the module to bfloat16 must not round the slopes,
        whose error grows with the distance they multiply.
        """
        if self.config.positional is not PositionalScheme.ALIBI:
            return None
        if device not in self._slopes:
            self._slopes[device] = alibi_slopes(self.num_heads).to(device)
        return self._slopes[device]

    def check_call(
        self,
        *,
        L: int,
        S: int,
        is_causal: bool,
        need_weights: bool,
        return_stats: bool,
        masked: bool,
        cached: bool,
    ) -> None:
        """Reject forward options the chosen kernel cannot honour (before any compute)."""
        kernel = self.config.kernel
        if kernel is AttentionKernel.SOFTMAX:
            return
        on = f"with kernel={kernel.value!r}"
        only_softmax = "use kernel='softmax' for it"
        if need_weights:
            fail("need_weights", f"False {on} (only the softmax kernel returns attention weights)", "True", only_softmax)
        if return_stats:
            fail("return_stats", f"False {on} (the statistics describe a softmax)", "True", only_softmax)
        if masked:
            fail("attn_mask", f"None and key_mask None {on} (it supports is_causal only)", "a mask", f"{only_softmax}, or drop the padding")
        if kernel is AttentionKernel.INT8:
            return
        if cached:
            fail("cache", f"None {on} (its running sums are not cached)", "a KVCache", "run the whole sequence at once, or decode with kernel='softmax' or 'int8'")
        if is_causal and L != S:
            fail("is_causal", f"False when L != S {on} (query i sees keys 0..i)", f"True with L = {L}, S = {S}", "pass equal lengths, or is_causal=False")

    def transform_qk(self, q: Tensor, k: Tensor, *, q_start: int, k_start: int) -> tuple[Tensor, Tensor]:
        """Steps 1 and 2: q (B, H, L, D) and new keys k (B, Hkv, S_new, D), keys starting at ``k_start``."""
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        if self.rope is not None:
            rope = self.rope
            opts = {"base": rope.base, "rotary_dim": rope.rotary_dim, "layout": rope.layout}
            # Positions, not an offset: bottom-right rows of L > S sit before key 0 (they see no key).
            q = apply_rope(q, positions=torch.arange(q_start, q_start + q.shape[-2], device=q.device), **opts)
            k = apply_rope(k, offset=k_start, **opts)
        return q, k

    def fold_scale(
        self,
        q: Tensor,
        k: Tensor,
        *,
        is_causal: bool,
        alignment: CausalAlignment,
        mask: Tensor | None,
    ) -> Tensor:
        """Step 3: q (B, H, L, D) times the learned temperature or the length factor; k is all S keys."""
        if self.temperature is not None:
            log_scale = self.temperature.log_scale.expand(q.shape[-3])  # (H,): one per head, or one shared
            q, _ = temperature_qk(q, k, log_scale)
        if self.length_scale is not None:
            q, _ = self.length_scale(q, k, is_causal=is_causal, causal_alignment=alignment, window=self.config.window, attn_mask=mask)
        return q

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, is_causal: bool, alignment: CausalAlignment) -> Tensor:
        """Step 4 for the non-softmax kernels: q (B, H, L, D), k, v (B, Hkv, S, D) -> (B, H, L, D)."""
        config = self.config
        if config.kernel is AttentionKernel.LINEAR:
            assert config.linear is not None
            if scale != 1.0:
                q = q * scale  # before the feature map: 1/sqrt(D) here is linear_attention's scale_queries=True
            return linear_attention(q, k, v, feature_map=config.linear.feature_map, is_causal=is_causal)
        if config.kernel is AttentionKernel.PERFORMER:
            assert self.performer is not None
            return favor_attention(q, k, v, self.performer.projection, is_causal=is_causal, scale=scale)
        options = config.int8
        assert options is not None
        return int8_attention(
            q,
            k,
            v,
            is_causal=is_causal,
            causal_alignment=alignment,
            scale=scale,
            block_q=options.block_q,
            block_k=options.block_k,
            smooth_k=options.smooth_k,
        )

    def extra_repr(self) -> str:
        default = AttentionConfig()
        changed = [f"{name}={getattr(self.config, name)!s}" for name in ("positional", "qk_norm", "scale", "kernel") if getattr(self.config, name) != getattr(default, name)]
        changed += [f"{name}={getattr(self.config, name)}" for name in ("softcap", "window") if getattr(self.config, name) is not None]
        return ", ".join(changed)
