"""What every experiment provides, and the types the runner and the report share.

An experiment is one module under ``attnscale.lab.experiments`` that defines:

* ``CLAIM: Claim`` - id (the key in results.json), statement, sources, method, and the verdict
  rule in words (the rule itself is ``judge``, written before looking at numbers);
* ``Config`` - a frozen dataclass of sizes, with ``Config.for_profile(profile) -> Config``;
* ``run(config, seed, progress) -> dict`` - the measurement, JSON-able (named numbers and small
  tables), deterministic for a given config and seed, using attnscale's own attention;
* ``judge(measured) -> Judgement`` - the verdict rule; it can return every verdict;
* ``plot(measured, outdir) -> list[str]`` - writes figures (``name.svg`` and ``name.png``) into
  ``outdir`` and returns their file names without extension.

and may define ``HEADLINE: str``, the key of ``measured`` (dotted for nested dicts, e.g.
``"slowdown.default/128"``) whose value the report shows as the claim's key number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Profile = Literal["tiny", "quick", "default", "full"]
"""``tiny`` is for unit tests (seconds), ``quick`` for CI (the whole report in < 2 min),
``default`` for users (< 10 min on 2 cores), ``full`` for tight confidence intervals."""

PROFILES: tuple[Profile, ...] = ("tiny", "quick", "default", "full")

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called by ``run`` as work completes."""


def no_progress(done: int, total: int) -> None:
    """A ``Progress`` that shows nothing."""


class Verdict(StrEnum):
    HOLDS = "holds"
    HOLDS_APPROXIMATELY = "holds-approximately"
    DOES_NOT_HOLD = "does-not-hold"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Claim:
    id: str
    statement: str
    sources: tuple[str, ...]
    method: str
    rule: str


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str


def save_figure(fig: Figure, outdir: Path, name: str) -> str:
    """Write ``fig`` as ``outdir/name.svg`` and ``outdir/name.png``; return ``name``.

    Build figures with ``matplotlib.figure.Figure()`` (not pyplot): no global state, safe in
    worker processes and without a display.
    """
    outdir.mkdir(parents=True, exist_ok=True)
    fig.savefig(outdir / f"{name}.svg", bbox_inches="tight")
    fig.savefig(outdir / f"{name}.png", dpi=110, bbox_inches="tight")
    return name
