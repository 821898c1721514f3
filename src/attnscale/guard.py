"""The one check of every eager attention output: the NaN-row rule and the float64 recompute.

:func:`check` asks each backend's result one question, whether every row is finite and not all
zeros (the compiled kernel answers it itself; for the others it reads the rows' peaks), plus what
that answer cannot see for this backend (:func:`_rows_may_hide_trouble`). Only a call that fails
it is diagnosed further (:func:`_careful`): rows the semantics make NaN, and a recompute in
float64 of rows whose logits overflowed the accumulation dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple, NoReturn

import torch
from torch import Tensor

from ._validate import Backend, fail
from .backends import FUSED, MATH, TILED, Call, Implementation, Result
from .dense import accumulation_dtype
from .kernels import CHECKS_MAX
from .kernels import checks as kernel_checks
from .kernels import load as load_kernel
from .stats import AttentionStats, with_nan_rows

__all__ = ["abs_max", "check", "check_sharded", "finite_abs_max", "may_overflow", "trusted_spans", "wrong_spans"]


def abs_max(x: Tensor) -> float:
    """max |x| as a Python float, NaN if x holds a NaN, 0 if it is empty: one pass, no temporary."""
    if x.numel() == 0:
        return 0.0
    lo, hi = (float(t) for t in torch.aminmax(x.detach()))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


def may_overflow(bound: float, dtype: torch.dtype) -> bool:
    """Whether logits bounded by ``bound`` may leave the range of ``dtype`` (with room for rounding)."""
    return bound >= torch.finfo(dtype).max / 2


def _row_peaks(out: Tensor) -> Tensor:
    """max |out| per row (..., H, L), NaN in a row with a NaN; 1 for rows of Dv = 0 (nothing to check)."""
    if out.shape[-1] == 0:
        return out.new_ones(out.shape[:-1])
    # Large outputs: max(amax, -amin), two reductions without a copy of the output (abs().amax()
    # makes one), and several times faster on CPU than linalg.vector_norm(out, inf), which is not
    # vectorised there. Small ones (decoding): abs().amax(), two ops for four, as each op's fixed
    # cost is what counts there. amax and amin propagate NaN; maximum keeps it.
    detached = out.detach()
    if detached.numel() <= _SMALL_OUTPUT:
        return detached.abs().amax(dim=-1)
    return torch.maximum(detached.amax(dim=-1), detached.amin(dim=-1).neg())


_SMALL_OUTPUT = 1 << 16
"""Outputs up to this many entries take the row peaks in two ops (their copy is cheaper than an op)."""


def _rows_look_right(peaks: Tensor) -> bool:
    """Whether every output row is finite and not all zeros, from :func:`_row_peaks`: O(L * Dv).

    A NaN or inf row comes from non-finite inputs or from products that overflowed. A zero row is
    often right (no visible key, zero values) but not always: torch's kernel returns zeros for a row
    whose logits are all NaN, and logits that all overflow to -inf look like a row with no key.
    """
    if peaks.numel() == 0:
        return True
    # One reduction to both ends, not a boolean mask: at decode sizes every extra op is a visible cost.
    lo, hi = torch.aminmax(peaks)
    return 0.0 < float(lo) and float(hi) < math.inf  # NaN fails both


def _finite_sum(x: Tensor) -> bool:
    """Whether x holds no NaN or inf, by one reduction (about 0.6 times aminmax's time on CPU): a
    finite sum says so; a sum that overflows says no, which only sends a call down the careful
    path, right either way."""
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    return math.isfinite(float(x.detach().sum(dtype=wide)))


class _Read:
    """The guard's numbers, each read from the host when asked (cheap for CPU tensors): whether the
    output's rows look right (the backend's own verdict where it gave one), max |x| of a tensor
    (also of a float mask's finite part), and whether a tensor is finite."""

    def __init__(self, out: Tensor, rows_ok: Tensor | bool | None) -> None:
        self._out, self._rows_ok = out, rows_ok

    @functools.cached_property
    def peaks(self) -> Tensor:
        return _row_peaks(self._out)

    def rows_look_right(self) -> bool:
        if self._rows_ok is not None:
            return bool(self._rows_ok)
        kernel = kernel_checks(self._out)
        return kernel.rows_ok(self._out.detach()) if kernel is not None else _rows_look_right(self.peaks)

    def __call__(self, t: Tensor, *, finite_part: bool = False) -> float:
        return abs_max(t.detach().nan_to_num(neginf=0.0) if finite_part else t)

    def finite(self, t: Tensor) -> bool:
        kernel = kernel_checks(t)
        return kernel.all_finite(t.detach()) if kernel is not None else _finite_sum(t)


class _OneRead(_Read):
    """:class:`_Read` for tensors on an accelerator: the row peaks' range and max |x| of q, k, the
    slopes and a float mask (also with its -inf entries as 0), each a reduction queued behind the
    attention, read back in one transfer. Reading them one by one waits for the device once per
    number, and the host's work between the waits leaves the device idle. A tensor it did not
    read is read as :class:`_Read` does."""

    def __init__(self, out: Tensor, tensors: tuple[Tensor | None, ...], mask: Tensor | None) -> None:
        super().__init__(out, None)
        peaks = self.peaks
        parts: list[Tensor] = [peaks.amin(), peaks.amax()] if peaks.numel() else []
        self._at: dict[tuple[int, bool], int] = {}
        float_mask = mask if mask is not None and mask.dtype != torch.bool else None
        for t, finite_part in [(t, False) for t in (*tensors, float_mask)] + [(float_mask, True)]:
            if t is not None and (id(t), finite_part) not in self._at:
                self._at[id(t), finite_part] = len(parts)
                parts.append(_abs_peak(t.detach().nan_to_num(neginf=0.0) if finite_part else t.detach()))
        self._values = torch.stack([p.double() for p in parts]).tolist() if parts else []  # the one wait
        self._range = (self._values[0], self._values[1]) if peaks.numel() else (1.0, 1.0)

    def rows_look_right(self) -> bool:
        lo, hi = self._range
        return 0.0 < lo and hi < math.inf  # NaN fails both

    def __call__(self, t: Tensor, *, finite_part: bool = False) -> float:
        at = self._at.get((id(t), finite_part))
        return super().__call__(t, finite_part=finite_part) if at is None else self._values[at]

    def finite(self, t: Tensor) -> bool:
        return math.isfinite(self(t))


def _abs_peak(x: Tensor) -> Tensor:
    """max |x| as a 0-dim tensor on x's device (NaN if x holds one; 0 if empty), no host wait."""
    if x.numel() == 0:
        return x.new_zeros(())
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, lo.neg())  # maximum propagates NaN


