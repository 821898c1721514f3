"""The documentation site builds offline in strict mode, and its pages say what the code does."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnscale.cli import EXIT_CODES

ROOT = Path(__file__).resolve().parents[1]
MISSING = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python") if importlib.util.find_spec(m.split(".")[0]) is None]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if MISSING:
        pytest.skip(f"the docs extra is not installed (no {', '.join(MISSING)}): pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_strict_build_writes_every_page(site):
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert {"index", "getting-started", "cli", "semantics", "backends", "diagnostics", "api", "benchmarks", "claims"} <= pages
    for page in pages:
        assert (site / f"{page}.html").is_file(), page


def test_api_reference_is_generated_from_the_docstrings(site):
    html = (site / "api.html").read_text()
    for name in ("scaled_dot_product_attention", "varlen_attention", "MultiHeadAttention", "AttentionStats", "MonitorReport"):
        assert f'id="attnscale.{name}"' in html or f'id="attnscale.diagnostics.{name}"' in html, name
    assert "True = attend" in html  # the function's own docstring, not a summary


def test_benchmarks_page_includes_the_benchmarks_readme(site):
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    first_heading = re.search(r"^## (.+)$", readme, re.M).group(1)
    text = re.sub(r"<[^>]+>", "", (site / "benchmarks.html").read_text())
    assert first_heading.replace("`", "") in text


def test_site_needs_no_network(site):
    for page in site.glob("*.html"):
        html = page.read_text()
        assert not re.search(r'<(?:script|link)[^>]+(?:src|href)="(?:https?:)?//', html), page.name


def test_cli_page_lists_the_exit_codes_the_command_line_returns():
    text = (ROOT / "docs" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", text, re.M))
    assert {int(code) for code in rows} == {code for code, _ in EXIT_CODES}
    for code, meaning in EXIT_CODES:
        assert rows[str(code)].replace("`", "") == meaning, code
