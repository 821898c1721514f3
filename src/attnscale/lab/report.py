"""Write the report: ``results.json`` (the data), ``report.md`` and ``index.html`` (for people).

One renderer per format: :func:`render_markdown` here, :func:`attnscale.lab.render_html.render_html`
for the page. Both read only the results.json data, so a report can be re-rendered from it.

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
from pathlib import Path
from typing import Any, Literal

from . import schema
from .explorer import explorer_link, write_explorer

__all__ = [
    "Format",
    "format_value",
    "grid_columns",
    "headline_text",
    "headline_value",
    "short_reason",
    "render_markdown",
    "rule_history_lines",
    "rule_label",
    "write_report",
]

Format = Literal["json", "markdown", "html"]
FILES: dict[Format, str] = {"json": "results.json", "markdown": "report.md", "html": "index.html"}

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


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_md_escape(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _md_flat(prefix: str, value: dict[str, Any], rows: list[list[str]], nested: list[tuple[str, Any]]) -> None:
    for key, sub in value.items():
        name = f"{prefix}{key}"
        if is_scalar(sub):
            rows.append([name, format_value(sub)])
        elif grid_columns(sub) is not None or record_columns(sub) is not None:
            nested.append((name, sub))
        elif isinstance(sub, dict):
            _md_flat(f"{name}.", sub, rows, nested)
        else:
            rows.append([name, format_value(sub)])


def _md_value_tables(value: dict[str, Any]) -> list[str]:
    rows: list[list[str]] = []
    nested: list[tuple[str, Any]] = []
    _md_flat("", value, rows, nested)
    lines = _md_table(["quantity", "value"], rows) if rows else []
    for name, sub in nested:
        lines.append(f"*{name}*")
        lines.append("")
        grid = grid_columns(sub)
        if grid is not None:
            lines += _md_table(["", *grid], [[k, *(format_value(r.get(c, "")) for c in grid)] for k, r in sub.items()])
        else:
            cols = record_columns(sub) or []
            lines += _md_table(cols, [[format_value(r.get(c, "")) for c in cols] for r in sub])
    return lines


def verdict_counts(results: dict[str, Any]) -> str:
    """One line: how many claims got each verdict, e.g. ``2 holds, 1 inconclusive``."""
    from .schema import VERDICTS

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
    """The key number to 3 significant digits with its unit: ``1.13x``, ``101 eps``, ``0.946``."""
    value, unit = head["value"], head["unit"]
    text = f"{value:.3g}" if isinstance(value, float) else format_value(value)
    return f"{text}{'' if unit in ('', 'x') else ' '}{unit}"


def headline_text(record: dict[str, Any]) -> str:
    """``label: value unit`` of the claim's key number, or ``""`` if it has none."""
    head = record["headline"]
    return f"{head['label']}: {headline_value(head)}" if head else ""


def short_reason(reason: str, limit: int = 200) -> str:
    """The plain part of a verdict's reason: what comes before its first ``": "`` outside brackets
    (the details follow it), cut at a word before ``limit`` characters.

    >>> short_reason("slower without the scale, but not 2x (x1.1): default/64: x1.07; unit/64: x1.3")
    'slower without the scale, but not 2x (x1.1)'
    """
    depth = 0
    for i, ch in enumerate(reason):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0 and reason.startswith(": ", i):
            reason = reason[:i]
            break
    if len(reason) <= limit:
        return reason
    return reason[: reason.rfind(" ", 0, limit - 1)] + " ..."


def render_markdown(results: dict[str, Any]) -> str:
    """The report as Markdown (figures as PNG links, relative to the report folder)."""
    env = results["environment"]
    lines = [
        "# attnscale lab report",
        "",
        f"attnscale {results['attnscale_version']}, {results['created']}, profile `{results['profile']}`, "
        f"seed {results['seed']}; Python {env['python']}, torch {env['torch']}, {env['cpu']}; "
        f"{results['seconds']:.1f} s.",
        "",
        f"Reproduce: `attnscale report --profile {results['profile']} --seed {results['seed']}`",
        "",
        "## Claims",
        "",
    ]
    lines += _md_table(
        ["claim", "verdict", "key number", "seconds"],
        [
            [f"[{r['id']}](#{r['id']})", f"**{r['verdict']}**", headline_text(r), f"{r['seconds']:.1f}"]
            for r in results["claims"]
        ],
    )
    lines += [f"Verdicts: {verdict_counts(results)}.", ""]
    if results["not_measured"]:
        missing = ", ".join(f"`{c['id']}`" for c in results["not_measured"])
        lines += [f"Claims without an experiment yet: {missing}.", ""]
    for rec in results["claims"]:
        lines += [f"## {rec['id']}", "", f"> {rec['statement']}", ""]
        if view := explorer_link(rec["id"]):
            lines += [f"[See it in the explorer]({view})", ""]
        lines += [f"**Verdict: {rec['verdict']}.** {rec['reason']}", ""]
        lines += [f"- {arm['name']}: **{arm['verdict']}**. {arm['reason']}" for arm in rec["arms"]]
        if rec["arms"]:
            lines.append("")
        if rec["sources"]:
            lines += ["Sources: " + "; ".join(rec["sources"]) + ".", ""]
        if rec["method"]:
            lines += [f"Method: {rec['method']}", ""]
        lines += [f"![{f['name']}]({f['png']})" for f in rec["figures"]]
        if rec["figures"]:
            lines.append("")
        if rec["measured"]:
            lines += ["### Measured", ""] + _md_value_tables(rec["measured"])
        if rec["rule"]:
            lines += [f"Verdict rule ({rule_label(rec)}): {rec['rule']}", ""]
        if rec["rule_history"]:
            lines += ["Rule history:", ""] + [f"- {entry}" for entry in rule_history_lines(rec)] + [""]
        if rec["config"]:
            lines += ["Config: " + ", ".join(f"{k} = {format_value(v)}" for k, v in rec["config"].items()), ""]
        cached = " (from the cache)" if rec["cached"] else ""
        lines += [f"{rec['seconds']:.1f} s wall, {rec['cpu_seconds']:.1f} s CPU{cached}", ""]
        if rec["error"]:
            lines += ["```", rec["error"].rstrip(), "```", ""]
    return "\n".join(lines)


def write_report(results: dict[str, Any], outdir: Path) -> dict[Format, Path]:
    """Check ``results`` against the schema, then write results.json, report.md, index.html and explore.html."""
    from .render_html import render_html

    schema.check(results)
    outdir.mkdir(parents=True, exist_ok=True)
    texts: dict[Format, str] = {
        "json": schema.dumps(results),
        "markdown": render_markdown(results),
        "html": render_html(results),
    }
    paths = {}
    for fmt, text in texts.items():
        paths[fmt] = outdir / FILES[fmt]
        paths[fmt].write_text(text, encoding="utf-8")
    write_explorer(outdir)  # the claims' sections link into it
    return paths
