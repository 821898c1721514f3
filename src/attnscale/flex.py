"""``backend="flex"``: attnscale's score path on torch's FlexAttention (the CUDA backend).

The score path of :mod:`attnscale.score` maps onto FlexAttention's two hooks::

    scale                          flex_attention(scale=...)      (applied before score_mod)
    softcap(s) = cap tanh(s / cap) score_mod
    - slope_h |i' - j|  (ALiBi)    score_mod, i' = q_idx + q_offset
    + float attn_mask              score_mod (its -inf entries hide keys through mask_mod)
    causal, window, bool mask      mask_mod -> BlockMask (both causal alignments via q_offset)
    GQA                            enable_gqa (query head h reads key/value head h // G)
    packed sequences (varlen)      mask_mod: same sequence; i' = t + shift[sequence of t]
    sinks                          epilogue: out * sigmoid(lse - sink_h)

Causal, windows and packed sequences leave each query row an interval of visible keys, so their
BlockMasks are built from those intervals in O(L + number of blocks) memory
(:func:`interval_block_mask`) rather than by evaluating the mask_mod on every (query, key) pair.

Sinks are not a score_mod: a sink has no key and no value, it only takes
``exp(sink) / (exp(lse) + exp(sink))`` of each row's mass, so the finished output is rescaled by
``exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``, with the gradient of that formula.

Statistics: the log-sum-exp comes from FlexAttention (``AuxRequest(lse=True)``, natural log,
differentiable); the max logit, max probability, entropy and visible-key count come from a second
pass over query chunks (:func:`attnscale.dense.dense_weights` on ``CHUNK_SCORES`` scores at a
time, so memory stays O(L + S) per chunk), which carries no gradient, as on the tiled kernel.

Where it runs: on CUDA tensors through ``torch.compile(flex_attention)`` (constants ride in
captured tensors, so new softcap values, slopes or masks reuse the compiled code; a second shape
compiles once more with dynamic shapes, which then serve every shape (on CPU every shape compiles
once); positional block masks are cached). On CPU, torch 2.13's compiled FlexAttention has forward only, no log-sum-exp and no
float64, and its eager implementation has no backward: there this backend runs the compiled
forward for inference in float32/bfloat16/float16 without sinks or statistics, the eager
implementation otherwise, and refuses inputs that require grad. Under torch.compile the call enters the caller's graph as one
``flex_attention`` op.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from ._tracing import tracing
from ._validate import fail
from .dense import accumulation_dtype, dense_attention, dense_weights
from .masks import slopes_learned
from .score import ScorePath
from .stats import AttentionStats

__all__ = ["BLOCK", "CHUNK_SCORES", "RECOMPILE_LIMIT", "Documents", "available", "cannot", "flex_attention", "flex_varlen_attention", "interval_block_mask", "key_intervals", "mods", "sink_epilogue"]

CHUNK_SCORES = 2**24
"""Scores ``B * H * rows * S`` per chunk of the statistics pass (64 MiB in float32)."""

_COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes compiled FlexAttention takes (on CPU and on GPU)."""

try:  # FlexAttention with AuxRequest: torch >= 2.9
    from torch.nn.attention import flex_attention as _flex_module
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask

    _IMPORT_ERROR: str | None = None
except ImportError as err:  # pragma: no cover - torch 2.13 has it
    _flex_module = None
    _IMPORT_ERROR = f"torch {torch.__version__} has no FlexAttention with AuxRequest ({err})"


def available() -> bool:
    """Whether this torch has FlexAttention (with ``AuxRequest``)."""
    return _IMPORT_ERROR is None


