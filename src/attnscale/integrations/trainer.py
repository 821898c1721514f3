"""Watch attention while a transformers ``Trainer`` trains: a callback that runs :func:`attnscale.monitor`.

>>> from attnscale.integrations.trainer import MonitorCallback
>>> def watch(trainer):  # doctest: +SKIP
...     trainer.add_callback(MonitorCallback(trainer, every=10))

Every ``every``-th optimizer step (steps 0, N, 2N, ... counted from the Trainer's ``global_step``
at the start) is recorded, and its statistics are logged with ``trainer.log`` as
``attention/<layer>/head_<h>/<statistic>``: they reach whatever the Trainer reports to
(``report_to``: TensorBoard, W&B, MLflow, ...) and ``trainer.state.log_history``. The record also
goes to the monitor's ``writers``. An alert under ``AlertRules(stop=True)`` ends training
(``control.should_training_stop``) at the end of that step.

The model must run attention through ``attn_implementation="sdpa"`` or ``"attnscale"`` (see
:mod:`attnscale.diagnostics.hf`); the monitor refuses others at the start of training.
Needs transformers and accelerate (``pip install 'attnscale[trainer]'``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import TrainerCallback

from .._validate import fail
from ..diagnostics.monitor import Alert, AlertRules, Monitor, MonitorThresholds, StepRecord, Writer, monitor

__all__ = ["MonitorCallback"]


class MonitorCallback(TrainerCallback):
    """Starts a monitor of ``trainer.model`` when training begins and stops it when it ends.

    ``every``, ``thresholds``, ``writers``, ``alerts`` and ``on_alert`` are the monitor's (see
    :func:`attnscale.monitor`); ``prefix`` names the logged scalars. ``self.monitor`` is the
    running monitor (its ``history`` holds the records), None before training."""

    def __init__(
        self,
        trainer: Any,
        *,
        every: int = 10,
        thresholds: MonitorThresholds | None = None,
        writers: Sequence[Writer] = (),
        alerts: AlertRules | None = None,
        on_alert: Callable[[Alert], object] | None = None,
        prefix: str = "attention",
    ) -> None:
        if not callable(getattr(trainer, "log", None)) or getattr(trainer, "model", None) is None:
            fail("trainer", "a transformers Trainer (with .model and .log)", type(trainer).__name__, "pass the Trainer this callback is added to", exc=TypeError)
        self.trainer = trainer
        self.prefix = prefix
        self._options = dict(every=every, thresholds=thresholds, writers=writers, alerts=alerts, on_alert=on_alert)
        # Validate the options now, not when training starts.
        Monitor(trainer.model, **self._options)
        self.monitor: Monitor | None = None
        self.last_record: StepRecord | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor = monitor(self.trainer.model, **self._options)
        self.monitor.current_step = state.global_step
        self.monitor.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None or not self.monitor.active:
            return
        record = self.monitor.step(raise_on_stop=False)
        if record is not None:
            self.last_record = record
            self.trainer.log(record.scalars(self.prefix))
        if self.monitor.stop_requested:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and self.monitor.active:
            self.monitor.stop()
