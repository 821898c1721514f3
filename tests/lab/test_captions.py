"""Every figure of the report has a caption that says what it shows, carried from the experiment's
``captions`` through ``execute`` into results.json, the HTML page and report.md; a results.json from
before captions still validates and renders, with the figure's name in the caption's place."""

from html import escape

import pytest

from attnscale.lab import schema
from attnscale.lab.registry import CLAIM_IDS
from attnscale.lab.render_html import render_html
from attnscale.lab.render_markdown import render_markdown


def _results(claims: list[dict]) -> dict:
    return {
        "schema_version": schema.SCHEMA_VERSION, "attnscale_version": "0.1.0", "created": "2026-12-01T00:00:00+00:00",
        "profile": "tiny", "seed": 0, "seconds": 1.0,
        "environment": {"python": "3.11", "torch": "2.13", "threads": 1, "cpu": "cpu", "commit": None},
        "not_measured": [], "claims": claims,
    }


@pytest.mark.parametrize("claim_id", CLAIM_IDS)
def test_every_figure_at_the_tiny_profile_has_a_caption_that_the_page_shows(claim_id, tiny_run):
    record, saved = tiny_run(claim_id)
    assert record["error"] is None, record["error"]
    assert [fig["name"] for fig in record["figures"]] == [name for name, _ in saved]
    if claim_id == "scale-in-the-wild" and not record["figures"]:
        pytest.skip("transformers probed no architecture here: the experiment draws no figure")
    assert record["figures"], f"{claim_id} drew no figure"
    html = render_html(_results([record]))
    markdown = render_markdown(_results([record]))
    for fig in record["figures"]:
        caption = fig["caption"]
        assert len(caption.split()) >= 8, f"{claim_id}/{fig['name']}: caption {caption!r} says too little"
        assert fig["name"] not in caption, f"{claim_id}: the caption {caption!r} names the file"
        assert f"<figcaption>{escape(caption)} (" in html
        assert caption in markdown
    assert not schema.validate(_results([record]))


def test_a_results_file_from_before_captions_still_validates_and_renders_with_the_figure_names():
    fig = {"name": "variance_vs_dk", "svg": "figures/v/variance_vs_dk.svg", "png": "figures/v/variance_vs_dk.png"}
    record = {
        "id": "variance-law", "statement": "s", "sources": [], "method": "", "rule": "", "rule_history": [],
        "rule_version": None, "rule_fingerprint": "", "verdict": "holds", "reason": "r", "arms": [], "headline": None,
        "measured": {}, "figures": [fig], "config": {}, "seconds": 0.0, "cpu_seconds": 0.0, "cached": False, "error": None,
    }
    results = _results([record])
    assert not schema.validate(results)
    assert "<figcaption>variance_vs_dk (" in render_html(results)
    assert "![variance_vs_dk](figures/v/variance_vs_dk.png)" in render_markdown(results)