def _logit_bound(c: Call, q_max: float, k_max: float, read: _Read) -> float:
    """An upper bound on |logit| over every (query, key) pair, from the largest entries |q| <= q_max
    and |k| <= k_max (NaN gives NaN): ``|q.k| <= D q_max k_max`` times the scale (or the softcap),
    plus the largest ALiBi bias and the largest finite float-mask value. With softcap, also on the
    products the cap is taken of: a product that overflowed is capped to a finite logit (tanh(inf)
    = 1) of the wrong size or sign, a row no output check can tell from a right one."""
    if math.isnan(q_max) or math.isnan(k_max):  # max() below would drop a NaN it gets second
        return math.nan
    spec, mask = c.spec, c.attn_mask
    softcap = spec.path.softcap
    bound = abs(spec.path.scale) * spec.D * q_max * k_max if softcap is None else softcap
    if c.alibi_slopes is not None:
        bound += read(c.alibi_slopes) * max(spec.L, spec.S)  # |i' - j| < max(L, S)
    if mask is not None and mask.dtype != torch.bool:
        peak = read(mask)
        bound += read(mask, finite_part=True) if peak == math.inf else peak  # -inf hides a key, it is no logit
    if softcap is not None:
        # Before the cap, whichever order a backend multiplies in: q.k, then the scale (and
        # 1 / softcap, folded into it), or q times the scale first.
        bound = max(bound, spec.D * q_max * k_max * max(1.0, abs(spec.path.scale), abs(spec.path.scale) / softcap))
    return bound


def _finite_rows_trusted(implementation: Implementation, c: Call) -> bool:
    """Whether a finite row of this backend's output can only be wrong through a non-finite k:
    neither the tiled kernel's exp floor nor a softcap (which caps an overflowed product to a
    finite logit) can have made a wrong row finite."""
    return not implementation.floors_exp and c.spec.path.softcap is None


