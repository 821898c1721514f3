"""Watch attention in a live model: per layer and head, how peaked softmax is and how large its logits get.

:func:`monitor` returns a :class:`Monitor`, a context manager (or ``start()`` / ``stop()`` for a
training loop). While it is active:

* ``torch.nn.functional.scaled_dot_product_attention`` is replaced by a wrapper with the same
  semantics that computes the call with :func:`attnscale.scaled_dot_product_attention` (statistics
  on) and returns only the output. It sees every model whose attention looks that function up at
  call time: nanoGPT-style code (``F.scaled_dot_product_attention(...)``), HuggingFace models with
  ``attn_implementation="sdpa"``, and ``torch.nn.MultiheadAttention`` called with
  ``need_weights=False`` outside its inference fast path. ``nn.MultiheadAttention`` with
  ``need_weights=True`` (its default) computes softmax itself, and its fast path (eval mode under
  ``torch.no_grad()``) runs a fused C++ kernel; neither goes through the function, so neither is seen.
* HuggingFace models set to ``attn_implementation="attnscale"`` (see :mod:`attnscale.diagnostics.hf`)
  report to the active monitor directly.
* :class:`attnscale.MultiHeadAttention` layers report their kernel call (after projections, RoPE,
  QK-Norm and the KV cache; with softcap, ALiBi, window and sinks) under the module's name.
* forward pre/post hooks on every module of ``model`` keep a stack of the modules running; a call
  is recorded under the innermost one's qualified name (``transformer.h.0.attn``). Calls made
  outside the model's forward run through torch's own function, unrecorded.

When gradients are recorded (training), the output and its gradient come from the call the model
makes without the monitor, and the statistics from a second forward pass without autograd and
without dropout: a monitored run trains exactly as an unmonitored one.

Everything is restored on exit, also when the body raises. One monitor may be active at a time in
a process; starting a second one (or the same one twice) raises ``RuntimeError``.

Thread safety: the replacement of the torch function is process-wide, and so is the active
monitor. The module stack is per thread, and statistics are accumulated under a lock, so a model
may run in several threads while a monitor watches it. Start and stop the monitor while no forward
pass is running. It is meant for eager mode, not inside ``torch.compile``.

Recorded per (layer, head), accumulated over calls, batch and query rows:

* ``score_std`` and ``scaled_score_std``: standard deviation of ``q.k`` over all (query, key)
  pairs, before and after the scale. It is computed from D x D Gram matrices, never from an
  (L, S) score tensor: with ``Q`` (L, D) and ``K`` (S, D),
  ``sum_ij q_i.k_j = (sum_i q_i).(sum_j k_j)`` and ``sum_ij (q_i.k_j)^2 = <Q^T Q, K^T K>_F``.
  Masks are ignored for this statistic: every (query, key) pair counts.
* ``max_logit``: the largest logit after scale (and any additive mask) over visible keys,
  QK-Clip's S_max.
* ``entropy`` (mean, nats), ``normalized_entropy`` (mean of entropy / log(visible keys):
  1 = uniform, 0 = one-hot), ``max_prob`` (mean of each row's largest weight) and
  ``saturated_share`` (share of rows whose largest weight exceeds ``saturation_prob``).
  Rows with no visible key are left out; every other row the model computes counts, including
  the rows of padding queries (a padding mask hides keys, not queries).

Time series: with ``every=N`` only training steps 0, N, 2N, ... are recorded (the others run the
model's own attention, untouched); :meth:`Monitor.step` (or the optimizer's step, given
``optimizer=``) ends a step and turns a sampled one into a :class:`StepRecord`, which goes to
``history``, to the ``writers`` (:class:`JsonlWriter`, :class:`CsvWriter`, any callable) and to the
alert rules (:class:`AlertRules`). :func:`read_run` and :func:`plot_run` read and draw a run.

>>> import attnscale
>>> from attnscale.diagnostics.monitor import AlertRules
>>> mha = attnscale.MultiHeadAttention(32, num_heads=4)
>>> opt = torch.optim.SGD(mha.parameters(), lr=0.1)
>>> mon = attnscale.monitor(mha, every=2, optimizer=opt, alerts=AlertRules(max_logit=50.0)).start()
>>> for _ in range(5):
...     mha(torch.randn(2, 6, 32)).square().mean().backward()
...     opt.step()
...     opt.zero_grad()
>>> report = mon.stop()
>>> [r.step for r in mon.history], len(mon.history[0].heads)
([0, 2, 4], 4)

The wrapper computes what torch 2.13's function computes (a row with no visible key gives zeros;
``attn_mask`` with ``is_causal`` applies both; older torch versions give NaN, or raise, there);
only dropout draws a different random pattern. Its output agrees with torch's to float32 rounding.

>>> import torch, torch.nn.functional as F, attnscale
>>> q = torch.randn(2, 4, 8, 16)  # (B, H, L, D)
>>> with attnscale.monitor(torch.nn.Identity()) as mon:
...     out = F.scaled_dot_product_attention(q, q, q)  # outside the model: not recorded
>>> mon.report().heads, F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
((), True)
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import modules as _modules
from .._validate import check_attention_call, fail
from ..dense import accumulation_dtype
from ..functional import MATH_MAX_SCORES, abs_max, scaled_dot_product_attention
from ..kernels.fused import supports as fused_supports
from ..stats import AttentionStats, normalized_entropy, with_nan_rows

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.table import Table

__all__ = [
    "Alert",
    "AlertRules",
    "CsvWriter",
    "Flag",
    "HeadReport",
    "JsonlWriter",
    "LayerSummary",
    "Monitor",
    "MonitorReport",
    "MonitorThresholds",
    "StepRecord",
    "TrainingStopped",
    "active_monitor",
    "monitor",
    "plot_run",
    "read_csv",
    "read_run",
    "score_moments",
]

SCHEMA = "attnscale.monitor/1"
ROUTE_SDPA = "torch.nn.functional.scaled_dot_product_attention"
ROUTE_HF = "transformers:attnscale"
ROUTE_MHA = "attnscale.MultiHeadAttention"
_log = logging.getLogger("attnscale.monitor")


def _check_unit(name: str, value: object, *, open_low: bool = True) -> float:
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
        _check_unit("saturation_prob", self.saturation_prob)
        _check_unit("saturated_share", self.saturated_share, open_low=False)
        _check_unit("low_entropy", self.low_entropy, open_low=False)
        _check_unit("uniform_entropy", self.uniform_entropy, open_low=False)
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
_INT_FIELDS = {"head", "calls", "rows"}
_STR_FIELDS = {"layer", "route"}


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

    ``skipped_calls`` counts calls inside the model that attnscale could not compute (for example
    nested tensors); torch computed them, unrecorded.
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
        labels, shared = _short_labels(self.layers)
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
        labels, shared = _short_labels(layers)
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


def _short_labels(layers: tuple[str, ...]) -> tuple[list[str], str]:
    """Layer labels without the dotted prefix and suffix all names share, and the shared pattern.

    >>> _short_labels(("enc.layer.0.attn", "enc.layer.1.attn"))
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
            if name in _STR_FIELDS:
                values[name] = cell
            elif name in _INT_FIELDS:
                values[name] = int(cell)
            else:
                values[name] = None if cell == "" else float(cell)
        heads.append(HeadReport(**values))
    return tuple(heads)


