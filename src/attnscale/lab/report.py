"""Write the report: ``results.json`` (the data), ``report.md`` and ``index.html`` (for people).

One renderer per format: :func:`attnscale.lab.render_markdown.render_markdown` and
:func:`attnscale.lab.render_html.render_html`. Both read only the results.json data, so a report
can be re-rendered from it; :mod:`attnscale.lab.formatting` holds what they share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from . import schema
from .explorer import write_explorer
from .render_html import render_html
from .render_markdown import render_markdown

__all__ = ["FILES", "Format", "write_report"]

Format = Literal["json", "markdown", "html"]
FILES: dict[Format, str] = {"json": "results.json", "markdown": "report.md", "html": "index.html"}


def write_report(results: dict[str, Any], outdir: Path) -> dict[Format, Path]:
    """Check ``results`` against the schema, then write results.json, report.md, index.html and explore.html."""
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
