"""What a monitor reports: per (layer, head) statistics (:class:`HeadReport`), the flags the
thresholds raise (:class:`MonitorThresholds`, :class:`Flag`), per-layer summaries, and
:class:`MonitorReport` with its JSON, CSV, table and heatmap forms."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._validate import fail

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.table import Table


SCHEMA = "attnscale.monitor/1"


def check_unit(name: str, value: object, *, open_low: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(name, "a float", repr(value), f"pass e.g. {name}=0.5", exc=TypeError)
    value = float(value)
    ok = (0.0 < value < 1.0) if open_low else (0.0 <= value <= 1.0)
    if not ok:
        interval = "(0, 1)" if open_low else "[0, 1]"
        fail(name, f"a float in {interval}", repr(value), f"pick a value in {interval}")
    return value


@dataclass(frozen=True)
class MonitorThresholds:
    """When a head is flagged. All checks are on statistics accumulated over every recorded row.

    * saturated: more than ``saturated_share`` of rows have max probability > ``saturation_prob``,
      or the mean normalised entropy is below ``low_entropy``;
    * max logit: the largest logit exceeds ``max_logit`` (100 is QK-Clip's threshold tau);
    * uniform: the mean normalised entropy exceeds ``uniform_entropy`` (attention collapsed to averaging).

    >>> MonitorThresholds(max_logit=30.0).max_logit
    30.0
    >>> MonitorThresholds(saturation_prob=1.5)
    Traceback (most recent call last):
    ...
    ValueError: saturation_prob: expected a float in (0, 1), got 1.5. Fix: pick a value in (0, 1)
    """

    saturation_prob: float = 0.99
    saturated_share: float = 0.5
    low_entropy: float = 0.05
    max_logit: float = 100.0
    uniform_entropy: float = 0.98

    def __post_init__(self) -> None:
        check_unit("saturation_prob", self.saturation_prob)
        check_unit("saturated_share", self.saturated_share, open_low=False)
        check_unit("low_entropy", self.low_entropy, open_low=False)
        check_unit("uniform_entropy", self.uniform_entropy, open_low=False)
        if self.low_entropy >= self.uniform_entropy:
            fail(
                "low_entropy",
                f"a value below uniform_entropy = {self.uniform_entropy}",
                repr(self.low_entropy),
                "lower low_entropy or raise uniform_entropy",
            )
        if isinstance(self.max_logit, bool) or not isinstance(self.max_logit, (int, float)):
            fail("max_logit", "a float", repr(self.max_logit), "pass e.g. max_logit=100.0", exc=TypeError)
        if not math.isfinite(self.max_logit) or self.max_logit <= 0:
            fail("max_logit", "a finite float > 0", repr(self.max_logit), "pass e.g. max_logit=100.0")
        for f in fields(self):
            object.__setattr__(self, f.name, float(getattr(self, f.name)))


@dataclass(frozen=True)
class HeadReport:
    """Statistics of one head at one call site, over all its recorded calls. None where no row was
    visible; ``sink_share`` (mean probability of the attention sink) is None for calls without sinks."""

    layer: str
    head: int
    route: str
    calls: int
    rows: int
    score_std: float | None
    scaled_score_std: float | None
    max_logit: float | None
    entropy: float | None
    normalized_entropy: float | None
    max_prob: float | None
    saturated_share: float | None
    sink_share: float | None = None


@dataclass(frozen=True)
class Flag:
    """A head worth a look: ``kind`` is "saturated", "max_logit" or "uniform"; ``reason`` says by how much."""

    layer: str
    head: int
    kind: str
    reason: str


@dataclass(frozen=True)
class LayerSummary:
    """One call site's heads in one line: means over heads, except ``max_logit`` (the max)."""

    layer: str
    heads: int
    normalized_entropy: float | None
    max_prob: float | None
    max_logit: float | None
    flagged_heads: tuple[int, ...]


_CSV_FIELDS = tuple(f.name for f in fields(HeadReport)) + ("flags",)
INT_FIELDS = {"head", "calls", "rows"}
STR_FIELDS = {"layer", "route"}


def _mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _flags_for(head: HeadReport, t: MonitorThresholds) -> list[Flag]:
    out = []
    share, ent = head.saturated_share, head.normalized_entropy
    if share is not None and share > t.saturated_share:
        out.append(Flag(head.layer, head.head, "saturated", f"max prob > {t.saturation_prob:g} on {share:.0%} of rows (> {t.saturated_share:.0%})"))
    elif ent is not None and ent < t.low_entropy:
        out.append(Flag(head.layer, head.head, "saturated", f"normalised entropy {ent:.3f} < {t.low_entropy:g}"))
    if head.max_logit is not None and head.max_logit > t.max_logit:
        out.append(Flag(head.layer, head.head, "max_logit", f"max logit {head.max_logit:.1f} > {t.max_logit:g} (QK-Clip threshold)"))
    if ent is not None and ent > t.uniform_entropy:
        out.append(Flag(head.layer, head.head, "uniform", f"normalised entropy {ent:.3f} > {t.uniform_entropy:g} (close to uniform)"))
    return out


@dataclass(frozen=True)
class MonitorReport:
    """What a :class:`Monitor` recorded: one :class:`HeadReport` per (layer, head) in call order, and flags.

    ``skipped_calls`` counts calls inside the model that the monitor did not record: calls
    attnscale could not compute (for example nested tensors), which torch computed, and calls it
    could not record (a layer called with another head count than before, a statistics call that
    failed), each said once in a RuntimeWarning; the model's own result stands for all of them.
    """

    heads: tuple[HeadReport, ...]
    flags: tuple[Flag, ...]
    thresholds: MonitorThresholds = field(default_factory=MonitorThresholds)
    skipped_calls: int = 0

    @classmethod
    def from_heads(cls, heads: Iterable[HeadReport], thresholds: MonitorThresholds, skipped_calls: int = 0) -> MonitorReport:
        heads = tuple(heads)
        flags = tuple(f for h in heads for f in _flags_for(h, thresholds))
        return cls(heads=heads, flags=flags, thresholds=thresholds, skipped_calls=skipped_calls)

    @property
    def layers(self) -> tuple[str, ...]:
        """Call sites in the order they were first called."""
        return tuple(dict.fromkeys(h.layer for h in self.heads))

    def layer_summaries(self) -> tuple[LayerSummary, ...]:
        out = []
        for layer in self.layers:
            heads = [h for h in self.heads if h.layer == layer]
            logits = [h.max_logit for h in heads if h.max_logit is not None]
            out.append(
                LayerSummary(
                    layer=layer,
                    heads=len(heads),
                    normalized_entropy=_mean(h.normalized_entropy for h in heads),
                    max_prob=_mean(h.max_prob for h in heads),
                    max_logit=max(logits) if logits else None,
                    flagged_heads=tuple(sorted({f.head for f in self.flags if f.layer == layer})),
                )
            )
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form (``schema`` = "attnscale.monitor/1"); :meth:`from_dict` reads it back."""
        return {
            "schema": SCHEMA,
            "thresholds": asdict(self.thresholds),
            "skipped_calls": self.skipped_calls,
            "heads": [asdict(h) for h in self.heads],
            "flags": [asdict(f) for f in self.flags],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MonitorReport:
        if data.get("schema") != SCHEMA:
            fail("data", f"schema {SCHEMA!r}", repr(data.get("schema")), "pass the output of MonitorReport.to_dict()")
        return cls(
            heads=tuple(HeadReport(**h) for h in data["heads"]),
            flags=tuple(Flag(**f) for f in data["flags"]),
            thresholds=MonitorThresholds(**data["thresholds"]),
            skipped_calls=int(data["skipped_calls"]),
        )

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    @classmethod
    def from_json(cls, text: str) -> MonitorReport:
        return cls.from_dict(json.loads(text))

    def to_csv(self) -> str:
        """One row per (layer, head); floats in Python's round-trip repr, None as an empty cell,
        ``flags`` as kinds joined by ``;``. :func:`read_csv` reads the heads back."""
        kinds: dict[tuple[str, int], list[str]] = {}
        for f in self.flags:
            kinds.setdefault((f.layer, f.head), []).append(f.kind)
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(_CSV_FIELDS)
        for h in self.heads:
            row = ["" if v is None else repr(v) if isinstance(v, float) else str(v) for v in (getattr(h, n) for n in _CSV_FIELDS[:-1])]
            writer.writerow([*row, ";".join(kinds.get((h.layer, h.head), []))])
        return buf.getvalue()

    def __str__(self) -> str:
        """The :meth:`table` as plain text, so that ``print(report)`` shows it."""
        from rich.console import Console

        console = Console(width=100, record=True, file=io.StringIO(), color_system=None)
        console.print(self.table())
        return console.export_text()

    def table(self, *, title: str | None = None) -> Table:
        """A rich table, one row per (layer, head), flagged heads marked; fits 80 columns.
        Show it with ``rich.print(report.table())``, or ``print(report)`` for plain text."""
        from rich import box
        from rich.table import Table

        kinds: dict[tuple[str, int], list[str]] = {}
        for f in self.flags:
            kinds.setdefault((f.layer, f.head), []).append(f.kind)
        labels, shared = short_labels(self.layers)
        short = dict(zip(self.layers, labels))
        legend = (
            "std: of q.k over all pairs (masks ignored); std*s: after the scale; S_max: max logit; "
            "H: mean entropy (nats); H/ln n: over log(visible keys); max p: mean max probability; "
            f"sat: rows with max p > {self.thresholds.saturation_prob:g}"
        )
        caption = f"layer = {shared}\n{legend}" if shared else legend
        table = Table(title=title or "attention per layer and head", caption=caption, box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False)
        for name in ("layer", "head", "calls", "std", "std*s", "S_max", "H", "H/ln n", "max p", "sat", "flags"):
            if name == "flags":
                table.add_column(name, overflow="fold")
            else:
                table.add_column(name, justify="left" if name == "layer" else "right", no_wrap=True)

        def num(x: float | None, spec: str) -> str:
            return "-" if x is None else format(x, spec)

        for h in self.heads:
            flagged = kinds.get((h.layer, h.head), [])
            table.add_row(
                short[h.layer],
                str(h.head),
                str(h.calls),
                num(h.score_std, ".2f"),
                num(h.scaled_score_std, ".2f"),
                num(h.max_logit, ".1f"),
                num(h.entropy, ".2f"),
                num(h.normalized_entropy, ".3f"),
                num(h.max_prob, ".3f"),
                num(h.saturated_share, ".0%"),
                f"[red]{', '.join(flagged)}[/]" if flagged else "",
            )
        return table

    def heatmap(self, *, title: str | None = None) -> Figure:
        """Two heatmaps, layers x heads: mean normalised entropy and max logit (a ``Figure``, not pyplot).

        Save with ``fig.savefig("heatmap.svg")`` or ``.png``. Rows are labelled by what differs
        between layer names (``encoder.layer.3.attention.self`` -> ``3``); the shared part is the title.
        """
        import numpy as np
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure

        layers = self.layers
        labels, shared = short_labels(layers)
        width = max((h.head for h in self.heads), default=-1) + 1
        grids = {name: np.full((len(layers), width), np.nan) for name in ("normalized_entropy", "max_logit")}
        row = {layer: i for i, layer in enumerate(layers)}
        for h in self.heads:
            for name, grid in grids.items():
                value = getattr(h, name)
                grid[row[h.layer], h.head] = np.nan if value is None else value
        fig = Figure(figsize=(max(8.0, 4.0 + 0.45 * width), 1.5 + 0.45 * len(layers)), layout="constrained")  # both titles fit
        fig.suptitle(title or (f"{shared}, per head" if shared else "attention per layer and head"))
        axes = fig.subplots(1, 2)
        logits = grids["max_logit"][np.isfinite(grids["max_logit"])]
        # Max logits that span orders of magnitude (one large-logit head among ordinary ones) would
        # turn every other cell of a linear scale black: a log colour scale keeps them apart.
        log_scale = logits.size > 0 and logits.min() > 0 and logits.max() > 10 * logits.min()
        logit_limits = dict(norm=LogNorm(vmin=logits.min(), vmax=logits.max())) if log_scale else {}
        panels = (
            ("normalized_entropy", "entropy / log(visible keys)", "viridis", dict(vmin=0.0, vmax=1.0)),
            ("max_logit", "max logit (after scale" + (", log colours)" if log_scale else ")"), "magma", logit_limits),
        )
        for ax, (name, title, cmap, limits) in zip(axes, panels):
            image = ax.imshow(grids[name], aspect="auto", cmap=cmap, **limits)
            ax.set_title(title)
            ax.set_xlabel("head")
            ax.set_xticks(range(width))
            ax.set_yticks(range(len(layers)), labels=labels if ax is axes[0] else [""] * len(layers))
            fig.colorbar(image, ax=ax)
        axes[0].set_ylabel("layer")
        return fig

    def save(self, folder: str | Path, *, stem: str = "monitor") -> dict[str, Path]:
        """Write ``stem.json``, ``stem.csv``, ``stem_heatmap.svg`` and ``stem_heatmap.png`` into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {
            "json": folder / f"{stem}.json",
            "csv": folder / f"{stem}.csv",
            "svg": folder / f"{stem}_heatmap.svg",
            "png": folder / f"{stem}_heatmap.png",
        }
        paths["json"].write_text(self.to_json() + "\n")
        paths["csv"].write_text(self.to_csv())
        fig = self.heatmap()
        fig.savefig(paths["svg"])
        fig.savefig(paths["png"], dpi=120)
        return paths


def short_labels(layers: tuple[str, ...]) -> tuple[list[str], str]:
    """Layer labels without the dotted prefix and suffix all names share, and the shared pattern.

    >>> short_labels(("enc.layer.0.attn", "enc.layer.1.attn"))
    (['0', '1'], 'enc.layer.*.attn')
    """
    if len(layers) < 2:
        return list(layers), ""
    parts = [name.split(".") for name in layers]
    head = 0
    while all(len(p) > head + 1 for p in parts) and len({p[head] for p in parts}) == 1:
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 for p in parts) and len({p[-1 - tail] for p in parts}) == 1:
        tail += 1
    labels = [".".join(p[head : len(p) - tail]) for p in parts]
    shared = ".".join([*parts[0][:head], "*", *parts[0][len(parts[0]) - tail :]]) if head or tail else ""
    return labels, shared


def read_csv(text: str) -> tuple[HeadReport, ...]:
    """The heads of :meth:`MonitorReport.to_csv` (the ``flags`` column is derived and dropped)."""
    rows = csv.DictReader(io.StringIO(text))
    if tuple(rows.fieldnames or ()) != _CSV_FIELDS:
        fail("text", f"a CSV with header {','.join(_CSV_FIELDS)}", repr(rows.fieldnames), "pass the output of MonitorReport.to_csv()")
    heads = []
    for row in rows:
        values: dict[str, Any] = {}
        for name in _CSV_FIELDS[:-1]:
            cell = row[name]
            if name in STR_FIELDS:
                values[name] = cell
            elif name in INT_FIELDS:
                values[name] = int(cell)
            else:
                values[name] = None if cell == "" else float(cell)
        heads.append(HeadReport(**values))
    return tuple(heads)
