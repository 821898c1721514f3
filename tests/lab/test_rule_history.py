"""Pre-registration made checkable: every verdict rule has a versioned history whose last entry is
the code that judges now, so that a rule cannot change without a new version saying when and why."""

import importlib.util
import sys
import textwrap
from datetime import date

import pytest

from attnscale.lab import registry, runner
from attnscale.lab.base import RuleVersion, rule_fingerprint

EXPERIMENTS = registry.discover().experiments


@pytest.mark.parametrize("exp", EXPERIMENTS, ids=lambda e: e.id)
def test_the_latest_rule_version_is_the_code_that_judges(exp):
    history = exp.claim.rule_history
    assert history, f"{exp.id}: CLAIM has no rule_history"
    assert [v.version for v in history] == list(range(1, len(history) + 1))
    dates = [date.fromisoformat(v.date) for v in history]
    assert dates == sorted(dates)
    assert all(v.why.strip() for v in history)
    assert len({v.fingerprint for v in history}) == len(history), "two versions with the same code"
    found = rule_fingerprint(exp.module)
    latest = history[-1]
    assert found == latest.fingerprint, (
        f"{exp.id}: the verdict rule's code changed since version {latest.version}; add "
        f"RuleVersion({latest.version + 1}, '<date>', '<why>', '{found}') to its CLAIM.rule_history"
    )
    assert runner.rule_fields(exp.claim, exp.module) == {"rule_version": latest.version, "rule_fingerprint": found}


def _load(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


RULE = '''
import statistics
from dataclasses import dataclass

LIMIT = {limit}


@dataclass(frozen=True)
class Config:
    seeds: int = {seeds}

    @classmethod
    def for_profile(cls, profile):
        return cls(seeds=2) if profile == "tiny" else cls()


class Model:
    def __init__(self, width):
        self.width = width

    def peak(self, seed):
        return seed {peak_op} self.width


def run(config, seed, progress):
    return {{"x": [_measure(s) for s in range(config.seeds)]}}


def _measure(seed):
    return Model({width}).peak(seed)


def judge(measured):
    """{doc}"""
    return _over(statistics.median(measured["x"]))  # {comment}


def _over(value):
    return value {op} LIMIT


def plot(measured, outdir):
    return [str(LIMIT + {unused})]
'''


FIELDS = {"limit": 2.0, "doc": "the rule", "comment": "why", "unused": 0, "op": ">", "seeds": 3, "width": 4, "peak_op": "*"}


def test_fingerprint_follows_the_rule_and_ignores_comments_and_what_neither_run_nor_judge_reaches(tmp_path):
    def fingerprint(i, **changes):
        return rule_fingerprint(_load(tmp_path, f"rule_fp_{i}", RULE.format(**{**FIELDS, **changes})))

    base = fingerprint(0)
    assert fingerprint(1, doc="reworded", comment="reworded") == base
    assert fingerprint(2, unused=1) == base  # plot is not part of the rule
    assert fingerprint(3, limit=2.5) != base  # a constant the helper reads
    assert fingerprint(4, op=">=") != base  # the code of a helper judge calls


def test_fingerprint_follows_what_is_measured(tmp_path):
    """A change to the measurement needs a new version as a change to the rule does: a profile's
    seed count (a Config default), an argument a helper of run passes, the method of a class the
    measurement uses."""
    def fingerprint(i, **changes):
        return rule_fingerprint(_load(tmp_path, f"measure_fp_{i}", RULE.format(**{**FIELDS, **changes})))

    base = fingerprint(0)
    assert fingerprint(1, seeds=2) != base  # default seeds cut from 3 to 2
    assert fingerprint(2, width=5) != base  # what run's helper passes
    assert fingerprint(3, peak_op="+") != base  # the code of a method the measurement calls


def test_a_rule_whose_code_matches_no_version_is_recorded_as_unversioned(tmp_path):
    module = _load(tmp_path, "rule_fp_unversioned", RULE.format(**{**FIELDS, "limit": 1}))
    claim = registry.Claim(
        id="x", statement="", sources=(), method="", rule="", rule_history=(RuleVersion(1, "2026-01-01", "first", "0" * 16),)
    )
    assert runner.rule_fields(claim, module) == {"rule_version": None, "rule_fingerprint": rule_fingerprint(module)}
