"""A training run as a time series: one :class:`StepRecord` per sampled step, the writers that
store it (:class:`JsonlWriter`, :class:`CsvWriter`), and :func:`read_run` / :func:`plot_run`."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._validate import fail
from .alerts import Alert
from .report import INT_FIELDS, STR_FIELDS, HeadReport, MonitorReport, MonitorThresholds, short_labels

if TYPE_CHECKING:
    from matplotlib.figure import Figure


STEP_SCHEMA = "attnscale.monitor.step/1"
STATISTICS = ("max_logit", "entropy", "normalized_entropy", "max_prob", "saturated_share", "score_std", "scaled_score_std", "sink_share")
"""The per-head statistics of a :class:`StepRecord` that :meth:`StepRecord.scalars` reports."""


@dataclass(frozen=True)
class StepRecord:
    """One sampled training step: each (layer, head)'s statistics over the step's forward calls, and
    the alerts that fired at it. ``to_dict`` is one line of a JSON-lines run (``schema`` =
    "attnscale.monitor.step/1"); :meth:`from_dict` reads it back."""

    step: int
    heads: tuple[HeadReport, ...]
    alerts: tuple[Alert, ...] = ()

    def scalars(self, prefix: str = "attention") -> dict[str, float]:
        """Flat ``{"attention/<layer>/head_<h>/<statistic>": value}`` for any scalar logger
        (statistics in :data:`STATISTICS`; None values are left out).

        >>> head = HeadReport("h.0", 1, "torch.nn.functional.scaled_dot_product_attention", 1, 8, 1.0, 0.5, 3.0, 1.2, 0.6, 0.4, 0.0)
        >>> StepRecord(10, (head,)).scalars()["attention/h.0/head_1/max_logit"]
        3.0
        """
        out = {}
        for h in self.heads:
            for name in STATISTICS:
                value = getattr(h, name)
                if value is not None:
                    out[f"{prefix}/{h.layer}/head_{h.head}/{name}"] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"schema": STEP_SCHEMA, "step": self.step, "heads": [asdict(h) for h in self.heads], "alerts": [asdict(a) for a in self.alerts]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        if not isinstance(data, dict) or data.get("schema") != STEP_SCHEMA:
            got = repr(data.get("schema")) if isinstance(data, dict) else type(data).__name__
            fail("data", f"schema {STEP_SCHEMA!r}", got, "pass a line written by JsonlWriter (StepRecord.to_dict())")
        return cls(
            step=int(data["step"]),
            heads=tuple(HeadReport(**h) for h in data["heads"]),
            alerts=tuple(Alert(**a) for a in data.get("alerts", ())),
        )


class JsonlWriter:
    """Writes each :class:`StepRecord` as one line of JSON (``StepRecord.to_dict()``) to ``path``,
    which it creates (or empties) at once; :func:`read_run` reads the file back. The file is opened
    for each record, so it is complete after every step and no handle stays open."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def __call__(self, record: StepRecord) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record.to_dict()) + "\n")


_RUN_CSV_FIELDS = ("step",) + tuple(f.name for f in fields(HeadReport))