def cannot(
    *,
    device: torch.device,
    dropout_p: float,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    tensors: tuple[Tensor, ...],
) -> str | None:
    """Why ``backend="flex"`` cannot run this call (None if it can)."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if dropout_p > 0.0:
        return "dropout (FlexAttention has none)"
    grad = torch.is_grad_enabled()
    if slopes_learned(alibi_slopes):
        return "alibi_slopes that require grad (the flex backend treats them as constants)"
    if attn_mask is not None and attn_mask.requires_grad and grad:
        return "a float attn_mask that requires grad (the flex backend treats it as a constant)"
    if device.type == "cpu" and grad and any(t.requires_grad for t in tensors):
        return "inputs that require grad on CPU (torch's FlexAttention has no CPU backward)"
    if device.type == "cpu" and sinks is not None and tracing(*tensors):
        return "sinks under torch.compile on CPU (torch's CPU FlexAttention template cannot fuse their epilogue)"
    if device.type != "cpu":
        return _gpu_cannot(*tensors)
    return None


def _gpu_cannot(query: Tensor, key: Tensor, value: Tensor) -> str | None:
    """What torch 2.13's Triton FlexAttention refuses or does not test (its lowering in
    torch/_inductor/kernel/flex): head dims under 16 (``tl.dot``), float64, and the decoding kernel
    (fewer than 128 query rows) with query heads per key/value head not a power of 2."""
    D, Dv = query.shape[-1], value.shape[-1]
    if min(D, Dv) < 16:
        return f"head dims D = {D}, Dv = {Dv} (FlexAttention's GPU kernels need 16 or more)"
    if query.dtype not in _COMPILED_DTYPES:
        return f"{query.dtype} (FlexAttention's GPU kernels take float32, bfloat16 and float16)"
    G = query.shape[-3] // max(1, key.shape[-3])
    if query.shape[-2] < 128 and G & (G - 1):
        return f"{G} query heads per key/value head with {query.shape[-2]} query rows (FlexAttention's decoding kernel needs a power of 2)"
    return None


def _table(t: Tensor, batch: tuple[int, ...], tail: int) -> Tensor:
    """``t`` broadcast to (*batch, *last ``tail`` dims) and flattened to (B or 1, *those dims): a
    view where the batch dims are all 1, else expanded (copied only where reshape must)."""
    t = t.reshape((1,) * (len(batch) + tail - t.ndim) + tuple(t.shape))
    inner = tuple(t.shape[-tail:])
    if all(n == 1 for n in t.shape[:-tail]):
        return t.reshape(1, *inner)
    return t.expand(*batch, *inner).reshape(math.prod(batch), *inner)


def _pick(n: int, index: Tensor) -> Tensor | int:
    """The index into a dim of size ``n``: ``index`` itself, or 0 where the dim broadcasts."""
    return index if n > 1 else 0


_ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
_MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True)
class Documents:
    """Packed sequences as one FlexAttention problem (B = 1): which sequence each packed query row
    (``doc_q``, (total_q,)) and key row (``doc_k``, (total_k,)) belongs to, and per sequence b its
    first and one-past-last key row (``k_start``, ``k_end``, (B,)) and ``shift[b] = cu_k[b + 1] -
    cu_q[b + 1]``: packed query row t of sequence b sits at packed key position ``t + shift[b]``,
    the bottom-right alignment of every sequence at once."""

    doc_q: Tensor
    doc_k: Tensor
    k_start: Tensor
    k_end: Tensor
    shift: Tensor

    @classmethod
    def from_cu_seqlens(cls, cu_q: Tensor, cu_k: Tensor) -> Documents:
        """From cumulative lengths (B + 1,) of validated packed sequences (empty ones allowed)."""
        cu_q, cu_k = cu_q.to(torch.int64), cu_k.to(torch.int64)
        rows_q = torch.arange(int(cu_q[-1]), device=cu_q.device)
        rows_k = torch.arange(int(cu_k[-1]), device=cu_k.device)
        return cls(
            doc_q=torch.searchsorted(cu_q[1:], rows_q, right=True),  # row t: the b with cu_q[b] <= t < cu_q[b + 1]
            doc_k=torch.searchsorted(cu_k[1:], rows_k, right=True),
            k_start=cu_k[:-1],
            k_end=cu_k[1:],
            shift=cu_k[1:] - cu_q[1:],
        )


def mods(
    path: ScorePath,
    *,
    batch: tuple[int, ...] = (1,),
    attn_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    documents: Documents | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    captured: bool = True,
) -> tuple[_ScoreMod | None, _MaskMod | None, tuple[bool, bool]]:
    """FlexAttention's ``score_mod`` and ``mask_mod`` for a score path (see the module docstring),
    with ``flex_attention(scale=path.scale)``; None where nothing is to do. Also whether the mask
    depends on the batch and on the head index (False: ``create_block_mask`` may broadcast it).

    ``attn_mask`` is broadcastable to (*batch, H, L, S) and ``alibi_slopes`` to (*batch, H); the
    batch dims are flattened as FlexAttention's B. ``dtype`` is the accumulation dtype (float32,
    or float64 for float64 inputs) of the captured softcap; the logits are built in the dtype
    FlexAttention hands the score in. With ``captured`` the constants
    (softcap, offset, window sides) are captured as tensors, so that a compiled FlexAttention does
    not recompile when their values change; without it they are Python numbers, as a traced
    caller needs them (torch 2.13's CPU FlexAttention template cannot read a tensor created
    inside the graph). The mask and the slopes are read in their own dtype and converted in the
    mod, so that they stay inputs of the graph.

    With ``documents`` (packed sequences, batch (1,)) a key is visible only to queries of its own
    sequence, every position is aligned per sequence (``path.q_offset`` is unused), and
    ``alibi_slopes`` may be (B, H), one row per sequence.

    >>> import torch
    >>> from torch.nn.attention.flex_attention import flex_attention
    >>> q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
    >>> score_mod, mask_mod, _ = mods(ScorePath(scale=0.5, softcap=2.0))
    >>> import warnings
    >>> with warnings.catch_warnings():  # eager FlexAttention warns that it is not compiled
    ...     warnings.simplefilter("ignore", UserWarning)
    ...     out = flex_attention(q, k, v, score_mod=score_mod, scale=0.5)
    >>> logits = 2.0 * torch.tanh(q @ k.mT * 0.5 / 2.0)
    >>> torch.allclose(out, torch.softmax(logits, -1) @ v, atol=1e-6)
    True
    """
    device = torch.device(device)

    def constant(x: float | int, kind: torch.dtype | None = None) -> Tensor | float | int:
        if not captured:
            return x
        # torch.full fills on the device; torch.tensor would copy from the host and wait for the device
        return torch.full((), x, dtype=kind or (torch.int64 if isinstance(x, int) else torch.get_default_dtype()), device=device)

    if documents is None:
        offset = constant(path.q_offset)

        def aligned(i: Tensor) -> Tensor:
            return i + offset

    else:
        doc_q, doc_k, shift = documents.doc_q, documents.doc_k, documents.shift

        def aligned(i: Tensor) -> Tensor:
            return i + shift[doc_q[i]]

    steps: list[Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]] = []
    if path.softcap is not None:
        cap = constant(path.softcap, dtype)
        steps.append(lambda s, b, h, i, j: cap * torch.tanh(s / cap))
    if alibi_slopes is not None:
        if documents is not None and alibi_slopes.ndim == 2:  # (B, H): a row of slopes per sequence
            per_doc = alibi_slopes.detach()
            steps.append(lambda s, b, h, i, j: s - per_doc[doc_q[i], h].to(s.dtype) * (aligned(i) - j).abs())
        else:
            slopes = _table(alibi_slopes.detach(), batch, 1)  # (B or 1, H)
            Bs = slopes.shape[0]
            steps.append(lambda s, b, h, i, j: s - slopes[_pick(Bs, b), h].to(s.dtype) * (aligned(i) - j).abs())
    keeps: list[_MaskMod] = []
    if documents is not None:
        keeps.append(lambda b, h, i, j: doc_q[i] == doc_k[j])
    by_batch = by_head = False
    if attn_mask is not None:
        table = _table(attn_mask.detach(), batch, 3)  # (B or 1, H or 1, L or 1, S or 1)
        Bm, Hm, Lm, Sm = table.shape
        by_batch, by_head = Bm > 1, Hm > 1

        def at(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return table[_pick(Bm, b), _pick(Hm, h), _pick(Lm, i), _pick(Sm, j)]

        if table.dtype == torch.bool:
            keeps.append(at)
        else:
            additive = table

            def at_float(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
                return additive[_pick(Bm, b), _pick(Hm, h), _pick(Lm, i), _pick(Sm, j)]

            steps.append(lambda s, b, h, i, j: s + at_float(b, h, i, j).to(s.dtype))
            keeps.append(lambda b, h, i, j: at_float(b, h, i, j) != -math.inf)
    if path.causal:
        keeps.append(lambda b, h, i, j: j <= aligned(i))
    if path.window is not None:
        left, right = path.window
        if left is not None:
            lo = constant(left)
            keeps.append(lambda b, h, i, j: j >= aligned(i) - lo)
        if right is not None:
            hi = constant(right)
            keeps.append(lambda b, h, i, j: j <= aligned(i) + hi)

    score_mod = None
    if steps:

        # The score arrives in FlexAttention's accumulation dtype (float32 in its compiled kernels)
        # and stays in it: casting it to float32 and back inside the mod made torch 2.13's compiled
        # CPU FlexAttention return wrong float16 outputs (off by up to 1.6 with softcap 0.7;
        # tests/test_flex.py::test_half_precision_softcap_through_the_compiled_forward).
        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            s = score
            for step in steps:
                s = step(s, b, h, q_idx, kv_idx)
            return s

    mask_mod = None
    if keeps:

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            keep = keeps[0](b, h, q_idx, kv_idx)
            for more in keeps[1:]:
                keep = keep & more(b, h, q_idx, kv_idx)
            return keep

    return score_mod, mask_mod, (by_batch, by_head)


def _clamped(path: ScorePath, L: int, S: int) -> ScorePath:
    """``path`` with window sides beyond any distance of the problem made unlimited, so that the
    int32/int64 index arithmetic of a mask_mod never meets a side near 2**62."""
    if path.window is None:
        return path
    reach = L + S + abs(path.q_offset)
    left, right = (None if side is not None and side >= reach else side for side in path.window)
    return dataclasses.replace(path, window=None if left is None and right is None else (left, right))


BLOCK = 128
"""FlexAttention's sparse block (``create_block_mask``'s default): BlockMasks here use it."""


def key_intervals(path: ScorePath, L: int, S: int, device: torch.device, documents: Documents | None = None) -> tuple[Tensor, Tensor]:
    """The keys causal, window and packing leave visible to each query row: row i sees exactly
    keys ``lo[i] <= j <= hi[i]`` (int64 (L,) each; ``lo > hi`` where it sees none). Masks and
    ALiBi aside, every visibility attnscale has is such an interval per row."""
    i = torch.arange(L, device=device)
    if documents is None:
        a = i + path.q_offset  # aligned position
        lo, hi = torch.zeros_like(i), torch.full_like(i, S - 1)
    else:
        d = documents.doc_q
        a = i + documents.shift[d]
        lo, hi = documents.k_start[d], documents.k_end[d] - 1
    if path.causal:
        hi = torch.minimum(hi, a)
    if path.window is not None:
        left, right = path.window
        if left is not None:
            lo = torch.maximum(lo, a - left)
        if right is not None:
            hi = torch.minimum(hi, a + right)
    return lo, hi


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """A (nq, nk) block table as BlockMask's (1, 1, nq) counts and (1, 1, nq, nk) indices (the
    blocks of each row first, in key order), as create_block_mask lays them out."""
    dense = blocks.to(torch.int32)[None, None]
    return dense.sum(-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


def interval_block_mask(lo: Tensor, hi: Tensor, S: int, mask_mod: _MaskMod) -> BlockMask:
    """The BlockMask of rows that see key intervals ``lo..hi`` (:func:`key_intervals`), built
    from per-block bounds in O(L + (L / BLOCK) (S / BLOCK)) memory, where ``create_block_mask``
    evaluates ``mask_mod`` on all L x S pairs. A block is full (``mask_mod`` skipped) only when
    it is whole and every one of its rows sees every one of its keys; partial when the span of its
    rows' intervals meets it, which may include a block that a gap between packed sequences leaves
    empty (``mask_mod`` still hides its keys)."""
    L = lo.shape[0]
    nq, nk = -(-L // BLOCK), -(-S // BLOCK)
    empty = lo > hi
    pad = nq * BLOCK - L

    def per_block(x: Tensor, fill: int, reduce: str) -> Tensor:
        x = torch.nn.functional.pad(x, (0, pad), value=fill).view(nq, BLOCK)
        return x.amin(-1) if reduce == "min" else x.amax(-1)

    lo_any = per_block(torch.where(empty, S, lo), S, "min")[:, None]  # (nq, 1): the span some row sees
    hi_any = per_block(torch.where(empty, -1, hi), -1, "max")[:, None]
    lo_all = per_block(torch.where(empty, S, lo), S, "max")[:, None]  # the keys every row sees (padding: none)
    hi_all = per_block(torch.where(empty, -1, hi), -1, "min")[:, None]
    k0 = torch.arange(nk, device=lo.device) * BLOCK  # (nk,)
    k1 = torch.clamp(k0 + BLOCK, max=S) - 1
    touched = (lo_any <= k1) & (hi_any >= k0)  # (nq, nk)
    full = (lo_all <= k0) & (hi_all >= k1) & (k0 + BLOCK <= S)
    counts, indices = _ordered(touched & ~full)
    full_counts, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(L, S))


@functools.lru_cache(maxsize=32)
def _positional_block_mask(path: ScorePath, L: int, S: int, device: str) -> BlockMask:
    """The BlockMask of causal and window alone, which depends only on its arguments: cached."""
    _, mask_mod, _ = mods(path, device=device)
    assert mask_mod is not None
    return interval_block_mask(*key_intervals(path, L, S, torch.device(device)), S, mask_mod)


def _block_mask(
    path: ScorePath,
    mask_mod: _MaskMod | None,
    by: tuple[bool, bool],
    shape: tuple[int, int, int, int],
    attn_mask: Tensor | None,
    device: torch.device,
    traced: bool,
) -> BlockMask | None:
    """The BlockMask of ``mask_mod`` over (B, H, L, S): positional ones (causal, window) from
    their key intervals, cached except while tracing (a traced BlockMask holds the trace's
    tensors, which must not outlive it); with a bool or float ``attn_mask`` (itself O(L S))
    from ``create_block_mask``."""
    if mask_mod is None:
        return None
    B, H, L, S = shape
    if attn_mask is None:
        if traced:
            return interval_block_mask(*key_intervals(path, L, S, device), S, mask_mod)
        return _positional_block_mask(path, L, S, str(device))
    by_batch, by_head = by
    return create_block_mask(mask_mod, B if by_batch else None, H if by_head else None, L, S, device=device)


RECOMPILE_LIMIT = 64
"""Compilations of FlexAttention kept for this backend's calls. Each structure of mods (which of
softcap, ALiBi, masks, windows, packing), dtype and head dim compiles once (on CPU each shape
too); torch keeps 8 per function by default and then runs FlexAttention eagerly, which holds the
whole score matrix."""


@functools.cache
def _compiled(device_type: str) -> Callable[..., object]:
    # On GPUs automatic dynamic shapes: the first call compiles for its shape, the first call of
    # another shape once more for every shape (a shape family), so decoding's growing S does not
    # recompile. On CPU static shapes: torch 2.13's CPU template generates C++ that does not
    # compile for some dynamic shapes ("cur_qSplitSize1 was not declared"; after a packed call of
    # 342 rows, one of 300 rows with 3 query heads per key head).
    compiled = torch.compile(_flex_module.flex_attention, dynamic=False if device_type == "cpu" else None)

    def call(*args: object, **kwargs: object) -> object:
        limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
        with torch._dynamo.config.patch(recompile_limit=limit), warnings.catch_warnings():
            # torch 2.11's dynamo, tracing FlexAttention's input checks on tensors that require
            # grad, reads .grad of the non-leaf q, k, v (views of the caller's tensors) and warns
            # of it; nothing of ours or the caller's reads it (under an "error" warnings filter,
            # as in tests, the trace failed).
            warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor", category=UserWarning)
            return compiled(*args, **kwargs)

    return call


_CPU_MIN_HEAD_DIM = 24
"""q and k reach compiled CPU FlexAttention with at least this many dims (zero-padded). torch
2.13's CPU template multiplies q k^T in blocks of 16 keys; on a block of 8 keys (a key length
8 mod 16 in some split) with a head dim D below 24 and a multiple of the vector width (8 floats
in AVX2 code, as on CPUs without AVX-512), its micro-GEMM stores 16 columns: the extra 8 land on
the row maxima and sums behind the score buffer and the keys past the block are read. Outputs
were off by up to 1.2 or NaN at D 8 and 16 in float32 and bfloat16
(tests/test_flex.py::test_small_head_dims_in_avx2_code_are_right); from D 24 it takes its other
product, which handles such blocks."""


def _runner(device: torch.device, dtype: torch.dtype, want_lse: bool, traced: bool) -> Callable[..., object]:
    """Which FlexAttention to call: the caller's graph (traced), the compiled one, or on CPU the
    eager one where the compiled one lacks what the call needs (log-sum-exp, float64)."""
    if traced:
        return _flex_module.flex_attention
    if device.type == "cpu" and (want_lse or dtype not in _COMPILED_DTYPES):
        return _eager
    return _compiled(device.type)


def _eager(*args: object, **kwargs: object) -> object:
    with warnings.catch_warnings():  # "called without torch.compile()": on CPU this is the reference path
        warnings.simplefilter("ignore", UserWarning)
        return _flex_module.flex_attention(*args, **kwargs)


def _cpu_compiled_has_lse(device: torch.device) -> bool:
    """torch 2.13's compiled CPU FlexAttention returns no log-sum-exp."""
    return device.type != "cpu"


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    path: ScorePath,
    attn_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
) -> tuple[Tensor, AttentionStats | None]:
    """Attention on validated inputs through FlexAttention (``backend="flex"`` of
    ``scaled_dot_product_attention``): query (..., H, L, D), key (..., Hkv, S, D), value
    (..., Hkv, S, Dv), batch dims broadcast, H a multiple of Hkv, attn_mask broadcastable to
    (..., H, L, S). Returns (out (..., H, L, Dv), stats or None).
    """
    if _IMPORT_ERROR is not None:
        fail("backend", "a torch with FlexAttention", f"'flex' on torch {torch.__version__}", "install torch >= 2.9, or use backend='tiled'")
    batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    H, L, D = query.shape[-3:]
    Hkv, S, Dv = key.shape[-3], key.shape[-2], value.shape[-1]
    B = math.prod(batch)
    if B == 0 or H == 0 or L == 0 or S == 0 or D == 0:  # nothing for a kernel to do: the dense result is exact and cheap
        return dense_attention(query, key, value, path=path, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=return_stats)
    device = query.device
    path = _clamped(path, L, S)
    q = query.expand(*batch, H, L, D).reshape(B, H, L, D)  # (B, H, L, D)
    k = key.expand(*batch, Hkv, S, D).reshape(B, Hkv, S, D)  # (B, Hkv, S, D)
    v = value.expand(*batch, Hkv, S, Dv).reshape(B, Hkv, S, Dv)  # (B, Hkv, S, Dv)
    acc = accumulation_dtype(query.dtype)
    traced = tracing(query, key, value, attn_mask, alibi_slopes, sinks)
    score_mod, mask_mod, by = mods(path, batch=batch, attn_mask=attn_mask, alibi_slopes=alibi_slopes, device=device, dtype=acc, captured=not traced)
    block_mask = _block_mask(path, mask_mod, by, (B, H, L, S), attn_mask, device, traced)
    out, lse = _run(q, k, v, path=path, score_mod=score_mod, block_mask=block_mask, want_lse=sinks is not None or return_stats, traced=traced)
    out = out.reshape(*batch, H, L, Dv)
    lse = None if lse is None else lse.reshape(*batch, H, L)
    return _finish(
        out, lse, lambda: _statistics(query, key, path, attn_mask, alibi_slopes, sinks, (*batch, H, L)), sinks=sinks, return_stats=return_stats, dtype=query.dtype
    )