def _rows_may_hide_trouble(implementation: Implementation, c: Call, read: _Read) -> bool:
    """Whether finite, non-zero output rows may still be wrong, from a bound on the logits:
    O((L + S) * D), small next to the call's O(L * S * D).

    The tiled kernel turns a row whose logits all overflow to -inf into a finite one; a softcap
    turns an infinite product (from overflow, or from an inf in q or k) into a finite logit. Under
    a softcap a NaN bound (a NaN in q or k) counts too, as the cap hides an inf beside it. Without
    either, only a non-finite k leaves finite rows that need the careful path: where an inf's
    products with a query row are -inf, the key gets weight 0, yet it is a visible key with a
    non-finite k, so the row is NaN; and a NaN or inf at a key a mask hides from every row leaves
    the output right but the gradients NaN (0 times NaN in dS k). (An inf in q cannot: its row's
    products are all -inf, a zero row, or one is NaN or +inf.) The compiled kernel makes an
    infinite product's logit NaN, which its own row check reports, so only its gradients need
    the look at k.
    """
    query, key = c.query, c.key
    if implementation.checks_rows:
        return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad) and not read.finite(key)
    if _finite_rows_trusted(implementation, c):
        return not read.finite(key)
    bound = _logit_bound(c, read(query), read(key), read)
    if not math.isfinite(bound):  # NaN: a NaN in q or k (inf: may_overflow says so too)
        return True
    return may_overflow(bound, accumulation_dtype(query.dtype))


class Checked(NamedTuple):
    """An eager call's output and statistics by the documented rules, and the float64 recompute's
    backend where one computed them (None where ``implementation``'s own result stands)."""

    out: Tensor
    stats: AttentionStats | None
    recomputed_by: Backend | None = None


def check(implementation: Implementation, c: Call, result: Result) -> Checked:
    """The output of an eager call by the documented rules: ``result`` itself when its rows pass
    the check, else the result of :func:`_careful`."""
    out, stats, rows_ok = result
    if rows_ok is not None and implementation.checks_rows:
        # The compiled kernel's own verdict: what _rows_may_hide_trouble adds for it (a gradient
        # through a non-finite k) is asked only where a gradient may be.
        query, key = c.query, c.key
        if bool(rows_ok) and not ((query.requires_grad or key.requires_grad) and torch.is_grad_enabled() and not _Read(out, rows_ok).finite(key)):
            return Checked(out, stats)
    elif rows_ok is None and _finite_rows_trusted(implementation, c):
        # The common case of a backend that reports nothing on its rows (torch's kernel, the math
        # backend) on small CPU tensors: the two questions below (rows_look_right, and
        # _rows_may_hide_trouble's look at k), as one compiled call and nothing else.
        # (The kernel's output_ok says None where it does not check these two: other dtypes or
        # devices, or more than CHECKS_MAX entries; tensor subclasses, which may hold no data, never reach it.)
        key, kernel = c.key, load_kernel()
        if kernel is not None and type(out) is Tensor and type(key) is Tensor and kernel.output_ok(out, key, CHECKS_MAX):
            return Checked(out, stats)
    on_host = rows_ok is not None or c.query.is_cpu
    read = _Read(out, rows_ok) if on_host else _OneRead(out, (c.query, c.key, c.alibi_slopes), c.attn_mask)
    if read.rows_look_right() and not _rows_may_hide_trouble(implementation, c, read):
        return Checked(out, stats)
    return _careful(implementation, c, (out, stats), read.peaks)


def _nan_rows(implementation: Implementation, c: Call, bad_q: Tensor, bad_kv: Tensor) -> Tensor:
    """The rows (..., H, L) that the semantics make NaN: a non-finite query row that has a visible
    key, or a visible key with a non-finite k or v; ``bad_q`` (..., H, L), ``bad_kv`` (..., Hkv, S).

    Visibility comes from the backend itself, run on indicators: with q = k = 0 every visible
    key of a row has weight 1 / (its visible keys), so ``v = [bad key, 1]`` gives an output whose
    column 0 is positive iff the row sees a bad key and column 1 iff it sees any key. A float mask
    becomes the bool mask of its -inf entries: its finite values cannot hide a key, but could
    underflow the indicator's weights.
    """
    mask = c.attn_mask
    keep = mask if mask is None or mask.dtype == torch.bool else mask != -math.inf
    q = torch.zeros(*bad_q.shape, 2, device=bad_q.device)  # (..., H, L, 2)
    k = torch.zeros(*bad_kv.shape, 2, device=bad_kv.device)  # (..., Hkv, S, 2)
    v = torch.stack([bad_kv.float(), torch.ones_like(bad_kv, dtype=torch.float32)], dim=-1)  # (..., Hkv, S, 2)
    path = dataclasses.replace(c.spec.path, scale=1.0, softcap=None)
    plain = c.spec._replace(D=2, Dv=2, path=path, dropout_p=0.0, alibi=False, sinks=False, return_stats=False)
    # FlexAttention shares the tiled kernel's visibility; the indicators' D = 2 is below what its GPU kernels take.
    runs = TILED if implementation.backend is Backend.FLEX else implementation
    seen = runs.run(Call(plain, q, k, v, keep, None, None), q, k, v).out  # (..., H, L, 2)
    return ((seen[..., 1] > 0) & bad_q) | (seen[..., 0] > 0)


