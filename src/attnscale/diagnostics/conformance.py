"""Conformance checks for any attention callable with the SDPA layout.

``fn(query, key, value, attn_mask=None, is_causal=False, enable_gqa=False) -> out`` with
query (B, H, L, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv). Each check builds inputs whose
correct answer is known and gives a one-line verdict. Keyword arguments are passed only to the
checks that need them; a callable that rejects one gets "not supported" for that check, not a
failure. Weights are read by passing the identity over keys as the value.

Every answer is validated before it is judged: it must be a tensor of shape (B, H, L, Dv) in the
query's dtype, and finite wherever a correct implementation is finite; a check whose answer is
not fails with what arrived instead. A callable that raises fails the check with the error in one
line. Each check has a time limit; a call that exceeds it cannot be stopped (it keeps running in a
daemon thread), so the callable is taken to be hung and the remaining checks are not run.

Checks are of two kinds. *Semantics* checks (the scale, softmax axis, V, mask polarity, causal
alignment, fully masked rows, GQA mapping) fail when the callable computes something other than
attention: :attr:`ConformanceReport.ok` is False. *Robustness* checks (large logits, fp16
overflow) fail when a correct formula breaks down numerically; they are listed in
:attr:`ConformanceReport.warnings` and leave ``ok`` True.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor

from .._validate import fail
from .probe import CallTimedOut, ScaleFit, call_with_timeout, diagnose_scale, fit_logit_scale

__all__ = ["CheckKind", "CheckResult", "ConformanceReport", "SCHEMA", "check_attention", "scale_fix"]

AttentionFn = Callable[..., Tensor]
CheckKind = Literal["semantics", "robustness"]
SCHEMA = "attnscale.check/1"

# Numerical robustness, not the definition of attention: a failure here is a warning.
_ROBUSTNESS = frozenset({"large logits", "fp16 overflow"})


def scale_fix(diagnosis: str) -> str | None:
    """How to repair an implementation whose fitted scale was diagnosed as ``diagnosis`` (None if correct).

    >>> scale_fix("no scale")
    'divide q.k by sqrt(q.size(-1)) before the softmax'
    """
    if diagnosis == "1/sqrt(head_dim)":
        return None
    if diagnosis.startswith("1/head_dim"):
        return "divide q.k by sqrt(q.size(-1)) once (it is divided twice, or by q.size(-1))"
    if diagnosis.startswith("1/sqrt(d_model)") or diagnosis == "1/sqrt(num_heads)":
        return "divide q.k by sqrt(q.size(-1)), the per-head dim, not by the model width or the head count"
    return "divide q.k by sqrt(q.size(-1)) before the softmax"


@dataclass(frozen=True)
class CheckResult:
    """One check: ``passed`` is True, False, or None when the callable does not support it.

    ``kind`` is "semantics" (a failure means the callable is not attention as specified) or
    "robustness" (a failure is a numerical weakness, reported as a warning); ``fix`` says how to
    repair a failure where the check knows it.
    """

    name: str
    passed: bool | None
    detail: str
    kind: CheckKind = "semantics"
    fix: str | None = None


@dataclass(frozen=True)
class ConformanceReport:
    """The fitted scale, its diagnosis and every check's result, in the order they ran."""

    head_dim: int
    scale: ScaleFit
    diagnosis: str
    checks: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        """True when no semantics check failed (unsupported checks and robustness warnings do not count)."""
        return all(c.passed is not False for c in self.checks if c.kind == "semantics")

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        """The semantics checks that failed."""
        return tuple(c for c in self.checks if c.kind == "semantics" and c.passed is False)

    @property
    def warnings(self) -> tuple[CheckResult, ...]:
        """The robustness checks that failed."""
        return tuple(c for c in self.checks if c.kind == "robustness" and c.passed is False)

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form (``schema`` = "attnscale.check/1").

        >>> import attnscale
        >>> data = check_attention(attnscale.scaled_dot_product_attention).to_dict()
        >>> data["schema"], data["ok"], data["warnings"], next(c["name"] for c in data["checks"])
        ('attnscale.check/1', True, [], 'scale')
        """
        return {
            "schema": SCHEMA,
            "head_dim": self.head_dim,
            "diagnosis": self.diagnosis,
            "scale": asdict(self.scale),
            "ok": self.ok,
            "failures": [c.name for c in self.failures],
            "warnings": [c.name for c in self.warnings],
            "checks": [asdict(c) for c in self.checks],
        }


def _inputs(H: int, Hkv: int, L: int, S: int, D: int, seed: int, dtype=torch.float64) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, L, D, generator=gen, dtype=torch.float64).to(dtype)  # (B, H, L, D)
    k = torch.randn(1, Hkv, S, D, generator=gen, dtype=torch.float64).to(dtype)  # (B, Hkv, S, D)
    return q, k


def _eye(Hkv: int, S: int, dtype=torch.float64) -> Tensor:
    return torch.eye(S, dtype=dtype).expand(1, Hkv, S, S)  # (B, Hkv, S, Dv=S): out = weights


class _Unjudgeable(Exception):
    """The callable's answer is not an attention output for these inputs; the message says why."""


