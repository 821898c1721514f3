"""A monitor writer that logs every sampled step's statistics to TensorBoard.

>>> import attnscale
>>> from attnscale.integrations.tensorboard import TensorBoardWriter
>>> def start(model, log_dir):  # doctest: +SKIP
...     return attnscale.monitor(model, every=10, writers=[TensorBoardWriter(log_dir)]).start()

Each statistic of each head becomes the scalar ``attention/<layer>/head_<h>/<statistic>`` at
the record's step (see :meth:`attnscale.diagnostics.monitor.StepRecord.scalars`). Needs the
``tensorboard`` package (``pip install 'attnscale[tensorboard]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._validate import fail
from ..diagnostics.monitor import StepRecord

__all__ = ["TensorBoardWriter"]


class TensorBoardWriter:
    """Writes records to ``log_dir`` through ``torch.utils.tensorboard.SummaryWriter``, or to a
    ``SummaryWriter`` you pass (which you then close yourself). Events are flushed after each record."""

    def __init__(self, log_dir: str | Path | Any, *, prefix: str = "attention") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"TensorBoardWriter needs tensorboard ({exc}). Fix: pip install 'attnscale[tensorboard]'") from exc
        if isinstance(log_dir, (str, Path)):
            self.writer, self._owned = SummaryWriter(log_dir=str(log_dir)), True
        elif isinstance(log_dir, SummaryWriter):
            self.writer, self._owned = log_dir, False
        else:
            fail("log_dir", "a folder or a torch.utils.tensorboard.SummaryWriter", type(log_dir).__name__, "pass e.g. 'runs/attention'", exc=TypeError)
        self.prefix = prefix

    def __call__(self, record: StepRecord) -> None:
        for tag, value in record.scalars(self.prefix).items():
            self.writer.add_scalar(tag, value, record.step)
        for alert in record.alerts:
            self.writer.add_text(f"{self.prefix}/alerts", alert.message, record.step)
        self.writer.flush()

    def close(self) -> None:
        """Close the SummaryWriter this writer opened (one passed in is left open)."""
        if self._owned:
            self.writer.close()
