"""results.json's schema and validator, and the Markdown and HTML renderers."""

import copy
import json
import math
import re

import numpy as np
import pytest
import torch

from attnscale.lab import formatting, report, schema
from attnscale.lab.render_html import render_html
from attnscale.lab.render_markdown import render_markdown


def _claim(claim_id="variance-law", verdict="holds"):
    return {
        "id": claim_id,
        "statement": "Var(q.k) = d_k",
        "sources": ["Vaswani et al. 2017"],
        "method": "draw many pairs",
        "rule": "holds if within 4 standard errors",
        "rule_history": [
            {"version": 1, "date": "2026-11-29", "why": "the rule as first committed", "fingerprint": "0" * 16},
            {"version": 2, "date": "2026-12-01", "why": "4 standard errors, not 3", "fingerprint": "1" * 16},
        ],
        "rule_version": 2,
        "rule_fingerprint": "1" * 16,
        "verdict": verdict,
        "reason": "all points <within> 4 SE & fine",
        "arms": [],
        "headline": {"key": "ratio", "value": 1.01, "label": "Var(q.k) / d_k", "unit": "x"},
        "measured": {
            "ratio": 1.01,
            "count": 3,
            "flag": True,
            "missing": None,
            "inf": "Infinity",
            "dks": list(range(40)),
            "grid": {"gaussian": {"2": 1.0, "4": 0.99}, "uniform": {"2": 1.02, "4": 1.0}},
            "records": [{"d": 2, "v": 1.0}, {"d": 4, "v": 1.1}],
            "nested": {"inner": {"deep": {"x": 1}}, "y": 2.5},
        },
        "figures": [{"name": "plot", "svg": "figures/variance-law/plot.svg", "png": "figures/variance-law/plot.png"}],
        "config": {"samples": 100, "dks": [2, 4]},
        "seconds": 1.5,
        "cpu_seconds": 1.2,
        "cached": False,
        "error": None,
    }


def _results():
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "attnscale_version": "0.1.0",
        "created": "2026-01-31T12:00:00+00:00",
        "profile": "quick",
        "seed": 0,
        "seconds": 12.5,
        "environment": {"python": "3.11.2", "torch": "2.13.0", "threads": 1, "cpu": "a <cpu>"},
        "not_measured": [{"id": "training-stall", "statement": "stalls"}],
        "claims": [_claim(), _claim("saturation-example", "does-not-hold")],
    }


def test_valid_results_pass():
    assert schema.validate(_results()) == []
    schema.check(_results())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.pop("created"), "$: missing key created"),
        (lambda r: r.update(created="yesterday"), "not an ISO 8601"),
        (lambda r: r.update(profile="huge"), "$.profile: 'huge' is not one of"),
        (lambda r: r["claims"][0].update(verdict="maybe"), "$.claims[0].verdict"),
        (lambda r: r["claims"][1].pop("reason"), "$.claims[1]: missing key reason"),
        (lambda r: r["claims"][0].update(seconds="1"), "$.claims[0].seconds: expected number"),
        (lambda r: r["claims"][0].update(cached=1), "$.claims[0].cached: expected boolean"),
        (lambda r: r["environment"].update(threads=True), "$.environment.threads: expected integer"),
        (lambda r: r["claims"][0]["figures"][0].pop("png"), "figures[0]: missing key png"),
    ],
)
def test_validator_names_each_violation(edit, message):
    results = _results()
    edit(results)
    errors = schema.validate(results)
    assert any(message in e for e in errors), errors
    with pytest.raises(ValueError, match=re.escape(message)):
        schema.check(results)


def test_check_refuses_nan_and_infinity():
    results = _results()
    results["claims"][0]["measured"]["ratio"] = math.nan
    with pytest.raises(ValueError, match="NaN or infinity"):
        schema.check(results)


