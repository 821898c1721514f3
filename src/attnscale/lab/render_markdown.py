"""The report as Markdown (``report.md``): the claims table, then a section per claim."""

from __future__ import annotations

from typing import Any

from .explorer import explorer_link
from .formatting import (
    format_value,
    grid_columns,
    headline_text,
    is_scalar,
    record_columns,
    rule_history_lines,
    rule_label,
    verdict_counts,
)

__all__ = ["render_markdown"]

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
        for fig in rec["figures"]:
            lines += [f"![{fig['name']}]({fig['png']})", ""]
            if fig.get("caption"):  # absent in results files from before captions
                lines += [fig["caption"], ""]
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