class CsvWriter:
    """Writes one CSV row per (step, layer, head): ``step`` then the :class:`HeadReport` fields
    (floats in round-trip repr, None as an empty cell); alerts are not part of the CSV."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(",".join(_RUN_CSV_FIELDS) + "\n")

    def __call__(self, record: StepRecord) -> None:
        with self.path.open("a", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            for h in record.heads:
                cells = (getattr(h, n) for n in _RUN_CSV_FIELDS[1:])
                writer.writerow([record.step, *("" if v is None else repr(v) if isinstance(v, float) else str(v) for v in cells)])


def read_run(path: str | Path) -> tuple[StepRecord, ...]:
    """The records of a run written by :class:`JsonlWriter` (``.jsonl``) or :class:`CsvWriter` (``.csv``)."""
    path = Path(path)
    if not path.is_file():
        fail("path", "a .jsonl or .csv file written by the monitor", repr(str(path)), "pass the file a JsonlWriter or CsvWriter wrote")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        fail("path", "a .jsonl or .csv file written by the monitor (UTF-8 text)", f"{str(path)!r}, which is not UTF-8 text ({exc.reason} at byte {exc.start})",
             "pass the file a JsonlWriter or CsvWriter wrote")  # fmt: skip
    if path.suffix == ".csv":
        rows = csv.DictReader(io.StringIO(text))
        if tuple(rows.fieldnames or ()) != _RUN_CSV_FIELDS:
            fail("path", f"a CSV with header {','.join(_RUN_CSV_FIELDS)}", repr(rows.fieldnames), "pass a file written by CsvWriter")
        steps: dict[int, list[HeadReport]] = {}
        for row in rows:
            values: dict[str, Any] = {}
            for name in _RUN_CSV_FIELDS[1:]:
                cell = row[name]
                values[name] = cell if name in STR_FIELDS else int(cell) if name in INT_FIELDS else None if cell == "" else float(cell)
            steps.setdefault(int(row["step"]), []).append(HeadReport(**values))
        return tuple(StepRecord(step, tuple(heads)) for step, heads in steps.items())
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            fail("path", "one JSON object per line", f"line {number}: {exc.msg}", "pass a file written by JsonlWriter")
        records.append(StepRecord.from_dict(data))
    return tuple(records)


def plot_run(records: Sequence[StepRecord], *, title: str | None = None, thresholds: MonitorThresholds | None = None) -> Figure:
    """Max logit, normalised entropy and saturated share over steps: one small panel per layer and
    statistic (rows: statistics, columns: layers), one line per head. Flagged heads (an alert in the
    run, or a :class:`MonitorThresholds` flag at any step) are drawn in colour and named in the
    legend; the others in grey. Returns a ``Figure`` (not pyplot)."""
    import numpy as np
    from matplotlib.figure import Figure

    if not records:
        fail("records", "at least one StepRecord", "none", "record some steps (Monitor.step) before plotting")
    thresholds = thresholds or MonitorThresholds()
    layers = tuple(dict.fromkeys(h.layer for r in records for h in r.heads))
    labels, shared = short_labels(layers)
    flagged = {(a.layer, a.head) for r in records for a in r.alerts}
    flagged |= {(f.layer, f.head) for r in records for f in MonitorReport.from_heads(r.heads, thresholds).flags}
    panels = (("max_logit", "max logit"), ("normalized_entropy", "entropy / log n"), ("saturated_share", "saturated share"))
    width = max(4.5, 1.2 + 2.6 * len(layers))
    fig = Figure(figsize=(width, 6.4), layout="constrained")
    fig.suptitle(title or (f"attention over training, {shared}" if shared else "attention over training"))
    axes = np.atleast_2d(fig.subplots(len(panels), len(layers), sharex=True, squeeze=False))
    colours = iter(("tab:red", "tab:orange", "tab:purple", "tab:blue", "tab:green", "tab:brown", "tab:pink", "tab:cyan"))
    colour_of: dict[tuple[str, int], str] = {}
    for col, layer in enumerate(layers):
        heads = sorted({h.head for r in records for h in r.heads if h.layer == layer})
        for row, (name, label) in enumerate(panels):
            ax = axes[row, col]
            for head in heads:
                points = [(r.step, getattr(h, name)) for r in records for h in r.heads if h.layer == layer and h.head == head]
                xs = [s for s, v in points if v is not None]
                ys = [v for _, v in points if v is not None]
                if (layer, head) in flagged:
                    colour = colour_of.setdefault((layer, head), next(colours, "tab:red"))
                    ax.plot(xs, ys, color=colour, lw=1.8, label=f"{labels[col]} head {head}", zorder=3)
                else:
                    ax.plot(xs, ys, color="0.65", lw=0.9)
            if name != "max_logit":
                ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"layer {labels[col]}" if shared else labels[col])
            if col == 0:
                ax.set_ylabel(label)
            if row == len(panels) - 1:
                ax.set_xlabel("step")
    for a in (a for r in records for a in r.alerts if a.rule in ("max_logit", "logit_growth")):
        col = layers.index(a.layer)
        axes[0, col].axvline(a.step, color=colour_of.get((a.layer, a.head), "tab:red"), ls=":", lw=1.0)
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=max(1, min(len(handles), 4, int(width // 2.4))), title="flagged heads (others grey)", fontsize="small")
    return fig