def _nan_rows_and_zeroed(implementation: Implementation, c: Call) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows the semantics make NaN (:func:`_nan_rows`), and q, k, v with their non-finite
    entries 0 (differentiable: the finite entries keep their gradients), from which every other
    row is computed."""
    query, key, value = c.query, c.key, c.value
    with torch.no_grad():
        bad_q = ~torch.isfinite(query).all(dim=-1)  # (..., H, L)
        bad_kv = ~torch.isfinite(key).all(dim=-1) | ~torch.isfinite(value).all(dim=-1)  # (..., Hkv, S)
        nan_rows = _nan_rows(implementation, c, bad_q, bad_kv)
    query, key, value = (torch.where(torch.isfinite(x), x, 0.0) for x in (query, key, value))
    return nan_rows, query, key, value


def _with_nan_rows(out: Tensor, stats: AttentionStats | None, nan_rows: Tensor | None) -> tuple[Tensor, AttentionStats | None]:
    """``out`` and ``stats`` with the rows ``nan_rows`` NaN (None: as they are)."""
    if nan_rows is None:
        return out, stats
    return out.masked_fill(nan_rows[..., None], math.nan), None if stats is None else with_nan_rows(stats, nan_rows)


def _cast_stats(stats: AttentionStats | None, dtype: torch.dtype) -> AttentionStats | None:
    if stats is None:
        return None
    return dataclasses.replace(
        stats, **{f.name: getattr(stats, f.name).to(dtype) for f in dataclasses.fields(stats) if f.name != "visible_keys" and getattr(stats, f.name) is not None}
    )


def _careful(implementation: Implementation, c: Call, fast: tuple[Tensor, AttentionStats | None], peaks: Tensor) -> Checked:
    """The result of a call whose fast output has a NaN, inf or zero row (or, from the tiled
    kernel, logits that may overflow), by the documented rules.

    Non-finite inputs: the NaN rows come from :func:`_nan_rows` and every other row from inputs
    whose non-finite entries are 0 (they sit only where they cannot matter: in a NaN row's query or
    at keys hidden from the row). Then a row that :func:`_misfit` finds suspect is recomputed in
    float64 when the input dtype is narrower, differentiably, or refused.
    """
    query, key, value = c.query, c.key, c.value
    acc = accumulation_dtype(query.dtype)
    out, stats = fast
    nan_rows = None
    read = _Read(out, None)
    q_max, k_max, v_max = (abs_max(x) for x in (query, key, value))
    if not all(math.isfinite(m) for m in (q_max, k_max, v_max)):  # a cheap pass before the per-row test
        nan_rows, query, key, value = _nan_rows_and_zeroed(implementation, c)
        out, stats, _ = implementation.run(c, query, key, value)
        peaks = _row_peaks(out)
        q_max, k_max = abs_max(query), abs_max(key)
    bound = functools.cache(lambda: _logit_bound(c, q_max, k_max, read))  # only when needed, once
    # Finite rows are right unless the logits may overflow where that leaves them finite: the
    # tiled kernel's exp floor, and any softcap (it caps an overflowed product to a finite logit).
    trust_finite = _finite_rows_trusted(implementation, c)
    recomputed_by = None
    if _misfit(peaks, nan_rows, lambda: may_overflow(bound(), acc), trust_finite):
        if acc == torch.float64:
            _refuse_overflow(c, acc, bound(), q_max=abs_max(query), k_max=abs_max(key), v_max=abs_max(value))
        wide = _float64(implementation, c)
        recomputed_by = wide.backend
        out, stats, _ = wide.run(c, query.double(), key.double(), value.double())
        if _misfit(_row_peaks(out), nan_rows, lambda: may_overflow(bound(), torch.float64), trust_finite):
            _refuse_overflow(c, acc, bound(), q_max=abs_max(query), k_max=abs_max(key), v_max=abs_max(value))
        # A convex combination of values (weights summing to at most 1) fits the values' dtype.
        out, stats = out.to(query.dtype), _cast_stats(stats, acc)
    return Checked(*_with_nan_rows(out, stats, nan_rows), recomputed_by)


def check_sharded(implementation: Implementation, c: Call, *, finite: bool, q_max: float, k_max: float) -> Checked:
    """The documented rules for one rank's shard of a problem spread over a process group (context
    parallelism), where ``implementation.run`` is collective and every rank must take the same
    steps: each decision reads only what every rank knows alike, never the local rows. ``c.spec``
    is the whole problem's; ``finite``: whether every rank's q, k and v are finite; ``q_max``,
    ``k_max``: the largest finite |q| and |k| over every rank.

    Non-finite inputs anywhere: the NaN rows come from :func:`_nan_rows` (the implementation run on
    indicators) and the rest from inputs whose non-finite entries are 0, as in :func:`_careful`.
    Logits that may overflow the accumulation dtype (:func:`_logit_bound`): the whole call runs in
    float64 when the inputs are narrower; where the bound exceeds float64's range too, every rank
    refuses the call (a bound, so a call with such entries is refused even where no one product
    overflows: :func:`_careful` can look at rows, a decision taken alike on every rank cannot).
    """
    query, key, value = c.query, c.key, c.value
    nan_rows = None
    if not finite:
        nan_rows, query, key, value = _nan_rows_and_zeroed(implementation, c)
    acc = accumulation_dtype(query.dtype)
    bound = _logit_bound(c, q_max, k_max, _Read(query, None))
    recomputed_by = None
    if may_overflow(bound, acc):
        if acc == torch.float64 or may_overflow(bound, torch.float64):
            _refuse_overflow(c, acc, bound, q_max=q_max, k_max=k_max, v_max=math.nan)  # (the bound is blamed: |v| is never shown)
        out, stats, _ = implementation.run(c, query.double(), key.double(), value.double())
        out, stats, recomputed_by = out.to(query.dtype), _cast_stats(stats, acc), implementation.backend
    else:
        out, stats, _ = implementation.run(c, query, key, value)
    return Checked(*_with_nan_rows(out, stats, nan_rows), recomputed_by)


def _float64(implementation: Implementation, c: Call) -> Implementation:
    """The backend of the float64 recompute: the chosen one where it can (``float64``), else
    attnscale's own kernel (the math backend for dropout, which the kernels lack, and for learned
    ALiBi slopes where the compiled kernel cannot run). Not torch's SDPA, whose float64 backward returns NaN gradients for logits near
    1e60 (torch 2.13 on CPU, e.g. B=2 H=4 L=S=64 D=32 with |q|, |k| ~ 1e30; tests/test_hostile.py),
    nor FlexAttention, whose compiled kernels take no float64 on CPU."""
    if implementation.float64:
        return implementation
    if FUSED.cannot(c) is None:
        return FUSED
    if c.spec.dropout_p > 0.0 or c.slopes_need_grad:  # (masks.slopes_learned: the one rule)
        return MATH
    return TILED


def _misfit(peaks: Tensor, nan_rows: Tensor | None, may_overflow: Callable[[], bool], trust_finite: bool) -> bool:
    """Whether, by its row peaks (:func:`_row_peaks`), an output row that is not to be NaN is
    non-finite, or may be wrong because logits may have overflowed (``may_overflow()``, asked only
    then): a zero row may be one whose logits all became -inf, and without ``trust_finite`` (the
    tiled kernel, whose exp floor gives such a row uniform weights) any row may be."""
    if nan_rows is not None:
        peaks = peaks.masked_fill(nan_rows, 1.0)
    if not bool(torch.isfinite(peaks).all()):
        return True
    return (not trust_finite or bool((peaks == 0).any())) and may_overflow()


def _refuse_overflow(c: Call, acc: torch.dtype, bound: float, *, q_max: float, k_max: float, v_max: float) -> NoReturn:
    """Refuse finite inputs whose result does not fit even float64: blame the logits if their
    bound exceeds float64's range, else the values (entries up to ``q_max``, ``k_max``, ``v_max``)."""
    dtype = c.query.dtype
    if bound < torch.finfo(torch.float64).max / 2:
        fail(
            "value",
            "values whose weighted sums fit float64",
            f"{dtype} values up to |v| = {v_max:.3g}",
            "rescale value before attention (and the output after it)",
        )
    fail(
        "query/key",
        f"products q.k * scale (plus ALiBi and float-mask values) that fit {acc}, or float64 after a recompute",
        f"{dtype} inputs with entries up to |q| = {q_max:.3g}, |k| = {k_max:.3g}, scale = {c.spec.path.scale:.3g}",
        "rescale query or key (e.g. normalise them, as QK-norm does) or pass a smaller scale",
    )


