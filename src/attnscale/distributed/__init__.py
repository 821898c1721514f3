"""Context parallelism: attention over a sequence sharded across a torch.distributed group.

* :func:`context_parallel_attention` — each rank passes its shard of the sequence and gets its
  shard of the output, equal to single-process attention on the whole sequence, forward and
  backward; ``method="ring"`` or ``"ulysses"``, ``layout="contiguous"`` or ``"zigzag"``.
* :func:`shard_sequence` / :func:`unshard_sequence` — cut a sequence into per-rank shards in a
  layout, and put the shards back together.
* :func:`merge_stats` — exact :class:`~attnscale.AttentionStats` of the union of two key sets.

Import it as ``attnscale.distributed``; ``import attnscale`` does not load it. See
``docs/distributed.md`` for memory, communication volume and which method to pick.
"""

from .attention import Method, context_parallel_attention
from .layout import Layout, shard_sequence, unshard_sequence
from .merge import merge_stats

__all__ = ["Layout", "Method", "context_parallel_attention", "merge_stats", "shard_sequence", "unshard_sequence"]
