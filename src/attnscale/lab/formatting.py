"""The report's values and labels as short text, shared by every renderer (Markdown, HTML, terminal).

Measured values are shown as tables: a dict as key | value rows, a dict of dicts with the same keys
as a grid (rows = outer keys, columns = inner keys), a list of dicts as a table of records, and a
long list of numbers shortened to its ends.

>>> format_value(0.999949898)
'0.99995'
>>> format_value([1.0, 2.5, "NaN"])
'1, 2.5, NaN'
"""

from __future__ import annotations

import json
import re
from typing import Any

from .schema import VERDICTS

__all__ = [
    "format_value",
    "grid_columns",
    "headline_text",
    "headline_value",
    "is_scalar",
    "record_columns",
    "rule_history_lines",
    "rule_label",
    "short_arm_name",
    "short_reason",
    "verdict_counts",
]

_LIST_SHOWN = 16


def format_value(value: Any) -> str:
    """A scalar or a list of scalars as short text; floats to 5 significant digits."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.5g}"
    if isinstance(value, list):
        if any(isinstance(v, (list, dict)) for v in value):
            text = json.dumps(value)
            return text if len(text) <= 200 else text[:197] + "..."
        shown = [format_value(v) for v in value]
        if len(shown) > _LIST_SHOWN:
            shown = shown[:8] + ["..."] + shown[-2:] + [f"({len(value)} values)"]
        return ", ".join(shown)
    return str(value)


def is_scalar(value: Any) -> bool:
    return not isinstance(value, (dict, list)) or (isinstance(value, list) and not any(isinstance(v, dict) for v in value))


def grid_columns(value: Any) -> list[str] | None:
    """Column names if ``value`` is a dict of dicts of scalars (a grid), else ``None``."""
    if not isinstance(value, dict) or not value or not all(isinstance(v, dict) and v for v in value.values()):
        return None
    columns: list[str] = []
    for row in value.values():
        if not all(is_scalar(c) for c in row.values()):
            return None
        columns += [c for c in row if c not in columns]
    return columns if len(columns) <= 16 else None


def record_columns(value: Any) -> list[str] | None:
    """Column names if ``value`` is a list of flat dicts (records), else ``None``."""
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        return None
    columns: list[str] = []
    for row in value:
        if not all(is_scalar(c) for c in row.values()):
            return None
        columns += [c for c in row if c not in columns]
    return columns


def verdict_counts(results: dict[str, Any]) -> str:
    """One line: how many claims got each verdict, e.g. ``2 holds, 1 inconclusive``."""
    counts = {v: sum(c["verdict"] == v for c in results["claims"]) for v in VERDICTS}
    return ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no claims measured"


def rule_label(record: dict[str, Any]) -> str:
    """``rule v2, code 0123456789abcdef``, or that the code matches no recorded version."""
    version = record["rule_version"]
    known = f"v{version}" if version is not None else "code matching no recorded version"
    return f"rule {known}, code {record['rule_fingerprint']}" if record["rule_fingerprint"] else f"rule {known}"


def rule_history_lines(record: dict[str, Any]) -> list[str]:
    """One line per version of the claim's rule, oldest first: ``v2, 2026-12-01: why``."""
    return [f"v{v['version']}, {v['date']}: {v['why']}" for v in record["rule_history"]]


def headline_value(head: dict[str, Any]) -> str:
    """The key number to 3 significant digits with its unit, and its standard error over seeds
    where it has one: ``1.13x``, ``101 eps``, ``0.946``, ``88.6x +- 4.1``."""
    value, unit = head["value"], head["unit"].strip()
    text = format_value(value)
    if isinstance(value, float):
        digits = 3  # more where 3 would round to exactly 0 or +-1, which would hide the point
        while digits < 8 and float(f"{value:.{digits}g}") in (0.0, 1.0, -1.0) and value not in (0.0, 1.0, -1.0):
            digits += 1
        text = f"{value:.{digits}g}"
    text = f"{text}{'' if unit in ('', 'x') else ' '}{unit}"
    spread = head.get("spread")
    if isinstance(spread, int | float):
        text += f" +- {spread:.2g}"
    return text


def headline_text(record: dict[str, Any]) -> str:
    """``label: value unit`` of the claim's key number, or ``""`` if it has none."""
    head = record["headline"]
    return f"{head['label']}: {headline_value(head)}" if head else ""


def short_arm_name(name: str) -> str:
    """An arm's name without its parenthesised details, for a table cell or a badge.

    >>> short_arm_name("SGD (lr tuned per rung on 0.003..3, momentum 0.9, 400 steps), MQAR")
    'SGD, MQAR'
    >>> short_arm_name("all-MiniLM-L6-v2")
    'all-MiniLM-L6-v2'
    """
    return re.sub(r"\s*\([^()]*\)", "", name).strip()


def short_reason(reason: str, limit: int = 240) -> str:
    """A verdict's reason cut at a word before ``limit`` characters, for summary tables.

    >>> short_reason("slower without the scale: default/64 x1.07, unit/64 x1.30", limit=40)
    'slower without the scale: default/64 ...'
    """
    if len(reason) <= limit:
        return reason
    return reason[: reason.rfind(" ", 0, limit - 3)] + " ..."
