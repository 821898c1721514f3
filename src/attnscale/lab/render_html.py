"""The report as one HTML page, readable offline: inline CSS, no scripts, figures as relative links."""

from __future__ import annotations

from html import escape
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

__all__ = ["render_html"]

_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d1d1f; max-width: 1100px;
       margin: 2em auto; padding: 0 1em; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 2.2em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.meta { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #d6d6d6; padding: 0.25em 0.55em; text-align: left; vertical-align: top; }
th { background: #f4f4f6; }
td.num { font-variant-numeric: tabular-nums; }
table.grid td.num, td.secs { text-align: right; }
td.id { white-space: nowrap; }
.scroll { overflow-x: auto; }
td table { margin: 0; font-size: 0.95em; }
.badge { display: inline-block; padding: 0.05em 0.6em; border-radius: 1em; font-weight: 600;
         font-size: 0.85em; white-space: nowrap; color: #fff; }
.holds { background: #1e8e3e; } .holds-approximately { background: #b26a00; }
.does-not-hold { background: #c5221f; } .inconclusive { background: #6b4fa0; }
.statement { font-size: 1.05em; border-left: 4px solid #8ab4f8; padding-left: 0.8em; margin-left: 0; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.85em; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.rule { color: #333; background: #fafafa; border: 1px dashed #ccc; padding: 0.5em 0.8em; }
"""


def _badge(verdict: str) -> str:
    return f'<span class="badge {escape(verdict)}">{escape(verdict)}</span>'


def _cell(value: Any) -> str:
    if is_scalar(value):
        cls = ' class="num"' if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
        return f"<td{cls}>{escape(format_value(value))}</td>"
    return f"<td>{_table(value)}</td>"


def _table(value: Any) -> str:
    """Any JSON value as HTML: dicts as key/value rows, grids and records as 2-D tables, nested freely."""
    grid = grid_columns(value)
    if grid is not None:
        head = "<tr><th></th>" + "".join(f"<th>{escape(c)}</th>" for c in grid) + "</tr>"
        rows = "".join(
            f"<tr><th>{escape(k)}</th>" + "".join(_cell(r.get(c, "")) for c in grid) + "</tr>" for k, r in value.items()
        )
        return f'<table class="grid">{head}{rows}</table>'
    records = record_columns(value)
    if records is not None:
        head = "<tr>" + "".join(f"<th>{escape(c)}</th>" for c in records) + "</tr>"
        rows = "".join("<tr>" + "".join(_cell(r.get(c, "")) for c in records) + "</tr>" for r in value)
        return f'<table class="grid">{head}{rows}</table>'
    if isinstance(value, dict):
        rows = "".join(f"<tr><th>{escape(str(k))}</th>{_cell(v)}</tr>" for k, v in value.items())
        return f"<table>{rows}</table>"
    return escape(format_value(value))


def _section(rec: dict[str, Any]) -> str:
    cid = escape(rec["id"])
    parts = [
        f'<section id="{cid}">',
        f"<h2>{cid} {_badge(rec['verdict'])}</h2>",
        f'<blockquote class="statement">{escape(rec["statement"])}</blockquote>',
        f"<p><strong>Verdict: {escape(rec['verdict'])}.</strong> {escape(rec['reason'])}</p>",
    ]
    if view := explorer_link(rec["id"]):
        parts.append(f'<p><a class="explore" href="{escape(view)}">See it in the explorer</a>: move d_k and the divisor.</p>')
    if rec["arms"]:
        parts.append(
            '<ul class="arms">'
            + "".join(f"<li><strong>{escape(a['name'])}</strong> {_badge(a['verdict'])} {escape(a['reason'])}</li>" for a in rec["arms"])
            + "</ul>"
        )
    if rec["sources"]:
        parts.append("<p><strong>Sources.</strong></p><ul>" + "".join(f"<li>{escape(s)}</li>" for s in rec["sources"]) + "</ul>")
    if rec["method"]:
        parts.append(f"<p><strong>Method.</strong> {escape(rec['method'])}</p>")
    for fig in rec["figures"]:
        parts.append(
            f'<figure><img src="{escape(fig["svg"])}" alt="{escape(fig["name"])}">'
            f'<figcaption>{escape(fig["name"])} (<a href="{escape(fig["png"])}">PNG</a>)</figcaption></figure>'
        )
    if rec["measured"]:
        parts.append('<h3>Measured</h3><div class="scroll">' + _table(rec["measured"]) + "</div>")
    if rec["rule"]:
        parts.append(f'<p class="rule"><strong>Verdict rule ({escape(rule_label(rec))}).</strong> {escape(rec["rule"])}</p>')
    if rec["rule_history"]:
        history = "".join(f"<li>{escape(line)}</li>" for line in rule_history_lines(rec))
        parts.append(f'<p class="meta">Rule history:</p><ul class="meta">{history}</ul>')
    if rec["config"]:
        parts.append('<h3>Config</h3><div class="scroll">' + _table(rec["config"]) + "</div>")
    cached = " (from the cache)" if rec["cached"] else ""
    parts.append(f'<p class="meta">{rec["seconds"]:.1f} s wall, {rec["cpu_seconds"]:.1f} s CPU{cached}</p>')
    if rec["error"]:
        parts.append(f"<details><summary>Error</summary><pre>{escape(rec['error'])}</pre></details>")
    parts.append("</section>")
    return "\n".join(parts)


def render_html(results: dict[str, Any]) -> str:
    """The whole page: a claims table with verdict badges, then one section per claim."""
    env = results["environment"]
    rows = "".join(
        f'<tr><td class="id"><a href="#{escape(r["id"])}">{escape(r["id"])}</a></td><td>{escape(r["statement"])}</td>'
        f"<td>{_badge(r['verdict'])}</td><td>{escape(headline_text(r))}</td>"
        f'<td class="secs">{r["seconds"]:.1f}</td></tr>'
        for r in results["claims"]
    )
    missing = ""
    if results["not_measured"]:
        items = "".join(f"<li><code>{escape(c['id'])}</code>: {escape(c['statement'])}</li>" for c in results["not_measured"])
        missing = f"<p>Claims without an experiment yet:</p><ul>{items}</ul>"
    meta = (
        f"attnscale {escape(results['attnscale_version'])} &middot; {escape(results['created'])} &middot; "
        f"profile <code>{escape(results['profile'])}</code> &middot; seed {results['seed']} &middot; "
        f"Python {escape(env['python'])}, torch {escape(env['torch'])}, {escape(env['cpu'])} &middot; "
        f"{results['seconds']:.1f} s"
    )
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            "<title>attnscale lab report</title>",
            f"<style>{_CSS}</style></head><body>",
            "<h1>attnscale lab report</h1>",
            f'<p class="meta">{meta}</p>',
            "<p>Each claim about the 1/sqrt(d_k) scale is measured by an experiment and judged by a rule written "
            "before the numbers were seen: <em>holds</em>, <em>holds-approximately</em>, <em>does-not-hold</em> "
            "or <em>inconclusive</em>.</p>",
            f"<p>Reproduce: <code>attnscale report --profile {escape(results['profile'])} --seed {results['seed']}</code></p>",
            "<h2>Claims</h2>",
            "<table><tr><th>claim</th><th>statement</th><th>verdict</th><th>key number</th><th>seconds</th></tr>",
            rows,
            "</table>",
            f"<p>Verdicts: {escape(verdict_counts(results))}.</p>",
            missing,
            *(_section(r) for r in results["claims"]),
            "</body></html>",
            "",
        ]
    )
