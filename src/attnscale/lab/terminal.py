"""How the lab looks in a terminal: the progress bars' columns and a colour per verdict (rich markup)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, TextColumn, TimeElapsedColumn

__all__ = ["COLOURS", "progress_columns"]

COLOURS = {
    "holds": "green",
    "holds-approximately": "yellow",
    "does-not-hold": "red",
    "inconclusive": "magenta",
}


def progress_columns() -> tuple[ProgressColumn, ...]:
    """Claim id, bar, done/total, elapsed time: one row per running experiment."""
    return (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
