"""Where the 1/sqrt(d_k) scale goes in modern attention: one small module per variant.

Each variant either transforms q and k before ``attnscale.scaled_dot_product_attention``
(``forward(q, k) -> (q, k)`` plus ``effective_scale``, the ``scale`` to pass) or replaces the
softmax kernel (linear, Performer, INT8). See docs/variants.md for the table.
"""

from .length import ScalableSoftmax, log_length_qk, ssmax_factor, ssmax_qk, visible_key_counts
from .linear import FeatureMap, kernel_attention, linear_attention
from .performer import PerformerAttention, favor_attention, favor_features, gaussian_features
from .qknorm import DoubleShrinkWarning, QKNorm, QKNormKind, QKScale, normalize_qk
from .quant import dequantize_int8, int8_attention, int8_logits, quantize_int8, smooth_keys
from .rope import RopeLayout, RotaryEmbedding, apply_rope, rope_angles, rope_qk
from .temperature import LearnedTemperature, temperature_qk

__all__ = [
    "DoubleShrinkWarning",
    "FeatureMap",
    "LearnedTemperature",
    "PerformerAttention",
    "QKNorm",
    "QKNormKind",
    "QKScale",
    "RopeLayout",
    "RotaryEmbedding",
    "ScalableSoftmax",
    "apply_rope",
    "dequantize_int8",
    "favor_attention",
    "favor_features",
    "gaussian_features",
    "int8_attention",
    "int8_logits",
    "kernel_attention",
    "linear_attention",
    "log_length_qk",
    "normalize_qk",
    "quantize_int8",
    "rope_angles",
    "rope_qk",
    "smooth_keys",
    "ssmax_factor",
    "ssmax_qk",
    "temperature_qk",
    "visible_key_counts",
]
