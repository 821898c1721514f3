"""Recording: :class:`Monitor` replaces torch's attention function and hooks the model's
modules, accumulates per-head statistics of every call (:func:`score_moments`) and turns
sampled steps into records. The package docstring (:mod:`attnscale.diagnostics.monitor`) says
what it sees and records."""

from __future__ import annotations

import logging
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import modules as _modules
from ..._validate import check_attention_call, fail
from ...dense import accumulation_dtype
from ...backends import MATH_MAX_SCORES
from ...functional import scaled_dot_product_attention
from ...guard import abs_max
from ...kernels.fused import supports as fused_supports
from ...stats import AttentionStats, normalized_entropy, with_nan_rows
from .alerts import Alert, AlertRules, AlertState, TrainingStopped
from .report import HeadReport, MonitorReport, MonitorThresholds
from .series import StepRecord

ROUTE_SDPA = "torch.nn.functional.scaled_dot_product_attention"
ROUTE_HF = "transformers:attnscale"
ROUTE_MHA = "attnscale.MultiHeadAttention"
_log = logging.getLogger("attnscale.monitor")


class _Accumulator:
    """Running per-head sums for one call site, as float64 tensors on the device of the first call
    (no host synchronisation per call)."""

    NAMES = ("rows", "sum_qk", "sum_qk2", "pairs", "sum_sqk", "sum_sqk2", "entropy", "norm_entropy", "max_prob", "saturated", "sink_share", "sink_rows")

    def __init__(self, route: str, H: int, device: torch.device) -> None:
        self.route = route
        self.H = H
        self.device = device
        self.calls = 0
        self.sink_calls = 0
        with torch.inference_mode(False):  # ordinary tensors, also when made inside inference_mode
            self.sums = {name: torch.zeros(H, dtype=torch.float64, device=device) for name in self.NAMES}
            self.max_logit = torch.full((H,), -math.inf, dtype=torch.float64, device=device)

    def report(self, layer: str) -> list[HeadReport]:
        s = {name: t.cpu().tolist() for name, t in self.sums.items()}
        max_logit = self.max_logit.cpu().tolist()
        heads = []
        for h in range(self.H):
            rows, pairs = int(s["rows"][h]), s["pairs"][h]

            def std(total: float, total2: float) -> float | None:
                if pairs == 0:
                    return None
                mean = total / pairs
                return math.sqrt(max(total2 / pairs - mean * mean, 0.0))

            def mean(name: str) -> float | None:
                return s[name][h] / rows if rows else None

            heads.append(
                HeadReport(
                    layer=layer,
                    head=h,
                    route=self.route,
                    calls=self.calls,
                    rows=rows,
                    score_std=std(s["sum_qk"][h], s["sum_qk2"][h]),
                    scaled_score_std=std(s["sum_sqk"][h], s["sum_sqk2"][h]),
                    max_logit=max_logit[h] if rows and math.isfinite(max_logit[h]) else None,
                    entropy=mean("entropy"),
                    normalized_entropy=mean("norm_entropy"),
                    max_prob=mean("max_prob"),
                    saturated_share=mean("saturated"),
                    sink_share=s["sink_share"][h] / s["sink_rows"][h] if self.sink_calls and s["sink_rows"][h] else None,
                )
            )
        return heads