def _run(
    q: Tensor, k: Tensor, v: Tensor, *, path: ScorePath, score_mod: _ScoreMod | None, block_mask: BlockMask | None, want_lse: bool, traced: bool
) -> tuple[Tensor, Tensor | None]:
    """One FlexAttention call on q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv): the output
    (B, H, L, Dv) and, when ``want_lse`` and the FlexAttention that runs has one (compiled CPU
    FlexAttention has none), the keys' log-sum-exp (B, H, L), natural log."""
    q, k, v = (_readable(t) for t in (q, k, v))
    if q.device.type == "cpu" and not traced and not torch.is_grad_enabled():
        # no graph is recorded here, yet CPU FlexAttention refuses inputs that require grad
        # ("does not support backward on CPU"): detached, they are the same values
        q, k, v = q.detach(), k.detach(), v.detach()
    run = _runner(q.device, q.dtype, want_lse, traced)
    if q.device.type == "cpu" and run is not _eager and q.shape[-1] < _CPU_MIN_HEAD_DIM:
        # Zero dims add nothing to q k^T; the scale is passed, not read from D.
        pad = (0, _CPU_MIN_HEAD_DIM - q.shape[-1])
        q, k = torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad)
    lse_here = want_lse and (run is _eager or _cpu_compiled_has_lse(q.device))
    # Eager FlexAttention builds the scores in the inputs' dtype: 16-bit inputs get float32
    # copies there, so that logits, softmax and log-sum-exp are float32 as in its compiled kernels.
    wide = run is _eager and q.dtype in (torch.float16, torch.bfloat16)
    result = run(
        q.float() if wide else q,
        k.float() if wide else k,
        v.float() if wide else v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=path.scale,
        enable_gqa=True if q.shape[-3] != k.shape[-3] else False,  # noqa: SIM210 - a bool under dynamic shapes too
        return_aux=AuxRequest(lse=True) if lse_here else None,
    )
    out, lse = (result[0], result[1].lse) if lse_here else (result, None)
    return out.to(q.dtype), lse


