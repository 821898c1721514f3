"""The report as one HTML page, readable offline: inline CSS, no scripts, figures as relative links.

The summary comes first; each claim's section shows its statement, verdict, key number, main
figure and method, and folds away (``<details>``) the further figures, the full reason, the raw
measured data, the rule and its history, the sources and the config.
"""

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
    short_arm_name,
    short_reason,
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
figure { margin: 1em 0; } figure img { max-width: min(100%, 760px); max-height: 560px; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.85em; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.rule { color: #333; background: #fafafa; border: 1px dashed #ccc; padding: 0.5em 0.8em; }
table.summary { table-layout: fixed; width: 100%; } table.summary td { overflow-wrap: anywhere; }
col.c-id { width: 13em; } col.c-verdict { width: 12em; } col.c-key { width: 17em; }
.arms .arm { color: #555; font-size: 0.8em; margin-left: 0.4em; } .arms { white-space: normal; }
details { margin: 0.4em 0; } summary { cursor: pointer; color: #1a4f9c; }
.key { font-weight: 600; }
section { overflow-wrap: anywhere; }
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


def _verdicts(rec: dict[str, Any]) -> str:
    """The claim's verdict badge, and each arm's beside it where arms were judged on their own."""
    arms = "".join(f" <span class=\"arm\">{escape(short_arm_name(a['name']))}</span> {_badge(a['verdict'])}" for a in rec["arms"])
    return _badge(rec["verdict"]) + (f'<span class="arms">{arms}</span>' if arms else "")


def _fold(summary: str, body: str) -> str:
    return f"<details><summary>{escape(summary)}</summary>{body}</details>"


def _figure(fig: dict[str, str]) -> str:
    """The figure and its caption; a results file from before captions shows the figure's name instead."""
    caption = fig.get("caption") or fig["name"]
    return (
        f'<figure><a href="{escape(fig["svg"])}"><img src="{escape(fig["svg"])}" alt="{escape(caption)}"></a>'
        f'<figcaption>{escape(caption)} (<a href="{escape(fig["png"])}">PNG</a>)</figcaption></figure>'
    )


def _section(rec: dict[str, Any]) -> str:
    """One claim: statement, verdict and its plain reason, the main figure, method; the rest folded."""
    cid = escape(rec["id"])
    reason = short_reason(rec["reason"])
    parts = [
        f'<section id="{cid}">',
        f"<h2>{cid} {_verdicts(rec)}</h2>",
        f'<blockquote class="statement">{escape(rec["statement"])}</blockquote>',
        f"<p><strong>Verdict: {escape(rec['verdict'])}.</strong> {escape(reason)}</p>",
    ]
    if rec["arms"]:
        parts.append(
            '<ul class="arms">'
            + "".join(
                f"<li><strong>{escape(a['name'])}</strong> {_badge(a['verdict'])} {escape(short_reason(a['reason']))}</li>"
                for a in rec["arms"]
            )
            + "</ul>"
        )
    if rec["headline"]:
        parts.append(f'<p class="key">{escape(headline_text(rec))}</p>')
    if view := explorer_link(rec["id"]):
        parts.append(f'<p><a class="explore" href="{escape(view)}">See it in the explorer</a>: move d_k and the divisor.</p>')
    if rec["figures"]:
        parts.append(_figure(rec["figures"][0]))
    if rec["method"]:
        parts.append(f"<p><strong>Method.</strong> {escape(rec['method'])}</p>")
    if len(rec["figures"]) > 1:
        parts.append(_fold(f"More figures ({len(rec['figures']) - 1})", "".join(_figure(f) for f in rec["figures"][1:])))
    if reason != rec["reason"] or any(short_reason(a["reason"]) != a["reason"] for a in rec["arms"]):
        full = f"<p>{escape(rec['reason'])}</p>" + "".join(
            f"<p><strong>{escape(a['name'])}:</strong> {escape(a['reason'])}</p>" for a in rec["arms"]
        )
        parts.append(_fold("The verdict's full reason", full))
    if rec["measured"]:
        parts.append(_fold("Measured data (complete in results.json)", '<div class="scroll">' + _table(rec["measured"]) + "</div>"))
    rule = f'<p class="rule">{escape(rec["rule"])}</p>' if rec["rule"] else ""
    if rec["rule_history"]:
        rule += "<p>History:</p><ul>" + "".join(f"<li>{escape(line)}</li>" for line in rule_history_lines(rec)) + "</ul>"
    if rule:
        parts.append(_fold(f"Verdict rule ({rule_label(rec)})", rule))
    if rec["sources"]:
        items = "".join(f"<li>{escape(s)}</li>" for s in rec["sources"])
        parts.append(_fold("Where the claim is stated (docs/claims.md)", f"<ul>{items}</ul>"))
    if rec["config"]:
        parts.append(_fold("Config", '<div class="scroll">' + _table(rec["config"]) + "</div>"))
    if rec["error"]:
        parts.append(_fold("Error", f"<pre>{escape(rec['error'])}</pre>"))
    cached = " (from the cache)" if rec["cached"] else ""
    parts.append(
        f'<p class="meta">{rec["seconds"]:.1f} s wall, {rec["cpu_seconds"]:.1f} s CPU{cached} &middot; '
        '<a href="#top">back to the summary</a></p>'
    )
    parts.append("</section>")
    return "\n".join(parts)


def render_html(results: dict[str, Any]) -> str:
    """The whole page: the summary (one row per claim: verdict, what was found, key number), then one
    section per claim with its figure and method, the raw data folded away."""
    env = results["environment"]
    rows = "".join(
        f'<tr><td class="id"><a href="#{escape(r["id"])}">{escape(r["id"])}</a></td><td>{_verdicts(r)}</td>'
        f"<td>{escape(short_reason(r['reason'], 160))}</td><td>{escape(headline_text(r))}</td></tr>"
        for r in results["claims"]
    )
    missing = ""
    if results["not_measured"]:
        items = "".join(f"<li><code>{escape(c['id'])}</code>: {escape(c['statement'])}</li>" for c in results["not_measured"])
        missing = f"<p>Claims without an experiment yet:</p><ul>{items}</ul>"
    commit = env.get("commit") or "not recorded"
    meta = (
        f"attnscale {escape(results['attnscale_version'])} &middot; commit {escape(commit)} &middot; "
        f"{escape(results['created'])} &middot; profile <code>{escape(results['profile'])}</code> &middot; "
        f"seed {results['seed']} &middot; Python {escape(env['python'])}, torch {escape(env['torch'])}, "
        f"{escape(env['cpu'])} &middot; {results['seconds']:.1f} s"
    )
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            "<title>attnscale lab report</title>",
            f'<style>{_CSS}</style></head><body id="top">',
            "<h1>attnscale lab report</h1>",
            f'<p class="meta">{meta}</p>',
            "<p>Each claim about the 1/sqrt(d_k) scale is measured by an experiment and judged by a versioned rule "
            "(its history is in each section): <em>holds</em>, <em>holds-approximately</em>, <em>does-not-hold</em> "
            "or <em>inconclusive</em>. Where an experiment has arms judged on their own (two optimizers, two "
            "models), each arm's verdict is shown beside the claim's.</p>",
            f"<p>Reproduce: <code>attnscale report --profile {escape(results['profile'])} --seed {results['seed']}</code></p>",
            f"<h2>Summary</h2><p>Verdicts: {escape(verdict_counts(results))}.</p>",
            '<table class="summary"><colgroup><col class="c-id"><col class="c-verdict"><col><col class="c-key"></colgroup>',
            "<tr><th>claim</th><th>verdict</th><th>what was found</th><th>key number</th></tr>",
            rows,
            "</table>",
            missing,
            *(_section(r) for r in results["claims"]),
            "</body></html>",
            "",
        ]
    )
