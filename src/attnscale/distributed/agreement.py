"""Cross-rank agreement: every argument of a collective call checked with one small ``all_gather``.

Each rank encodes its call as a row of int64 entries, one slot group per :class:`Field`, and the
group gathers the rows once, before any other communication. The row has the same length and
dtype on every rank whatever the inputs are (floats travel as their float64 bit patterns, so they
compare exactly; constant tensors as a 64-bit digest of their float64 values), so the gather itself
cannot mismatch. Every rank then reads the same table and raises the same error, naming the
argument and what each rank passed::

    scale: expected the same scale on every rank, got 0.25 on rank 0, 0.5 on rank 1. Fix: ...

A rank whose own checks failed sends a row flagged invalid: it raises its own error, the others
raise one naming it, so that no rank is left waiting in a collective the failing rank never joins.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .._validate import fail

__all__ = ["Field", "check_agreement", "collective_device", "digest", "float_bits", "from_bits", "gather_rows", "text_code", "text_of"]


@dataclass(frozen=True)
class Field:
    """One argument's slot group: ``width`` int64 entries, rendered by ``show`` in error messages."""

    arg: str
    what: str
    width: int
    fix: str
    show: Callable[[tuple[int, ...]], str] = str
    must_agree: bool = True  # False: gathered for the caller's own cross-rank checks (e.g. shard lengths)


def float_bits(x: float) -> int:
    """The float64 bit pattern of ``x`` as an int64: exact, and equal exactly when the floats are."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def text_code(name: str) -> int:
    """The first 8 bytes of ``name`` (e.g. a device type) as an int64; :func:`text_of` reads it back."""
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little", signed=True)


def text_of(code: int) -> str:
    return code.to_bytes(8, "little", signed=True).rstrip(b"\0").decode(errors="replace")


def digest(t: Tensor) -> int:
    """A 64-bit digest of a tensor's shape and float64 values (-0.0 and 0.0 alike), as an int64."""
    values = t.detach().to("cpu", torch.float64) + 0.0  # adding +0.0 turns -0.0 into 0.0
    h = hashlib.blake2b(repr(tuple(t.shape)).encode(), digest_size=8)
    h.update(values.contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the backend of ``group`` takes tensors: the CPU when it can (gloo, or a mixed
    ``"cpu:gloo,cuda:nccl"``), else the current accelerator (NCCL takes CUDA tensors only)."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        types = [part.split(":")[0] for part in backend.split(",")]
    else:
        types = dist.Backend.backend_capability.get(backend, ["cpu"])
    if "cpu" in types:
        return torch.device("cpu")
    return torch.device(types[0], torch.accelerator.current_device_index())


def gather_rows(
    fields: Sequence[Field], values: Sequence[tuple[int, ...]] | None, group: dist.ProcessGroup | None, size: int
) -> list[list[int]]:
    """Every rank's row: a validity flag, then each field's entries. ``values`` None marks this
    rank's arguments as rejected (its row is then the flag 0 and zeros)."""
    width = 1 + sum(f.width for f in fields)
    if values is None:
        row = [0] * width
    else:
        assert [len(v) for v in values] == [f.width for f in fields], "one value tuple per field, of its width"
        row = [1, *(x for v in values for x in v)]
    local = torch.tensor(row, dtype=torch.int64, device=collective_device(group))
    every = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(every, local, group=group)
    return [t.tolist() for t in every]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def check_agreement(fields: Sequence[Field], rows: list[list[int]]) -> list[list[tuple[int, ...]]]:
    """Raise the first disagreement (in field order) or rejected rank; else each rank's field values.

    Only ranks whose own arguments passed call this: a rejected rank raises its own error.
    """
    rejected = [r for r, row in enumerate(rows) if row[0] == 0]
    if rejected:
        fail(
            "group",
            "valid arguments on every rank of the group",
            f"arguments that {_ranks(rejected)} rejected",
            "fix the argument named in the error raised there (every rank must call with valid arguments)",
        )
    per_rank = []
    for row in rows:
        start, values = 1, []
        for f in fields:
            values.append(tuple(row[start : start + f.width]))
            start += f.width
        per_rank.append(values)
    for i, f in enumerate(fields):
        if not f.must_agree:
            continue
        seen: dict[tuple[int, ...], list[int]] = {}
        for r, values in enumerate(per_rank):
            seen.setdefault(values[i], []).append(r)
        if len(seen) > 1:
            got = ", ".join(f"{f.show(v)} on {_ranks(ranks)}" for v, ranks in seen.items())
            fail(f.arg, f"the same {f.what} on every rank", got, f.fix)
    return per_rank