def _readable(t: Tensor) -> Tensor:
    """``t`` itself when its last dim is dense and no two of its entries share memory, else a
    contiguous copy: torch 2.13's compiled CPU FlexAttention read values expanded along the keys
    and dims (strides 0) as garbage (up to 2e24; tests/test_flex.py)."""
    reach = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride < reach:  # this dim steps inside the span of a smaller one: entries overlap
            return t.contiguous()
        reach = stride * size
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _finish(
    out: Tensor,
    lse: Tensor | None,
    statistics: Callable[[], AttentionStats],
    *,
    sinks: Tensor | None,
    return_stats: bool,
    dtype: torch.dtype,
) -> tuple[Tensor, AttentionStats | None]:
    """Sinks and statistics on FlexAttention's output (..., H, L, Dv) and keys-only log-sum-exp
    (..., H, L), or None where it has none: the statistics come from ``statistics()`` (the second
    pass), and so does the log-sum-exp where FlexAttention gave none (inference only)."""
    acc = accumulation_dtype(dtype)
    lse = None if lse is None else lse.to(acc)
    stats = None
    if return_stats or (sinks is not None and lse is None):
        stats = statistics()
        if lse is None:
            lse = _keys_lse(stats, sinks)
    if sinks is not None:
        assert lse is not None
        out = sink_epilogue(out.to(acc), lse, sinks).to(dtype)
    if stats is not None and lse is not None:
        # the differentiable log-sum-exp of FlexAttention, with the sink where there is one
        total = lse if sinks is None else torch.logaddexp(lse, sinks.to(acc)[..., None])
        stats = dataclasses.replace(stats, lse=total)
    return out, (stats if return_stats else None)