class _Unsupported(Exception):
    """The callable rejected a keyword argument that the check needs."""


def _call(fn: AttentionFn, query: Tensor, key: Tensor, value: Tensor, *, finite: bool = True, **kwargs) -> Tensor:
    """``fn(query, key, value, **kwargs)``, validated: a tensor (B, H, L, Dv) in query's dtype, finite if ``finite``."""
    try:
        with torch.no_grad():  # grad mode is per thread: set it where fn runs
            out = fn(query, key, value, **kwargs)
    except TypeError as exc:
        if any(name in str(exc) for name in kwargs):
            raise _Unsupported(f"not supported: {exc}") from exc
        raise
    expected = (*query.shape[:-1], value.shape[-1])  # (B, H, L, Dv)
    if not isinstance(out, Tensor):
        hint = ": return the output tensor alone" if isinstance(out, tuple | list) else ""
        raise _Unjudgeable(f"returned {type(out).__name__}, expected a tensor (B, H, L, Dv) = {expected}{hint}")
    if tuple(out.shape) != expected:
        hint = ": is V applied?" if value.shape[-1] != key.shape[-2] and out.shape[-1:] == key.shape[-2:-1] else ""
        raise _Unjudgeable(f"output shape {tuple(out.shape)}, expected (B, H, L, Dv) = {expected}{hint}")
    if out.dtype != query.dtype:
        raise _Unjudgeable(f"output dtype {out.dtype}, expected the query's dtype {query.dtype}")
    if finite and not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        raise _Unjudgeable(f"output has {bad} NaN or inf values of {out.numel()} on inputs with finite logits")
    return out


def _require_distribution(w: Tensor, where: str = "") -> None:
    """Every row of ``w`` must sum to 1 over keys, or the check has nothing to judge."""
    deviation = (w.sum(-1) - 1).abs().max().item()
    if not deviation < 1e-6:
        raise _Unjudgeable(f"weights do not sum to 1 over keys{where} (max deviation {deviation:.3g}): cannot judge")


def _run(name: str, body: Callable[[], tuple[bool, str]], timeout: float | None) -> tuple[CheckResult, bool]:
    """The check's one-line result, and whether it timed out."""
    kind: CheckKind = "robustness" if name in _ROBUSTNESS else "semantics"
    try:
        passed, detail = call_with_timeout(body, timeout)
    except CallTimedOut as exc:
        return CheckResult(name, False, str(exc), kind), True
    except _Unsupported as exc:
        return CheckResult(name, None, str(exc), kind), False
    except _Unjudgeable as exc:
        return CheckResult(name, False, str(exc), kind), False
    except (Exception, SystemExit) as exc:  # a crash on valid input is a failed check, reported in one line
        text = " ".join(str(exc).split())
        return CheckResult(name, False, f"raised {type(exc).__name__}: {text[:160]}", kind), False
    return CheckResult(name, passed, detail, kind), False