# --- packed calls (attnscale.varlen_attention) ---------------------------------------------------


def trusted_spans(c: Call, *, bound: bool) -> list[int]:
    """The sequences of a packed call (``c.spans``) that one call of a packed backend may run, the
    others each taking :func:`attnscale.scaled_dot_product_attention` and its guard: those whose
    q, k and v rows are all finite (a NaN or inf reaches no other sequence, in the output or the
    gradients); with ``bound``, for a backend that does not check its rows (FlexAttention), none
    when the logits may overflow the accumulation dtype (:func:`_logit_bound`, also on the raw
    products). One pass over q, k and v; per-row counts only where one is not finite."""
    assert c.spans is not None and c.spans.rows is not None
    rows = c.spans.rows
    read = _Read(c.query, None)
    finite = read.finite(c.query) and read.finite(c.key) and read.finite(c.value)
    if bound:
        q_max, k_max = (read(t) if finite else finite_abs_max(t) for t in (c.query, c.key))
        products = c.spec.D * q_max * k_max  # |q.k| before the scale, as the products accumulate it
        if may_overflow(max(products, _logit_bound(c, q_max, k_max, read)), accumulation_dtype(c.query.dtype)):
            return []
    if finite:
        return list(range(len(rows)))
    bad_q, bad_k, bad_v = (_bad_row_counts(t) for t in (c.query, c.key, c.value))
    return [b for b, (q0, q1, k0, k1) in enumerate(rows) if bad_q[q1] == bad_q[q0] and bad_k[k1] == bad_k[k0] and bad_v[k1] == bad_v[k0]]