class _Accumulator:
    """Running per-head sums for one call site, as float64 tensors on the device of the first call
    (no host synchronisation per call)."""

    NAMES = ("rows", "sum_qk", "sum_qk2", "pairs", "sum_sqk", "sum_sqk2", "entropy", "norm_entropy", "max_prob", "saturated", "sink_share", "sink_rows")

    def __init__(self, route: str, H: int, device: torch.device) -> None:
        self.route = route
        self.H = H
        self.calls = 0
        self.sink_calls = 0
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

STEP_SCHEMA = "attnscale.monitor.step/1"
STATISTICS = ("max_logit", "entropy", "normalized_entropy", "max_prob", "saturated_share", "score_std", "scaled_score_std", "sink_share")
"""The per-head statistics of a :class:`StepRecord` that :meth:`StepRecord.scalars` reports."""


@dataclass(frozen=True)
class Alert:
    """A rule that fired for one head at one sampled step (see :class:`AlertRules`).

    ``rule`` is "max_logit", "logit_growth", "entropy_collapse" or "saturation_jump"; ``value`` is
    the measured quantity (the max logit, the growth factor, the normalised entropy or the jump
    of the saturated share) and ``threshold`` the limit it crossed."""

    step: int
    layer: str
    head: int
    rule: str
    value: float
    threshold: float
    message: str


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

        >>> head = HeadReport("h.0", 1, ROUTE_SDPA, 1, 8, 1.0, 0.5, 3.0, 1.2, 0.6, 0.4, 0.0)
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