def flex_varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    path: ScorePath,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_stats: bool = False,
) -> tuple[Tensor, AttentionStats | None]:
    """Packed sequences (``varlen_attention``'s layout, validated: q (total_q, H, D), k
    (total_k, Hkv, D), v (total_k, Hkv, Dv), cumulative lengths (B + 1,), total_q and total_k
    above 0) as one FlexAttention call on (1, H, total, D) views: a document mask keeps each
    sequence to its own keys, every sequence aligned bottom-right (``path.q_offset`` unused), no
    padding, and the BlockMask from the per-row key intervals (:func:`interval_block_mask`), so
    blocks between sequences are skipped. ``alibi_slopes`` is (H,) or (B, H). Returns out
    (total_q, H, Dv) and statistics (H, total_q) or None; the statistics' second pass runs
    sequence by sequence."""
    if _IMPORT_ERROR is not None:
        fail("backend", "a torch with FlexAttention", f"'flex' on torch {torch.__version__}", "install torch >= 2.9, or use backend='tiled'")
    H, Hkv = q.shape[1], k.shape[1]
    total_q, total_k = q.shape[0], k.shape[0]
    documents = Documents.from_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    path = _clamped(dataclasses.replace(path, q_offset=0), total_q, total_k)
    acc = accumulation_dtype(q.dtype)
    score_mod, mask_mod, _ = mods(path, alibi_slopes=alibi_slopes, documents=documents, device=q.device, dtype=acc)
    assert mask_mod is not None  # the documents at least
    block_mask = interval_block_mask(*key_intervals(path, total_q, total_k, q.device, documents), total_k, mask_mod)
    qd, kd, vd = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H or Hkv, total, D or Dv), views
    out, lse = _run(qd, kd, vd, path=path, score_mod=score_mod, block_mask=block_mask, want_lse=sinks is not None or return_stats, traced=False)
    spans = [(a, b, c, d) for a, b, c, d in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), cu_seqlens_k[:-1].tolist(), cu_seqlens_k[1:].tolist())]

    def statistics() -> AttentionStats:
        parts = []
        for b, (q0, q1, k0, k1) in enumerate(spans):
            if q1 == q0:
                continue
            slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.ndim == 2 else alibi_slopes
            seq = dataclasses.replace(path, q_offset=(k1 - k0) - (q1 - q0))  # bottom-right
            parts.append(_statistics(qd[..., q0:q1, :], kd[..., k0:k1, :], seq, None, slopes, sinks, (1, H, q1 - q0)))
        return _join_rows(parts)

    out, stats = _finish(out, lse, statistics, sinks=sinks, return_stats=return_stats, dtype=q.dtype)
    out = out[0].transpose(0, 1)  # (total_q, H, Dv)
    if stats is not None:
        stats = AttentionStats(**{f.name: (None if getattr(stats, f.name) is None else getattr(stats, f.name)[0]) for f in dataclasses.fields(stats)})
    return out, stats