def check_attention(
    fn: AttentionFn, *, head_dim: int = 64, num_heads: int = 4, seed: int = 0, timeout: float | None = 10.0
) -> ConformanceReport:
    """Run the scale probe and every conformance check on ``fn``.

    ``timeout``: seconds each check may take (``None``: no limit). When one check times out, ``fn``
    is taken to be hung: that check and every later one fail, and the later ones are not run.

    >>> import attnscale
    >>> report = check_attention(attnscale.scaled_dot_product_attention)
    >>> report.ok, report.diagnosis
    (True, '1/sqrt(head_dim)')
    """
    if not callable(fn):
        fail("fn", "an attention callable fn(query, key, value, ...)", type(fn).__name__, "pass the function itself", exc=TypeError)
    for arg, value in (("head_dim", head_dim), ("num_heads", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(arg, "a positive int", repr(value), f"pass {arg}=64" if arg == "head_dim" else f"pass {arg}=4")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf):
        fail("timeout", "a finite number of seconds > 0, or None for no limit", repr(timeout), "pass timeout=10")
    D, H, L, S = head_dim, num_heads, 6, 9

    def weights(q: Tensor, k: Tensor, *, finite: bool = True, **kwargs) -> Tensor:
        return _call(fn, q, k, _eye(k.shape[-3], k.shape[-2], q.dtype), finite=finite, **kwargs)

    q, k = _inputs(H, H, L, S, D, seed)
    try:
        inspect.signature(fn).bind(q, k, _eye(H, S))
        unfit = None
    except TypeError as exc:  # every check would fail the same way
        unfit = f"fn cannot be called as fn(query, key, value): {exc}"
    except ValueError:  # no signature to read (some builtins): the calls will tell
        unfit = None
    plain: list[Tensor] = []  # the weights without options, read once and shared by the checks that judge them
    fit, diagnosis = ScaleFit((math.nan,), (math.nan,), 0), "could not read weights"

    def plain_weights() -> Tensor:
        if not plain:
            plain.append(weights(q, k))
        return plain[0]

    def scale() -> tuple[bool, str]:
        nonlocal fit, diagnosis
        fit = fit_logit_scale(q, k, plain_weights())
        diagnosis = diagnose_scale(fit.mean_scale, D, H)
        return diagnosis == "1/sqrt(head_dim)", f"fitted scale {fit.mean_scale:.6g} vs 1/sqrt({D}) = {D ** -0.5:.6g}: {diagnosis}"

    def softmax_axis() -> tuple[bool, str]:
        w = plain_weights()
        rows = (w.sum(-1) - 1).abs().max().item()
        cols = (w.sum(-2) - 1).abs().max().item()
        if rows < 1e-6:
            return True, "weights sum to 1 over keys"
        if cols < 1e-6:
            return False, "weights sum to 1 over queries: softmax over the wrong axis"
        return False, f"weights do not sum to 1 over keys (max deviation {rows:.3g})"

    def multiplies_v() -> tuple[bool, str]:
        w = plain_weights()
        if w.abs().max().item() == 0:  # out = 0 @ V would "match" any V
            return False, "weights read with V = identity are all zero: cannot judge"
        v = torch.randn(1, H, S, 5, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        out = _call(fn, q, k, v)
        err = (out - w @ v).abs().max().item()
        return err < 1e-6, "output = weights @ V" if err < 1e-6 else f"output != weights @ V (max diff {err:.3g})"

    def mask_polarity() -> tuple[bool, str]:
        mask = torch.ones(L, S, dtype=torch.bool)
        mask[:, 0] = False  # hide key 0; True = attend
        wm = weights(q, k, attn_mask=mask)
        _require_distribution(wm)
        hidden = wm[..., 0].abs().max().item()
        if hidden < 1e-9:
            return True, "bool mask: True = attend"
        if wm[..., 1:].abs().max().item() < 1e-9:
            return False, "bool mask inverted: True hides the key"
        return False, f"key hidden by the mask still gets weight {hidden:.3g}"

    def causal_alignment() -> tuple[bool, str]:
        qa, ka = _inputs(1, 1, 2, 5, D, seed + 2)
        wc = weights(qa, ka, is_causal=True)
        _require_distribution(wc)  # either alignment leaves every row a visible key
        seen = wc[0, 0] > 1e-12  # (2, 5)
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
        wf = weights(q, k, attn_mask=mask, finite=False)  # NaN in the empty row is the finding, not a bad answer
        others = torch.cat([wf[..., :1, :], wf[..., 2:, :]], dim=-2)  # (B, H, L - 1, S)
        if not bool(torch.isfinite(others).all()):
            return False, "NaN or inf in rows that have visible keys: cannot judge"
        _require_distribution(others, " in the rows with visible keys")
        row = wf[..., 1, :]
        if torch.isnan(row).any():
            return False, "a fully masked row returns NaN"
        if row.abs().max().item() == 0:
            return True, "a fully masked row returns zeros"
        if (row - 1.0 / S).abs().max().item() < 1e-6:
            return False, "a fully masked row silently returns the uniform average (finite fill value)"
        return False, f"a fully masked row returns {row[0, 0, :3].tolist()}..."

    def large_logits() -> tuple[bool, str]:
        qb, kb = q * 100, k * 100
        out = weights(qb, kb, finite=False)  # finiteness is what this check judges
        if not bool(torch.isfinite(out).all()):
            return False, "NaN or inf at logits ~1e4"
        _require_distribution(out)
        if not torch.equal(out.argmax(-1), (qb @ kb.transpose(-1, -2)).argmax(-1)):
            return False, "finite at logits ~1e4, but the largest weight is not on the largest logit"
        return True, "finite at logits ~1e4, peaked on the largest logit"

    def fp16_overflow() -> tuple[bool, str]:
        qh = torch.full((1, 1, 2, D), 40.0, dtype=torch.float16)
        kh = torch.full((1, 1, 3, D), 40.0, dtype=torch.float16)
        out = weights(qh, kh, finite=False).float()  # overflow to inf/NaN is what this check looks for
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
        wg = weights(qg, kg, enable_gqa=True)
        _require_distribution(wg)
        got = wg[0, :, 0].argmax(-1).tolist()  # (H, S) -> preferred key per query head
        if got == [0, 0, 1, 1]:
            return True, "query head h reads kv head h // (H // Hkv)"
        if got == [0, 1, 0, 1]:
            return False, "query head h reads kv head h % Hkv (interleaved, not grouped)"
        return False, f"unexpected head mapping {got}"

    bodies = {
        "scale": scale,
        "softmax axis": softmax_axis,
        "multiplies V": multiplies_v,
        "mask polarity": mask_polarity,
        "causal alignment": causal_alignment,
        "fully masked rows": fully_masked_rows,
        "large logits": large_logits,
        "fp16 overflow": fp16_overflow,
        "GQA head mapping": gqa_mapping,
    }
    checks: list[CheckResult] = []
    hung = False
    for name, body in bodies.items():
        kind: CheckKind = "robustness" if name in _ROBUSTNESS else "semantics"
        if unfit is not None:
            checks.append(CheckResult(name, False, unfit, kind))
            continue
        if hung:
            checks.append(CheckResult(name, False, f"not run: an earlier check timed out after {timeout:g} s (fn looks hung)", kind))
            continue
        result, hung = _run(name, body, timeout)
        if name == "scale" and result.passed is False and fit.rows:
            result = replace(result, fix=scale_fix(diagnosis))
        checks.append(result)
    return ConformanceReport(head_dim=D, scale=fit, diagnosis=diagnosis, checks=tuple(checks))
