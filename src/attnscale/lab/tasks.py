"""Synthetic tasks whose answer can only be found by attention.

Both tasks share one layout. A sequence has ``S`` context positions followed by ``Q`` query
positions; position ``t`` carries a key token ``keys[t]`` and a value token ``values[t]`` (query
positions carry the blank value ``n_values``). Every position attends to the ``S`` context
positions only (:meth:`Task.attend_mask`), and the model must name, at each query position, the
value stored at the context position that the query points to. Without attention a query
position sees nothing but its own key token, so it can do no better than guessing (1 / n_values).

* :class:`MQAR` - multi-query associative recall (Arora et al. 2023, "Zoology"): ``S`` key-value
  pairs with distinct random keys, then ``Q`` queries drawn from those keys; the answer is the
  value paired with the queried key. Key and value share one position (their embeddings are
  summed) so that a single attention layer solves it; in the interleaved layout a first layer
  must first copy each key onto its value, which multiplies the training steps.
* :class:`PointerCopy` - hard routing: ``S`` random values at positions ``0..S-1`` (the key token
  of context position ``i`` is ``i``), then ``Q`` pointer tokens ``S + p``; the answer is the value
  at position ``p``. Query and context keys come from disjoint vocabularies, so the model must
  learn which pointer routes to which position, and any attention mass off position ``p`` mixes
  in a wrong value: the solution is one-hot attention.

Batches come from a dedicated ``torch.Generator``, so data is reproducible whatever else draws
from torch's global generator (model initialisation, dropout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MQAR", "PointerCopy", "RecallBatch", "Task", "oracle_predictions"]


@dataclass(frozen=True)
class RecallBatch:
    """One batch: ``keys``/``values`` (B, S + Q) token ids, ``targets`` (B, Q) value ids of the
    queries, ``sources`` (B, Q) the context position each query must read."""

    keys: Tensor
    values: Tensor
    targets: Tensor
    sources: Tensor

    @property
    def num_queries(self) -> int:
        return self.targets.shape[-1]


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}. Pass a count of at least 1.")


@dataclass(frozen=True)
class Task:
    """Sizes shared by both tasks: ``context`` positions ``S``, ``queries`` ``Q``, vocabularies."""

    context: int
    queries: int
    n_keys: int
    n_values: int

    def __post_init__(self) -> None:
        for name in ("context", "queries", "n_keys", "n_values"):
            _check_positive(name, getattr(self, name))

    @property
    def length(self) -> int:
        """Sequence length ``S + Q``."""
        return self.context + self.queries

    @property
    def key_vocab(self) -> int:
        """Number of key token ids the model must embed."""
        return self.n_keys

    @property
    def value_vocab(self) -> int:
        """Number of value token ids the model must embed: the values plus the blank one."""
        return self.n_values + 1

    def sample(self, batch: int, generator: torch.Generator) -> RecallBatch:
        raise NotImplementedError


@dataclass(frozen=True)
class MQAR(Task):
    """Multi-query associative recall: ``context`` pairs with distinct keys out of ``n_keys``.

    >>> import torch
    >>> task = MQAR(context=4, queries=2, n_keys=8, n_values=8)
    >>> b = task.sample(3, torch.Generator().manual_seed(0))
    >>> b.keys.shape, b.values.shape, b.targets.shape
    (torch.Size([3, 6]), torch.Size([3, 6]), torch.Size([3, 2]))
    >>> bool((oracle_predictions(task, b) == b.targets).all())
    True
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.context > self.n_keys:
            raise ValueError(
                f"MQAR needs distinct keys: context ({self.context}) must be <= n_keys ({self.n_keys}); "
                "raise n_keys or lower context."
            )

    def sample(self, batch: int, generator: torch.Generator) -> RecallBatch:
        _check_positive("batch", batch)
        S, Q = self.context, self.queries
        # argsort of uniform noise: S distinct keys per row
        ctx_keys = torch.rand(batch, self.n_keys, generator=generator).argsort(dim=-1)[:, :S]  # (B, S)
        ctx_values = torch.randint(0, self.n_values, (batch, S), generator=generator)  # (B, S)
        sources = torch.randint(0, S, (batch, Q), generator=generator)  # (B, Q)
        q_keys = ctx_keys.gather(1, sources)  # (B, Q)
        targets = ctx_values.gather(1, sources)  # (B, Q)
        blank = torch.full((batch, Q), self.n_values, dtype=torch.long)
        return RecallBatch(
            keys=torch.cat([ctx_keys, q_keys], dim=1),
            values=torch.cat([ctx_values, blank], dim=1),
            targets=targets,
            sources=sources,
        )


@dataclass(frozen=True)
class PointerCopy(Task):
    """Copy the value at the position a pointer names; ``n_keys`` must be ``2 * context``.

    Build it with :meth:`of` to get the key vocabulary right.

    >>> import torch
    >>> task = PointerCopy.of(context=5, queries=3, n_values=10)
    >>> b = task.sample(2, torch.Generator().manual_seed(1))
    >>> b.keys[0, :5].tolist()
    [0, 1, 2, 3, 4]
    >>> bool((b.keys[:, 5:] == b.sources + 5).all())
    True
    >>> bool((oracle_predictions(task, b) == b.targets).all())
    True
    """

    @classmethod
    def of(cls, *, context: int, queries: int, n_values: int) -> PointerCopy:
        return cls(context=context, queries=queries, n_keys=2 * context, n_values=n_values)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_keys != 2 * self.context:
            raise ValueError(
                f"PointerCopy needs n_keys == 2 * context ({2 * self.context}); got {self.n_keys}. "
                "Build it with PointerCopy.of(context=..., queries=..., n_values=...)."
            )

    def sample(self, batch: int, generator: torch.Generator) -> RecallBatch:
        _check_positive("batch", batch)
        S, Q = self.context, self.queries
        ctx_keys = torch.arange(S).expand(batch, S)  # (B, S)
        ctx_values = torch.randint(0, self.n_values, (batch, S), generator=generator)  # (B, S)
        sources = torch.randint(0, S, (batch, Q), generator=generator)  # (B, Q)
        targets = ctx_values.gather(1, sources)  # (B, Q)
        blank = torch.full((batch, Q), self.n_values, dtype=torch.long)
        return RecallBatch(
            keys=torch.cat([ctx_keys, sources + S], dim=1),
            values=torch.cat([ctx_values, blank], dim=1),
            targets=targets,
            sources=sources,
        )


def oracle_predictions(task: Task, batch: RecallBatch) -> Tensor:
    """The exact solution, by hard lookup: for each query, the value at the context position whose
    key matches. Proves a batch is solvable from its tokens alone; (B, Q) value ids."""
    S = task.context
    ctx_keys, q_keys = batch.keys[:, :S], batch.keys[:, S:]  # (B, S), (B, Q)
    if isinstance(task, PointerCopy):
        q_keys = q_keys - S
    match = q_keys.unsqueeze(-1) == ctx_keys.unsqueeze(-2)  # (B, Q, S)
    assert bool((match.sum(-1) == 1).all()), "every query must match exactly one context key"
    position = match.float().argmax(dim=-1)  # (B, Q)
    return batch.values[:, :S].gather(1, position)