def test_to_jsonable_is_consistent_for_non_finite_values_and_array_types():
    data = {
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "np": np.float32(0.5),
        "npint": np.int64(3),
        "arr": np.array([1.0, np.inf]),
        "tensor": torch.tensor([[1.0, math.nan]]),
        "scalar": torch.tensor(2),
        "tuple": (1, 2),
        3: "key",
    }
    out = schema.to_jsonable(data)
    assert out == {
        "nan": "NaN",
        "inf": "Infinity",
        "ninf": "-Infinity",
        "np": 0.5,
        "npint": 3,
        "arr": [1.0, "Infinity"],
        "tensor": [[1.0, "NaN"]],
        "scalar": 2,
        "tuple": [1, 2],
        "3": "key",
    }
    json.loads(schema.dumps(out))
    with pytest.raises(TypeError, match="cannot store a object"):
        schema.to_jsonable({"x": object()})


def test_html_page_has_table_badges_sections_and_escapes_text():
    page = render_html(_results())
    assert page.startswith("<!DOCTYPE html>")
    assert '<span class="badge holds">holds</span>' in page
    assert '<span class="badge does-not-hold">does-not-hold</span>' in page
    assert '<section id="variance-law">' in page and '<a href="#variance-law">' in page
    assert '<img src="figures/variance-law/plot.svg"' in page
    assert "&lt;within&gt; 4 SE &amp; fine" in page and "<within>" not in page
    assert "a &lt;cpu&gt;" in page
    assert "<script" not in page and "http" not in page  # self-contained, offline
    assert "<th>gaussian</th><td class=\"num\">1</td>" in page  # a dict of dicts becomes a grid
    assert "(40 values)" in page  # long lists are shortened
    assert "training-stall" in page


def test_markdown_has_claims_table_sections_and_grids():
    text = render_markdown(_results())
    assert "| [variance-law](#variance-law) | **holds** | Var(q.k) / d_k: 1.01x | 1.5 |" in text
    assert "## saturation-example" in text
    assert "![plot](figures/variance-law/plot.png)" in text
    assert "| gaussian | 1 | 0.99 |" in text
    assert "| nested.y | 2.5 |" in text
    assert "| 4 | 1.1 |" in text  # list of records


def test_write_report_writes_all_formats_and_rejects_bad_results(tmp_path):
    paths = report.write_report(_results(), tmp_path)
    assert set(paths) == {"json", "markdown", "html"}
    assert json.loads((tmp_path / "results.json").read_text()) == _results()
    bad = copy.deepcopy(_results())
    bad["claims"][0]["verdict"] = "probably"
    with pytest.raises(ValueError, match="verdict"):
        report.write_report(bad, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_format_value():
    assert formatting.format_value(1.6700863991745674e-05) == "1.6701e-05"
    assert formatting.format_value([1, [2, 3]]) == "[1, [2, 3]]"
    assert formatting.format_value(None) == "null"


def test_report_shows_the_rule_version_its_history_and_every_arm():
    results = _results()
    results["claims"][1]["arms"] = [
        {"name": "AdamW", "verdict": "does-not-hold", "reason": "x0.97"},
        {"name": "SGD", "verdict": "holds", "reason": "stalls"},
    ]
    results["claims"][1]["rule_version"] = None
    page, text = render_html(results), render_markdown(results)
    for shown in (page, text):
        assert "rule v2, code 1111111111111111" in shown
        assert "v1, 2026-11-29: the rule as first committed" in shown and "v2, 2026-12-01: 4 standard errors, not 3" in shown
        assert "code matching no recorded version" in shown
    assert '<strong>AdamW</strong> <span class="badge does-not-hold">does-not-hold</span> x0.97' in page
    assert '<strong>SGD</strong> <span class="badge holds">holds</span> stalls' in page
    assert "- AdamW: **does-not-hold**. x0.97" in text and "- SGD: **holds**. stalls" in text


def test_a_key_number_shows_its_standard_error_beside_it():
    from attnscale.lab.base import Headline
    from attnscale.lab.execute import headline
    from attnscale.lab.formatting import headline_value

    measured = {"over": {"none": 88.61}, "spread": {"none": 4.123}}
    head = headline(measured, Headline("over.none", "growth", "x", spread="spread.none"))
    assert head == {"key": "over.none", "value": 88.61, "label": "growth", "unit": "x", "spread": 4.123}
    assert headline_value(head) == "88.6x +- 4.1"
    assert headline_value({**head, "spread": None}) == "88.6x"  # no spread recorded: the number alone
    assert headline_value(headline(measured, Headline("over.none", "growth", "x"))) == "88.6x"