def finite_abs_max(x: Tensor) -> float:
    """max |x| over x's finite entries (0 if none)."""
    x = x.detach()
    return abs_max(torch.where(torch.isfinite(x), x, 0.0))


def _bad_row_counts(x: Tensor) -> list[int]:
    """Running count of the rows (dim 0) holding a non-finite entry: entry t counts rows < t."""
    bad = ~torch.isfinite(x.detach()).flatten(1).all(1) if x.numel() else torch.zeros(x.shape[0], dtype=torch.bool)
    return [0, *torch.cumsum(bad.to(torch.int64), 0).tolist()]


def wrong_spans(c: Call, out: Tensor, rows_ok: Tensor | None, ran: list[int]) -> list[int]:
    """Of the sequences ``ran`` by one call of the compiled kernel (``out`` (total_q, H, Dv), its
    verdict ``rows_ok``), those whose rows it does not vouch for, as :func:`check` decides for
    one call: a NaN or inf row (the kernel makes a logit from an infinite product NaN), or a zero
    row where the logits may overflow (all of a row's logits at -inf look like a row with no
    visible key, which is zeros by right). Nothing is read when the kernel vouches for every row."""
    if rows_ok is not None and bool(rows_ok):
        return []
    assert c.spans is not None and c.spans.rows is not None
    peaks = _row_peaks(out)  # (total_q, H)
    bad = ~torch.isfinite(peaks).all(dim=-1)
    zero = (peaks == 0).any(dim=-1)  # a head's row of zeros
    if bool(zero.any()):
        read = _Read(out, None)
        q_max, k_max = (finite_abs_max(t) for t in (c.query, c.key))
        if may_overflow(_logit_bound(c, q_max, k_max, read), accumulation_dtype(c.query.dtype)):
            bad |= zero
    counts = [0, *torch.cumsum(bad.to(torch.int64), 0).tolist()]
    return [b for b in ran if counts[c.spans.rows[b][1]] != counts[c.spans.rows[b][0]]]
