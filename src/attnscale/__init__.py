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
from .modules import AttentionOutput, KVCache, MultiHeadAttention
from .score import ScorePath
from .stats import AttentionStats

try:
    __version__ = version("attnscale")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "AttentionOutput",
    "AttentionStats",
    "Backend",
    "CausalAlignment",
    "KVCache",
    "MultiHeadAttention",
    "ScorePath",
    "__version__",
    "alibi_bias",
    "alibi_slopes",
    "causal_mask",
    "last_backend",
    "padding_mask",
    "scaled_dot_product_attention",
    "sliding_window_mask",
]
