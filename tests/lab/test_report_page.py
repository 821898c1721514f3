"""The report page reads summary first, folds raw data away, and fits the page's budget: checked on a
report of 20 claims with real figures, long reasons and wide measured tables, in headless Chromium."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from attnscale.lab import report, schema
from attnscale.lab.base import save_figure

CHROMIUM = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and Path(p).exists()), None)
LONG = "the learned temperature routes more sharply, but not as claimed in full: " + "; ".join(
    f"condition {i}: x{1 + i / 10:.2f} (unscaled init logit std {i:.1f})" for i in range(30)
)


def _claim(i: int, outdir: Path) -> dict:
    cid = f"claim-{i:02d}"
    figures = []
    for name in ("main", "more"):
        fig = Figure(figsize=(7.0, 5.0), layout="constrained")  # the experiments' usual size
        fig.add_subplot().plot(range(10))
        save_figure(fig, outdir / "figures" / cid, name)
        figures.append({"name": name, "svg": f"figures/{cid}/{name}.svg", "png": f"figures/{cid}/{name}.png"})
    grid = {f"row {r}": {f"column {c}": r * c / 7 for c in range(16)} for r in range(60)}  # 60 x 16 numbers
    return {
        "id": cid, "statement": "a claim " * 20, "sources": ["Vaswani et al. 2017, sec. 3.2.1"], "method": "m " * 80,
        "rule": "r " * 80, "rule_history": [{"version": 1, "date": "2026-11-29", "why": "first", "fingerprint": "0" * 16}],
        "rule_version": 1, "rule_fingerprint": "0" * 16, "verdict": "holds-approximately", "reason": LONG,
        "arms": [{"name": "AdamW", "verdict": "does-not-hold", "reason": LONG}, {"name": "SGD", "verdict": "holds", "reason": "x"}]
        if i == 5 else [],
        "headline": {"key": "k", "value": 1.07, "label": "steps without the scale / with it", "unit": "x"},
        "measured": {"curves": grid, "series": list(range(500)), "wide": {"x" * 120: "y" * 300}},
        "figures": figures, "config": {"steps": 1500}, "seconds": 1.0, "cpu_seconds": 1.0, "cached": False, "error": None,
    }


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("page")
    results = {
        "schema_version": schema.SCHEMA_VERSION, "attnscale_version": "0.1.0", "created": "2026-12-01T00:00:00+00:00",
        "profile": "default", "seed": 0, "seconds": 880.0,
        "environment": {"python": "3.11", "torch": "2.13", "threads": 1, "cpu": "cpu", "commit": "0" * 40},
        "not_measured": [], "claims": [_claim(i, outdir) for i in range(20)],
    }
    report.write_report(results, outdir)
    return outdir


def test_summary_first_raw_data_folded_and_every_section_links_back(page):
    html = (page / "index.html").read_text()
    assert html.index('<table class="summary">') < html.index('<section id="claim-00">')
    for section in re.findall(r"<section id=.*?</section>", html, flags=re.S):
        assert '<a href="#top">back to the summary</a>' in section
        folded = "".join(re.findall(r"<details>.*?</details>", section, flags=re.S))
        shown = re.sub(r"<details>.*?</details>", "", section, flags=re.S)
        assert "row 59" in folded and "row 59" not in shown  # the raw grid only when unfolded
        assert shown.count("<img ") == 1 and folded.count("<img ") == 1  # one figure shown, the other folded
        assert "The verdict&#x27;s full reason" in section and LONG[-40:] in folded
    assert '<body id="top">' in html


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium at /usr/bin/chromium or on PATH: the page is not rendered")
def test_the_folded_page_is_under_25000_px_at_1400_px_and_nothing_is_wider_than_the_page(page, tmp_path):
    probe = page / "probe.html"
    script = (
        "<script>window.addEventListener('load', () => { const w = document.documentElement.clientWidth;"
        " const wide = [...document.querySelectorAll('table')].filter(t => !t.closest('details, .scroll')"
        " && t.getBoundingClientRect().right > w + 1).length;"
        " document.body.setAttribute('data-probe', JSON.stringify({height: document.documentElement.scrollHeight,"
        " scrollWidth: document.documentElement.scrollWidth, width: w, wide: wide,"
        " broken: [...document.images].filter(i => !i.naturalWidth).length})); });</script>"
    )
    probe.write_text((page / "index.html").read_text().replace("</body>", script + "</body>"))
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1000", "--virtual-time-budget=20000",
        "--dump-dom", probe.as_uri(),
    ]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=120).stdout
    found = re.search(r'data-probe="([^"]*)"', dom)
    assert found, "the page did not finish loading"
    measured = json.loads(found.group(1).replace("&quot;", '"'))
    assert measured["broken"] == 0
    assert measured["scrollWidth"] <= measured["width"] and measured["wide"] == 0, measured
    assert measured["height"] < 25_000, measured
    assert measured["height"] > 5_000, measured  # the figures did load and count
