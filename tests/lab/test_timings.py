"""The published task timings: the start order of a report whose cache has none (a fresh clone)."""

import json

import pytest

from attnscale.lab import cache, registry, runner, timings
from attnscale.lab.execute import Task


def _record(claim_id, seconds, parts=(), cached=False):
    return {"id": claim_id, "seconds": seconds, "cached": cached, "parts": [{"name": n, "seconds": s} for n, s in parts]}


def _results(profile, claims):
    return {"profile": profile, "seed": 0, "environment": {"commit": "abc", "cpu": "a CPU"}, "claims": claims}


def test_the_table_times_every_task_of_the_default_and_quick_reports():
    # A task without a time starts first (it may be long); one claim renamed or one part added
    # without the table rewritten is caught here rather than by a slower fresh-clone report.
    for profile in ("default", "quick"):
        missing = []
        for exp in registry.discover().experiments:
            config = exp.config(profile)
            names = exp.module.parts(config) if hasattr(exp.module, "parts") else [None]
            missing += [timings.task_name(exp.id, p) for p in names if timings.expected(profile, exp.id, p) is None]
        assert not missing, (
            f"{profile}: no published time for {missing}; rerun `attnscale report --force` at that profile and "
            "`python -m attnscale.lab.timings RESULTS.json`"
        )


def test_a_table_is_written_per_profile_and_read_back(tmp_path):
    table = tmp_path / "t.json"
    default = tmp_path / "d.json"
    default.write_text(json.dumps(_results("default", [_record("a", 3.04), _record("b", 9.0, parts=[("x", 4.0), ("y", 5.0)])])))
    quick = tmp_path / "q.json"
    quick.write_text(json.dumps(_results("quick", [_record("a", 1.0)])))
    assert timings.main([str(default), "--table", str(table)]) == 0
    assert timings.main([str(quick), "--table", str(table)]) == 0  # adds quick, keeps default
    got = timings._profiles(table)
    assert got == {"default": {"a": 3.0, "b/x": 4.0, "b/y": 5.0}, "quick": {"a": 1.0}}


def test_a_report_read_from_the_cache_is_refused_as_a_table(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_results("default", [_record("a", 3.0, cached=True)])))
    with pytest.raises(SystemExit, match="read from the cache, not timed; run the report with --force"):
        timings.main([str(path), "--table", str(tmp_path / "t.json")])


@pytest.mark.parametrize("text", ["not json", "[]", '{"profiles": {"default": {"seconds": {"a": "x"}}}}'], ids=["text", "list", "string"])
def test_a_damaged_table_orders_nothing_and_raises_nothing(tmp_path, text):
    path = tmp_path / "t.json"
    path.write_text(text)
    assert timings._profiles(path) == {}


def _task(claim_id, part=None):
    return Task(module_name="m", claim_id=claim_id, profile="default", seed=0, figdir=None, fig_prefix="", cache_file=None, part=part)


def test_start_order_is_longest_first_by_the_cache_then_the_table_unknown_first(tmp_path, monkeypatch):
    table = {"default": {"short": 1.0, "long": 50.0, "parted/p1": 20.0, "parted/p2": 30.0, "cached": 2.0}}
    monkeypatch.setattr(timings, "_profiles", lambda: table)
    record = {**_full_record(), "id": "cached", "seconds": 99.0, "cached": False}
    cache.store(cache.cache_path(tmp_path, "cached", "0" * 16), record)  # this machine's own time wins
    pending = [_task("short"), _task("parted", "p1"), _task("parted", "p2"), _task("new"), _task("long"), _task("cached")]
    order = [timings.task_name(t.claim_id, t.part) for t in runner.start_order(pending, tmp_path)]
    assert order == ["new", "cached", "long", "parted/p2", "parted/p1", "short"]


def _full_record():
    return {
        "statement": "", "sources": [], "method": "", "rule": "", "rule_history": [], "rule_version": None, "rule_fingerprint": "",
        "verdict": "holds", "reason": "", "arms": [], "headline": None, "measured": {}, "figures": [], "config": {},
        "cpu_seconds": 1.0, "error": None,
    }  # fmt: skip