def _check_optional_positive(name: str, value: object, example: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(name, "None or a float", repr(value), f"pass e.g. {name}={example}", exc=TypeError)
    if not math.isfinite(value) or value <= 0:
        fail(name, "None or a finite float > 0", repr(value), f"pass e.g. {name}={example}, or None to turn the rule off")


@dataclass(frozen=True)
class AlertRules:
    """When the monitor raises an alert for a head, checked at every sampled step; None turns a rule off.

    * ``max_logit``: the head's max logit exceeds it (100 is QK-Clip's tau in Kimi K2);
    * ``growth_factor`` over ``growth_window`` steps: the max logit is at least ``growth_factor``
      times the smallest max logit the head had in the sampled steps of the last ``growth_window``
      steps, and above ``growth_floor`` (small logits at initialisation may double harmlessly);
    * ``min_normalized_entropy``: the mean entropy / log(visible keys) falls below it (entropy
      collapse: the head has become close to one-hot);
    * ``saturation_jump``: the share of saturated rows (max prob > ``MonitorThresholds.saturation_prob``)
      rose by more than it since the previous sampled step.

    A rule fires once when its condition becomes true for a head and again only after it was false
    at a sampled step. Every alert is logged as a warning on the ``attnscale.monitor`` logger and
    passed to the monitor's ``on_alert`` hook; with ``stop=True`` it also stops training
    (:meth:`Monitor.step` raises :class:`TrainingStopped`).

    >>> AlertRules(max_logit=30.0, growth_factor=None).max_logit
    30.0
    >>> AlertRules(growth_window=0)
    Traceback (most recent call last):
    ...
    ValueError: growth_window: expected an int >= 1 (steps), got 0. Fix: pass e.g. growth_window=100
    """

    max_logit: float | None = 100.0
    growth_factor: float | None = 4.0
    growth_window: int = 200
    growth_floor: float = 10.0
    min_normalized_entropy: float | None = 0.05
    saturation_jump: float | None = 0.5
    stop: bool = False

    def __post_init__(self) -> None:
        _check_optional_positive("max_logit", self.max_logit, "100.0")
        _check_optional_positive("growth_factor", self.growth_factor, "4.0")
        if self.growth_factor is not None and self.growth_factor <= 1:
            fail("growth_factor", "None or a factor > 1", repr(self.growth_factor), "pass e.g. growth_factor=4.0")
        if isinstance(self.growth_window, bool) or not isinstance(self.growth_window, int) or self.growth_window < 1:
            fail("growth_window", "an int >= 1 (steps)", repr(self.growth_window), "pass e.g. growth_window=100")
        if isinstance(self.growth_floor, bool) or not isinstance(self.growth_floor, (int, float)) or not math.isfinite(self.growth_floor):
            fail("growth_floor", "a finite float", repr(self.growth_floor), "pass e.g. growth_floor=10.0")
        for name in ("min_normalized_entropy", "saturation_jump"):
            if getattr(self, name) is not None:
                _check_unit(name, getattr(self, name))
        if not isinstance(self.stop, bool):
            fail("stop", "a bool", repr(self.stop), "pass stop=True to stop training on an alert", exc=TypeError)


class TrainingStopped(RuntimeError):
    """Raised by :meth:`Monitor.step` when an alert fired under ``AlertRules(stop=True)``; ``alerts`` holds them."""

    def __init__(self, alerts: tuple[Alert, ...]) -> None:
        super().__init__("attnscale.monitor stopped training: " + "; ".join(a.message for a in alerts))
        self.alerts = alerts


class _AlertState:
    """What the rules remember per (layer, head): recent max logits, the last saturated share, and
    which rules are firing."""

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self.logits: dict[tuple[str, int], list[tuple[int, float]]] = {}
        self.saturated: dict[tuple[str, int], float] = {}
        self.firing: set[tuple[str, int, str]] = set()

    def check(self, step: int, heads: Iterable[HeadReport]) -> list[Alert]:
        r, out = self.rules, []
        for h in heads:
            key = (h.layer, h.head)
            conditions: dict[str, tuple[bool, float, float, str]] = {}
            if h.max_logit is not None:
                if r.max_logit is not None:
                    conditions["max_logit"] = (h.max_logit > r.max_logit, h.max_logit, r.max_logit, f"max logit {h.max_logit:.1f} > {r.max_logit:g}")
                window = [(s, v) for s, v in self.logits.get(key, []) if s >= step - r.growth_window]
                self.logits[key] = [*window, (step, h.max_logit)]
                low = min((v for _, v in window), default=None)
                if r.growth_factor is not None and low is not None and low > 0:
                    grown = h.max_logit / low
                    fired = grown >= r.growth_factor and h.max_logit > r.growth_floor
                    conditions["logit_growth"] = (fired, grown, r.growth_factor, f"max logit grew {grown:.1f}x to {h.max_logit:.1f} within {r.growth_window} steps (>= {r.growth_factor:g}x)")
            if h.normalized_entropy is not None and r.min_normalized_entropy is not None:
                e = h.normalized_entropy
                conditions["entropy_collapse"] = (e < r.min_normalized_entropy, e, r.min_normalized_entropy, f"normalised entropy {e:.3f} < {r.min_normalized_entropy:g}")
            if h.saturated_share is not None:
                before = self.saturated.get(key)
                self.saturated[key] = h.saturated_share
                if r.saturation_jump is not None and before is not None:
                    jump = h.saturated_share - before
                    conditions["saturation_jump"] = (jump > r.saturation_jump, jump, r.saturation_jump, f"saturated share jumped {before:.0%} -> {h.saturated_share:.0%} (> +{r.saturation_jump:.0%})")
            for rule, (fired, value, threshold, what) in conditions.items():
                tag = (h.layer, h.head, rule)
                if fired and tag not in self.firing:
                    out.append(Alert(step, h.layer, h.head, rule, float(value), float(threshold), f"step {step}, {h.layer} head {h.head}: {what}"))
                (self.firing.add if fired else self.firing.discard)(tag)
        return out


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
    text = path.read_text()
    if path.suffix == ".csv":
        rows = csv.DictReader(io.StringIO(text))
        if tuple(rows.fieldnames or ()) != _RUN_CSV_FIELDS:
            fail("path", f"a CSV with header {','.join(_RUN_CSV_FIELDS)}", repr(rows.fieldnames), "pass a file written by CsvWriter")
        steps: dict[int, list[HeadReport]] = {}
        for row in rows:
            values: dict[str, Any] = {}
            for name in _RUN_CSV_FIELDS[1:]:
                cell = row[name]
                values[name] = cell if name in _STR_FIELDS else int(cell) if name in _INT_FIELDS else None if cell == "" else float(cell)
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
    labels, shared = _short_labels(layers)
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
        self._alert_state = _AlertState(alerts) if alerts is not None else None
        self._names: dict[int, str] = {}
        self._acc: dict[str, _Accumulator] = {}
        self._skipped = 0
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
                self._hooks.append(module.register_forward_pre_hook(self._enter))
                self._hooks.append(module.register_forward_hook(self._exit, always_call=True))
            self._original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = self._wrapper(self._original)
            self._original_module_fn = _modules.scaled_dot_product_attention
            _modules.scaled_dot_product_attention = self._module_wrapper(self._original_module_fn)
            if self.optimizer is not None:
                self._hooks.append(self.optimizer.register_step_post_hook(lambda *_: self.step()))
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
        if not self.sampling:
            return scaled_dot_product_attention(query, key, value, backend=requested, **options), None
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
                # No dropout there: statistics describe the softmax before dropout, and drawing a second
                # dropout mask would move the random stream the training run sees. Values of width 0:
                # the statistics need no output, and the kernel then skips every product with V.
                with torch.no_grad():
                    _, stats = scaled_dot_product_attention(
                        query, key, value[..., :0], return_stats=True, backend=backend, **{**options, "dropout_p": 0.0}
                    )
                    if not math.isfinite(abs_max(value)):
                        # That call never saw v: the rows a non-finite value makes NaN are the NaN
                        # rows of the output, whose statistics are NaN as in a call with v.
                        stats = with_nan_rows(stats, ~torch.isfinite(out.detach()).all(dim=-1))
            else:
                out, stats = scaled_dot_product_attention(query, key, value, return_stats=True, backend=backend, **options)
        finally:
            _local.recording = False
        self._record(layer, route, query, key, call.batch, call.path.scale, stats)
        return out, stats

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
            acc = self._acc.get(layer)
            if acc is None:
                acc = self._acc[layer] = _Accumulator(route, H, query.device)
            elif acc.H != H:
                raise RuntimeError(f"attnscale.monitor: layer {layer!r} was called with {acc.H} heads before and {H} now")
            acc.calls += 1
            acc.sink_calls += stats.sink_share is not None
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
            "call model.set_attn_implementation('sdpa') (or 'attnscale' after attnscale.diagnostics.hf.register())",
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