def sink_epilogue(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Attention sinks on finished attention ``out`` (..., H, L, Dv) with its keys-only
    log-sum-exp ``lse`` (..., H, L): each row keeps ``exp(lse) / (exp(lse) + exp(sink_h)) =
    sigmoid(lse - sink_h)`` of its mass, the sink takes the rest and adds no value. A row with no
    visible key (``lse = -inf``) stays zero, a ``-inf`` sink changes nothing. Differentiable in
    all three inputs (the gradient reaches ``lse`` and the sinks), and equal to
    :func:`attnscale.tiled.merge_sinks`.

    >>> import torch
    >>> from attnscale.tiled import attention_partial
    >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2)
    >>> sinks = torch.tensor([0.5, -1.0])
    >>> out, lse = attention_partial(q, k, v, path=ScorePath(scale=0.5))
    >>> logits = q @ k.mT * 0.5
    >>> p = logits.exp() / (logits.exp().sum(-1, keepdim=True) + sinks.exp()[:, None, None])
    >>> torch.allclose(sink_epilogue(out, lse, sinks), p @ v, atol=1e-6)
    True
    """
    sink = sinks.to(lse.dtype)[..., None]  # (H, 1)
    gap = torch.where(torch.isfinite(lse), lse - sink, -math.inf)  # a row with no key keeps no mass
    return out * torch.sigmoid(gap)[..., None]


def _keys_lse(stats: AttentionStats, sinks: Tensor | None) -> Tensor:
    """The keys-only log-sum-exp from sink-inclusive statistics: ``lse + log(1 - sink_share)``."""
    if sinks is None:
        return stats.lse
    assert stats.sink_share is not None
    return stats.lse + torch.log1p(-stats.sink_share)


def _statistics(
    query: Tensor,
    key: Tensor,
    path: ScorePath,
    attn_mask: Tensor | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    rows: tuple[int, ...],
) -> AttentionStats:
    """Per-row statistics (rows = (*batch, H, L)) over query chunks of ``CHUNK_SCORES`` scores
    each, without gradient."""
    L, S = query.shape[-2], key.shape[-2]
    step = max(1, CHUNK_SCORES // max(1, math.prod(rows[:-1]) * S))
    parts: list[AttentionStats] = []
    with torch.no_grad():
        for i0 in range(0, L, step):
            i1 = min(L, i0 + step)
            mask = attn_mask
            if mask is not None and mask.shape[-2] > 1:
                mask = mask[..., i0:i1, :]
            chunk = dataclasses.replace(path, q_offset=path.q_offset + i0)
            _, stats = dense_weights(
                query[..., i0:i1, :], key, path=chunk, attn_mask=mask, alibi_slopes=alibi_slopes, sinks=sinks, return_stats=True
            )
            assert stats is not None
            parts.append(_full_rows(stats, (*rows[:-1], i1 - i0)))
    return _join_rows(parts)


def _join_rows(parts: list[AttentionStats]) -> AttentionStats:
    """Statistics of consecutive row ranges joined along the rows (the last dim)."""
    names = [f.name for f in dataclasses.fields(parts[0]) if getattr(parts[0], f.name) is not None]
    return AttentionStats(**{name: torch.cat([getattr(p, name) for p in parts], dim=-1) for name in names})


def _full_rows(stats: AttentionStats, rows: tuple[int, ...]) -> AttentionStats:
    """Every statistic expanded to the rows' shape (a broadcast input may leave batch dims at 1)."""
    return AttentionStats(
        **{f.name: (None if getattr(stats, f.name) is None else getattr(stats, f.name).expand(rows)) for f in dataclasses.fields(stats)}
    )
