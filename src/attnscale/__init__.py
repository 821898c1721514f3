"""attnscale: scaled dot-product attention and its 1/sqrt(d_k) scale, done right and measured."""

from importlib.metadata import PackageNotFoundError, version

from .functional import Backend, last_backend, scaled_dot_product_attention
from .masks import (
    CausalAlignment,
    alibi_bias,
    alibi_slopes,
    causal_mask,
    padding_mask,
    sliding_window_mask,
)
from .config import AttentionConfig
from .modules import AttentionOutput, KVCache, MultiHeadAttention
from .score import ScorePath
from .stats import AttentionStats, HeadSummary, normalized_entropy, share_above, summarize
from .tiled import attention_partial, merge_partials
from .varlen import varlen_attention
from .quantized import QuantizedKV, quantize_kv, quantized_attention
from .patch import TorchPatch, patch_torch
from ._validate import InputError, InputTypeError
from . import kernels, variants
from .integrations.hf_autoregister import install as _register_with_transformers

_register_with_transformers()  # attn_implementation="attnscale" works after `import attnscale` alone

try:
    __version__ = version("attnscale")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"


def __getattr__(name: str) -> object:
    # Lazy, so that importing attnscale does not import the diagnostics package.
    if name == "monitor":
        from .diagnostics.monitor import monitor

        return monitor
    if name == "Int8Cache":  # imports transformers
        from .integrations.hf_cache import Int8Cache

        return Int8Cache
    raise AttributeError(f"module 'attnscale' has no attribute {name!r}")

__all__ = [
    "AttentionConfig",
    "AttentionOutput",
    "AttentionStats",
    "Backend",
    "CausalAlignment",
    "HeadSummary",
    "InputError",
    "InputTypeError",
    "Int8Cache",
    "KVCache",
    "MultiHeadAttention",
    "QuantizedKV",
    "ScorePath",
    "TorchPatch",
    "__version__",
    "alibi_bias",
    "alibi_slopes",
    "attention_partial",
    "causal_mask",
    "kernels",
    "last_backend",
    "merge_partials",
    "monitor",
    "normalized_entropy",
    "padding_mask",
    "patch_torch",
    "quantize_kv",
    "quantized_attention",
    "scaled_dot_product_attention",
    "share_above",
    "sliding_window_mask",
    "summarize",
    "variants",
    "varlen_attention",
]
