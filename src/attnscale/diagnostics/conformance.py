"""Conformance checks for any attention callable with the SDPA layout.

``fn(query, key, value, attn_mask=None, is_causal=False, enable_gqa=False) -> out`` with
query (B, H, L, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv). Each check builds inputs whose
correct answer is known and gives a one-line verdict. Keyword arguments are passed only to the
checks that need them; a callable that rejects one gets "not supported" for that check, not a
failure. Weights are read by passing the identity over keys as the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .probe import ScaleFit, diagnose_scale, fit_logit_scale

__all__ = ["CheckResult", "ConformanceReport", "check_attention"]

AttentionFn = Callable[..., Tensor]


@dataclass(frozen=True)
class CheckResult:
    """One check: ``passed`` is True, False, or None when the callable does not support it."""

    name: str
    passed: bool | None
    detail: str


@dataclass(frozen=True)
class ConformanceReport:
    head_dim: int
    scale: ScaleFit
    diagnosis: str
    checks: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        """True when no check failed (unsupported checks do not count as failures)."""
        return all(c.passed is not False for c in self.checks)


def _inputs(H: int, Hkv: int, L: int, S: int, D: int, seed: int, dtype=torch.float64) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, L, D, generator=gen, dtype=torch.float64).to(dtype)  # (B, H, L, D)
    k = torch.randn(1, Hkv, S, D, generator=gen, dtype=torch.float64).to(dtype)  # (B, Hkv, S, D)
    return q, k


def _eye(Hkv: int, S: int, dtype=torch.float64) -> Tensor:
    return torch.eye(S, dtype=dtype).expand(1, Hkv, S, S)  # (B, Hkv, S, Dv=S): out = weights


def _call(fn: AttentionFn, *args, **kwargs) -> Tensor:
    with torch.no_grad():
        return fn(*args, **kwargs)


def _run(name: str, body: Callable[[], tuple[bool, str]]) -> CheckResult:
    try:
        passed, detail = body()
    except TypeError as exc:
        if "argument" in str(exc):
            return CheckResult(name, None, f"not supported: {exc}")
        return CheckResult(name, False, f"raised TypeError: {exc}")
    except Exception as exc:  # a crash on valid input is a failed check, reported in one line
        return CheckResult(name, False, f"raised {type(exc).__name__}: {str(exc)[:120]}")
    return CheckResult(name, passed, detail)


def check_attention(fn: AttentionFn, *, head_dim: int = 64, num_heads: int = 4, seed: int = 0) -> ConformanceReport:
    """Run the scale probe and every conformance check on ``fn``.

    >>> import attnscale
    >>> report = check_attention(attnscale.scaled_dot_product_attention)
    >>> report.ok, report.diagnosis
    (True, '1/sqrt(head_dim)')
    """
    D, H, L, S = head_dim, num_heads, 6, 9

    def weights(q: Tensor, k: Tensor, **kwargs) -> Tensor:
        return _call(fn, q, k, _eye(k.shape[-3], k.shape[-2], q.dtype), **kwargs)

    q, k = _inputs(H, H, L, S, D, seed)
    w = weights(q, k)
    fit = fit_logit_scale(q, k, w) if w.shape == (1, H, L, S) else ScaleFit((math.nan,), (math.nan,), 0)
    diagnosis = diagnose_scale(fit.mean_scale, D, H) if w.shape == (1, H, L, S) else "could not read weights"

    def softmax_axis() -> tuple[bool, str]:
        rows = (w.sum(-1) - 1).abs().max().item()
        cols = (w.sum(-2) - 1).abs().max().item()
        if rows < 1e-6:
            return True, "weights sum to 1 over keys"
        if cols < 1e-6:
            return False, "weights sum to 1 over queries: softmax over the wrong axis"
        return False, f"weights do not sum to 1 over keys (max deviation {rows:.3g})"

    def multiplies_v() -> tuple[bool, str]:
        v = torch.randn(1, H, S, 5, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        out = _call(fn, q, k, v)
        if out.shape != (1, H, L, 5):
            return False, f"output shape {tuple(out.shape)}, expected (B, H, L, Dv) = (1, {H}, {L}, 5): is V applied?"
        err = (out - w @ v).abs().max().item()
        return err < 1e-6, "output = weights @ V" if err < 1e-6 else f"output != weights @ V (max diff {err:.3g})"

    def mask_polarity() -> tuple[bool, str]:
        mask = torch.ones(L, S, dtype=torch.bool)
        mask[:, 0] = False  # hide key 0; True = attend
        wm = weights(q, k, attn_mask=mask)
        hidden, rest = wm[..., 0].abs().max().item(), wm[..., 1:].sum(-1).min().item()
        if hidden < 1e-9 and rest > 1 - 1e-6:
            return True, "bool mask: True = attend"
        if wm[..., 1:].abs().max().item() < 1e-9:
            return False, "bool mask inverted: True hides the key"
        return False, f"key hidden by the mask still gets weight {hidden:.3g}"

    def causal_alignment() -> tuple[bool, str]:
        qa, ka = _inputs(1, 1, 2, 5, D, seed + 2)
        seen = weights(qa, ka, is_causal=True)[0, 0] > 1e-12  # (2, 5)
        top_left = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
        bottom_right = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
        if torch.equal(seen, top_left):
            return True, "is_causal with L < S: top-left aligned (PyTorch convention)"
        if torch.equal(seen, bottom_right):
            return True, "is_causal with L < S: bottom-right aligned (FlashAttention convention)"
        return False, f"is_causal pattern for L=2, S=5 is neither alignment: {seen.int().tolist()}"

    def fully_masked_rows() -> tuple[bool, str]:
        mask = torch.ones(L, S, dtype=torch.bool)
        mask[1] = False
        row = weights(q, k, attn_mask=mask)[..., 1, :]
        if torch.isnan(row).any():
            return False, "a fully masked row returns NaN"
        if row.abs().max().item() == 0:
            return True, "a fully masked row returns zeros"
        if (row - 1.0 / S).abs().max().item() < 1e-6:
            return False, "a fully masked row silently returns the uniform average (finite fill value)"
        return False, f"a fully masked row returns {row[0, 0, :3].tolist()}..."

    def large_logits() -> tuple[bool, str]:
        out = weights(q * 100, k * 100)
        finite = bool(torch.isfinite(out).all())
        return finite, "finite at logits ~1e4" if finite else "NaN or inf at logits ~1e4"

    def fp16_overflow() -> tuple[bool, str]:
        qh = torch.full((1, 1, 2, D), 40.0, dtype=torch.float16)
        kh = torch.full((1, 1, 3, D), 40.0, dtype=torch.float16)
        out = weights(qh, kh).float()
        raw = f"fp16 inputs with q.k = {1600.0 * D:.0f} > 65504"
        if not bool(torch.isfinite(out).all()):
            return False, f"{raw}: inf/NaN"
        err = (out - 1.0 / 3.0).abs().max().item()  # equal keys: uniform weights
        return err < 1e-3, f"{raw}: " + ("finite and correct" if err < 1e-3 else f"finite but wrong (off by {err:.3g})")

    def gqa_mapping() -> tuple[bool, str]:
        Hq, Hkv = 4, 2
        qg = torch.zeros(1, Hq, 1, D, dtype=torch.float64)
        kg = torch.zeros(1, Hkv, 3, D, dtype=torch.float64)
        kg[0, 0, 0, 0] = kg[0, 1, 1, 0] = 1.0  # kv head 0 prefers key 0, kv head 1 prefers key 1
        qg[..., 0] = 20.0
        w = weights(qg, kg, enable_gqa=True)[0, :, 0]  # (H, S)
        got = w.argmax(-1).tolist()
        if got == [0, 0, 1, 1]:
            return True, "query head h reads kv head h // (H // Hkv)"
        if got == [0, 1, 0, 1]:
            return False, "query head h reads kv head h % Hkv (interleaved, not grouped)"
        return False, f"unexpected head mapping {got}"

    checks = (
        CheckResult("scale", diagnosis == "1/sqrt(head_dim)", f"fitted scale {fit.mean_scale:.6g} vs 1/sqrt({D}) = {D ** -0.5:.6g}: {diagnosis}"),
        _run("softmax axis", softmax_axis),
        _run("multiplies V", multiplies_v),
        _run("mask polarity", mask_polarity),
        _run("causal alignment", causal_alignment),
        _run("fully masked rows", fully_masked_rows),
        _run("large logits", large_logits),
        _run("fp16 overflow", fp16_overflow),
        _run("GQA head mapping", gqa_mapping),
    )
    return ConformanceReport(head_dim=D, scale=fit, diagnosis=diagnosis, checks=checks)