def score_moments(query: Tensor, key: Tensor, batch: tuple[int, ...]) -> tuple[Tensor, Tensor, int]:
    """Per query head, ``sum q.k`` and ``sum (q.k)^2`` over all (query, key) pairs and batch, and the
    number of pairs per head; never forms an (L, S) tensor.

    query (..., H, L, D), key (..., Hkv, S, D); ``batch`` is the broadcast batch shape of the call.
    Sums and Gram matrices are formed in float32 (float64 for float64 inputs), as the attention
    itself is; the totals per head are float64.

    >>> q, k = torch.randn(2, 4, 5, 3), torch.randn(2, 2, 7, 3)
    >>> total, total2, n = score_moments(q, k, (2,))
    >>> qk = q.double() @ k.double().repeat_interleave(2, dim=-3).transpose(-1, -2)  # (B, H, L, S)
    >>> torch.allclose(total, qk.sum((0, 2, 3))), torch.allclose(total2, (qk ** 2).sum((0, 2, 3))), n
    (True, True, 70)
    """
    acc = accumulation_dtype(query.dtype)
    H, Hkv = query.shape[-3], key.shape[-3]
    q = query.detach().to(acc).unflatten(-3, (Hkv, H // Hkv))  # (..., Hkv, G, L, D)
    k = key.detach().to(acc).unsqueeze(-3)  # (..., Hkv, 1, S, D)
    total = (q.sum(-2) * k.sum(-2)).sum(-1)  # (..., Hkv, G)
    gram_q = q.transpose(-1, -2) @ q  # (..., Hkv, G, D, D)
    gram_k = k.transpose(-1, -2) @ k  # (..., Hkv, 1, D, D)
    total2 = (gram_q * gram_k).sum((-1, -2))  # (..., Hkv, G)
    total = total.flatten(-2).expand(*batch, H).reshape(-1, H).sum(0, dtype=torch.float64)  # (H,)
    total2 = total2.flatten(-2).expand(*batch, H).reshape(-1, H).sum(0, dtype=torch.float64)  # (H,)
    return total, total2, math.prod(batch) * query.shape[-2] * key.shape[-2]


class _Hook:
    """A monitor's hook on a module or optimizer. Copies of what it hooks (``copy.deepcopy``,
    ``pickle``, ``torch.save(model)``, ``AveragedModel``'s EMA copy) get an :class:`_Inert` hook
    instead: no reference to the monitor (whose locks cannot be copied), and no records from the
    copy under the original's names."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __call__(self, *args: object, **kwargs: object) -> None:
        self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, object]) -> _Inert:
        return _Inert()

    def __reduce__(self) -> tuple[type[_Inert], tuple[()]]:
        return (_Inert, ())


class _Inert:
    """What a copy of a monitored module holds in place of the monitor's hook: nothing happens."""

    __slots__ = ()

    def __call__(self, *args: object, **kwargs: object) -> None:
        return None


def _recomputing() -> bool:
    """Whether this forward runs inside autograd's backward: activation checkpointing's recompute
    of a forward already recorded (counting it again would double each call)."""
    return torch._C._current_graph_task_id() != -1


_lock = threading.Lock()
_active: Monitor | None = None
_local = threading.local()
# HuggingFace attn_implementation names whose attention reports to the active monitor
# (attnscale.diagnostics.hf.register adds the names it registers).
HF_IMPLEMENTATIONS = {"attnscale"}


def active_monitor() -> Monitor | None:
    """The monitor currently started in this process, if any."""
    return _active


Writer = Callable[[StepRecord], object]
"""Anything called with each :class:`StepRecord`: :class:`JsonlWriter`, :class:`CsvWriter`, a TensorBoard
writer (:mod:`attnscale.integrations.tensorboard`) or a plain function."""


class Monitor:
    """Records attention statistics of ``model``; see the module docstring. Use :func:`monitor` to make one."""

    def __init__(
        self,
        model: nn.Module,
        *,
        thresholds: MonitorThresholds | None = None,
        every: int = 1,
        writers: Sequence[Writer] = (),
        alerts: AlertRules | None = None,
        on_alert: Callable[[Alert], object] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        keep_history: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            fail("model", "a torch.nn.Module", type(model).__name__, "pass the model whose attention to watch", exc=TypeError)
        if thresholds is None:
            thresholds = MonitorThresholds()
        if not isinstance(thresholds, MonitorThresholds):
            fail("thresholds", "a MonitorThresholds", type(thresholds).__name__, "pass MonitorThresholds(...)", exc=TypeError)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            fail("every", "an int >= 1 (sample one step in every)", repr(every), "pass e.g. every=10", exc=TypeError if not isinstance(every, int) or isinstance(every, bool) else ValueError)
        if isinstance(writers, (str, bytes)) or not isinstance(writers, Sequence) or not all(callable(w) for w in writers):
            fail("writers", "a sequence of callables taking a StepRecord", repr(writers), "pass e.g. writers=[JsonlWriter('run.jsonl')]", exc=TypeError)
        if alerts is not None and not isinstance(alerts, AlertRules):
            fail("alerts", "None or an AlertRules", type(alerts).__name__, "pass AlertRules(...)", exc=TypeError)
        if on_alert is not None and not callable(on_alert):
            fail("on_alert", "None or a callable taking an Alert", type(on_alert).__name__, "pass a function", exc=TypeError)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            fail("optimizer", "None or a torch.optim.Optimizer", type(optimizer).__name__, "pass the optimizer whose steps end training steps", exc=TypeError)
        self.model = model
        self.thresholds = thresholds
        self.every = every
        self.writers = tuple(writers)
        self.alerts = alerts
        self.on_alert = on_alert
        self.optimizer = optimizer
        self.keep_history = bool(keep_history)
        self.history: list[StepRecord] = []
        self.stop_requested = False
        self._step = 0
        self._alert_state = AlertState(alerts) if alerts is not None else None
        self._names: dict[int, str] = {}
        self._acc: dict[str, _Accumulator] = {}
        self._skipped = 0
        self._warned: set[tuple[str, str]] = set()
        self._acc_lock = threading.Lock()
        self._hooks: list[Any] = []
        self._original: Callable[..., Tensor] | None = None
        self._original_module_fn: Callable[..., Any] | None = None

    @property
    def current_step(self) -> int:
        """Number of the training step now running (0 at first; :meth:`step` adds one). Settable,
        e.g. to a resumed run's global step."""
        return self._step

    @current_step.setter
    def current_step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            fail("current_step", "an int >= 0", repr(value), "pass the number of the step about to run", exc=TypeError if not isinstance(value, int) else ValueError)
        self._step = value

    @property
    def sampling(self) -> bool:
        """Whether the running step is recorded: its number is a multiple of ``every``."""
        return self._step % self.every == 0

    def step(self, *, raise_on_stop: bool = True) -> StepRecord | None:
        """End the running training step. If it was sampled, its statistics become a
        :class:`StepRecord` (kept in ``history``, given to every writer, checked by the alert rules)
        and the accumulators are reset; returns the record, or None for a step not sampled or in
        which nothing was recorded. Then the next step begins.

        Raises :class:`TrainingStopped` when an alert fired under ``AlertRules(stop=True)``
        (``raise_on_stop=False`` only sets ``stop_requested``, for loops that stop themselves).
        Called by the optimizer's step when the monitor was given ``optimizer=``."""
        record = None
        if self.sampling:
            with self._acc_lock:
                heads = tuple(h for layer, acc in self._acc.items() for h in acc.report(layer))
                self._acc.clear()
                self._skipped = 0
            if heads:
                fired = tuple(self._alert_state.check(self._step, heads)) if self._alert_state is not None else ()
                record = StepRecord(self._step, heads, fired)
                if self.keep_history:
                    self.history.append(record)
                for write in self.writers:
                    write(record)
                for alert in fired:
                    _log.warning("attnscale.monitor alert: %s", alert.message)
                    if self.on_alert is not None:
                        self.on_alert(alert)
                if fired and self.alerts is not None and self.alerts.stop:
                    self.stop_requested = True
                    self._step += 1
                    if raise_on_stop:
                        raise TrainingStopped(fired)
                    return record
        self._step += 1
        return record

    @property
    def active(self) -> bool:
        return self._original is not None

    def start(self) -> Monitor:
        """Replace the torch function and hook the model's modules. Returns self."""
        global _active
        with _lock:
            if _active is not None:
                which = "this monitor is" if _active is self else f"a monitor of {type(_active.model).__name__} is"
                raise RuntimeError(f"attnscale.monitor: {which} already active; nesting is not supported. Fix: stop it first")
            _check_attention_implementation(self.model)
            self._names = {id(m): name or type(self.model).__name__ for name, m in self.model.named_modules()}
            _local.stack = []
            for module in self.model.modules():
                self._hooks.append(module.register_forward_pre_hook(_Hook(self._enter)))
                self._hooks.append(module.register_forward_hook(_Hook(self._exit), always_call=True))
            self._original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = self._wrapper(self._original)
            self._original_module_fn = _modules.scaled_dot_product_attention
            _modules.scaled_dot_product_attention = self._module_wrapper(self._original_module_fn)
            if self.optimizer is not None:
                self._hooks.append(self.optimizer.register_step_post_hook(_Hook(lambda *_: self.step())))
            _active = self
        return self

    def stop(self) -> MonitorReport:
        """Restore the torch function, remove the hooks, and return the report."""
        global _active
        with _lock:
            if _active is not self or self._original is None:
                raise RuntimeError("attnscale.monitor: this monitor is not active. Fix: call start() first")
            F.scaled_dot_product_attention = self._original
            _modules.scaled_dot_product_attention = self._original_module_fn
            self._original = self._original_module_fn = None
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            _active = None
        return self.report()

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset(self) -> None:
        """Forget what was recorded so far (e.g. between training steps)."""
        with self._acc_lock:
            self._acc.clear()
            self._skipped = 0

    def report(self) -> MonitorReport:
        """What was recorded so far; callable while active or after stop."""
        with self._acc_lock:
            heads = [h for layer, acc in self._acc.items() for h in acc.report(layer)]
            skipped = self._skipped
        return MonitorReport.from_heads(heads, self.thresholds, skipped)

    # Module stack: per thread, so that concurrent forwards attribute calls to their own modules.
    def _enter(self, module: nn.Module, args: object) -> None:
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(module)

    def _exit(self, module: nn.Module, args: object, output: object) -> None:
        stack = getattr(_local, "stack", None)
        if stack and stack[-1] is module:
            stack.pop()

    def current_layer(self) -> str | None:
        """Qualified name of the innermost module of the model running in this thread (None if none)."""
        stack = getattr(_local, "stack", None)
        return self._names.get(id(stack[-1])) if stack else None

    def name_of(self, module: nn.Module) -> str | None:
        return self._names.get(id(module))

    def _wrapper(self, original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def scaled_dot_product_attention_monitored(
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attn_mask: Tensor | None = None,
            dropout_p: float = 0.0,
            is_causal: bool = False,
            *,
            scale: float | None = None,
            enable_gqa: bool = False,
        ) -> Tensor:
            layer = self.current_layer()
            if layer is None or getattr(_local, "recording", False) or not self.sampling:
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
            try:
                out, _ = self.attend(
                    layer,
                    ROUTE_SDPA,
                    query,
                    key,
                    value,
                    attn_mask=attn_mask,
                    dropout_p=dropout_p,
                    is_causal=is_causal,
                    scale=scale,
                    enable_gqa=enable_gqa,
                )
            except (TypeError, ValueError):
                # attnscale refused the inputs (nested tensors, fewer than 3 dims, ...): torch computes
                # the call exactly as without the monitor, or raises its own error.
                with self._acc_lock:
                    self._skipped += 1
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
            return out

        scaled_dot_product_attention_monitored.__doc__ = original.__doc__
        return scaled_dot_product_attention_monitored

    def _module_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """attnscale.MultiHeadAttention's kernel call, recorded under the module's name."""

        def attend_monitored(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, *args: Any, return_stats: bool = False, **options: Any) -> Any:
            layer = self.current_layer()
            if layer is None or args or getattr(_local, "recording", False) or not self.sampling:
                return original(query, key, value, attn_mask, *args, return_stats=return_stats, **options)
            out, stats = self.attend(layer, ROUTE_MHA, query, key, value, attn_mask=attn_mask, **options)
            return (out, stats) if return_stats else out

        return attend_monitored

    def attend(self, layer: str, route: str, query: Tensor, key: Tensor, value: Tensor, **options: Any) -> tuple[Tensor, AttentionStats | None]:
        """``attnscale.scaled_dot_product_attention(query, key, value, **options)`` with statistics,
        recorded under ``layer``; returns (out, stats). Invalid inputs raise before any compute.

        In a step that is not sampled (see ``every``) nothing is recorded: the call runs without
        statistics and returns (out, None)."""
        requested = options.pop("backend", "auto")
        if not self.sampling or _recomputing():
            # The same call as a recorded one makes (a checkpoint's recompute must match it), and
            # flagged as recording, so that its own torch SDPA call is not routed here again.
            was, _local.recording = getattr(_local, "recording", False), True
            try:
                return scaled_dot_product_attention(query, key, value, backend=requested, **options), None
            finally:
                _local.recording = was
        call = check_attention_call(
            query,
            key,
            value,
            attn_mask=options.get("attn_mask"),
            dropout_p=options.get("dropout_p", 0.0),
            is_causal=options.get("is_causal", False),
            scale=options.get("scale"),
            enable_gqa=options.get("enable_gqa", False),
            causal_alignment=options.get("causal_alignment", "top_left"),
            backend=requested,
            softcap=options.get("softcap"),
            alibi_slopes=options.get("alibi_slopes"),
            window=options.get("window"),
            return_stats=True,
            sinks=options.get("sinks"),
        )
        scores = math.prod(call.batch) * call.H * call.L * call.S
        # With statistics "auto" picks an online-softmax kernel: the compiled one is the fastest exact
        # way where it runs; the eager tiled one loses to the dense kernel below its memory limit.
        if requested != "auto" or fused_supports(query, options.get("attn_mask")) is None:
            backend = requested
        else:
            backend = "math" if scores <= MATH_MAX_SCORES else "auto"
        _local.recording = True
        try:
            if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
                # Training: the output and its gradient come from the call the model makes without the
                # monitor (fast kernels, identical numerics); the statistics from a separate forward
                # without autograd, far cheaper than differentiating the statistics' path.
                out = scaled_dot_product_attention(query, key, value, backend=requested, **options)
                try:
                    # No dropout there: statistics describe the softmax before dropout, and drawing a
                    # second dropout mask would move the random stream the training run sees. Values of
                    # width 0: the statistics need no output, and the kernel skips every product with V.
                    with torch.no_grad():
                        _, stats = scaled_dot_product_attention(
                            query, key, value[..., :0], return_stats=True, backend=backend, **{**options, "dropout_p": 0.0}
                        )
                        if not math.isfinite(abs_max(value)):
                            # That call never saw v: the rows a non-finite value makes NaN are the NaN
                            # rows of the output, whose statistics are NaN as in a call with v.
                            stats = with_nan_rows(stats, ~torch.isfinite(out.detach()).all(dim=-1))
                except Exception as exc:  # the model's own call ran: its result stands, unrecorded
                    self._cannot_record(layer, f"its statistics call failed ({type(exc).__name__}: {exc})")
                    return out, None
            else:
                try:
                    out, stats = scaled_dot_product_attention(query, key, value, return_stats=True, backend=backend, **options)
                except Exception as exc:
                    # The model's call as it would run without the monitor (which raises if the
                    # inputs are bad), unrecorded.
                    self._cannot_record(layer, f"its statistics call failed ({type(exc).__name__}: {exc})")
                    return scaled_dot_product_attention(query, key, value, backend=requested, **options), None
        finally:
            _local.recording = False
        self._record(layer, route, query, key, call.batch, call.path.scale, stats)
        return out, stats

    def _cannot_record(self, layer: str, why: str) -> None:
        """Count a call the monitor could not record, and say so once per layer and reason: a
        monitor never changes whether a model runs."""
        with self._acc_lock:
            self._skipped += 1
            first = (layer, why) not in self._warned
            self._warned.add((layer, why))
        if first:
            warnings.warn(f"attnscale.monitor: a call of {layer!r} was not recorded: {why}; such calls run unrecorded", RuntimeWarning, stacklevel=4)

    def _record(self, layer: str, route: str, query: Tensor, key: Tensor, batch: tuple[int, ...], scale: float, stats: AttentionStats) -> None:
        H = query.shape[-3]
        with torch.no_grad():
            total, total2, pairs = score_moments(query, key, batch)
            rows_dims = [d for d in range(stats.lse.ndim) if d != stats.lse.ndim - 2]  # all but H
            shown = (stats.visible_keys > 0).expand(stats.lse.shape)  # (..., H, L): rows with a visible key

            def per_head(t: Tensor) -> Tensor:
                return torch.where(shown, t.detach(), 0.0).sum(rows_dims, dtype=torch.float64)  # (H,)

            update = {
                "rows": shown.sum(rows_dims, dtype=torch.float64),
                "sum_qk": total,
                "sum_qk2": total2,
                "pairs": torch.full_like(total, float(pairs)),
                "sum_sqk": total * scale,
                "sum_sqk2": total2 * scale**2,
                "entropy": per_head(stats.entropy),
                "norm_entropy": per_head(normalized_entropy(stats).nan_to_num(0.0)),
                "max_prob": per_head(stats.max_prob),
                "saturated": (shown & (stats.max_prob > self.thresholds.saturation_prob)).sum(rows_dims, dtype=torch.float64),
            }
            if stats.sink_share is not None:
                update["sink_share"] = per_head(stats.sink_share)
                update["sink_rows"] = update["rows"]
            row_max = None
            if shown.numel():
                row_max = torch.where(shown, stats.max_logit.detach(), -math.inf).amax(rows_dims).double()  # (H,)
        with self._acc_lock:
            acc, skip = self._acc.get(layer), None
            if acc is None:
                acc = self._acc[layer] = _Accumulator(route, H, query.device)
            elif acc.H != H or acc.device != query.device:
                before, now = (f"{acc.H} heads", f"{H}") if acc.H != H else (f"device {acc.device}", f"{query.device}")
                skip = f"it was called with {before} before and {now} now (one layer's statistics are per head of one call site)"
            if skip is None:
                self._add(acc, update, row_max, stats.sink_share is not None)
        if skip is not None:
            self._cannot_record(layer, skip)

    @staticmethod
    def _add(acc: _Accumulator, update: dict[str, Tensor], row_max: Tensor | None, with_sinks: bool) -> None:
        # Outside any inference_mode: the sums are ordinary tensors, which calls in either mode
        # update (an inference tensor could not be updated by a later ordinary forward).
        with torch.inference_mode(False):
            acc.calls += 1
            acc.sink_calls += with_sinks
            for name, value in update.items():
                acc.sums[name] += value
            if row_max is not None:
                torch.maximum(acc.max_logit, row_max, out=acc.max_logit)


def _check_attention_implementation(model: nn.Module) -> None:
    """A HuggingFace model in eager (or flash) attention never calls the function the monitor watches."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if isinstance(impl, str) and impl != "sdpa" and impl not in HF_IMPLEMENTATIONS:
        fail(
            "model",
            "a HuggingFace model with attn_implementation 'sdpa' or 'attnscale'",
            f"attn_implementation {impl!r}",
            "call model.set_attn_implementation('sdpa') (or 'attnscale', which import attnscale registers)",
        )


def monitor(
    model: nn.Module,
    *,
    thresholds: MonitorThresholds | None = None,
    every: int = 1,
    writers: Sequence[Writer] = (),
    alerts: AlertRules | None = None,
    on_alert: Callable[[Alert], object] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    keep_history: bool = True,
) -> Monitor:
    """Watch ``model``'s attention: ``with attnscale.monitor(model) as mon: model(x)``, then ``mon.report()``.

    For a training loop: ``mon = attnscale.monitor(model).start()`` ... ``report = mon.stop()``
    (``mon.report()`` and ``mon.reset()`` in between). See :mod:`attnscale.diagnostics.monitor`.

    As a time series: ``every`` = N records one training step in N (steps 0, N, 2N, ...); a step
    ends with ``mon.step()`` or, given ``optimizer=``, with each ``optimizer.step()``. Each sampled
    step becomes a :class:`StepRecord` for ``writers`` and ``history`` (``keep_history=False``
    keeps none in memory), checked by ``alerts`` (:class:`AlertRules`), which call ``on_alert``.
    """
    return Monitor(
        model, thresholds=thresholds, every=every, writers=writers, alerts=alerts, on_alert=on_alert, optimizer=optimizer, keep_history=keep_history
    )
