"""Paper cuts of running the lab: `attnscale run` runs as the report's workers do (one torch thread),
and a report of another profile, seed or set of claims never silently replaces the one in its folder."""

import io
import json
import uuid

import pytest
import torch
from rich.console import Console

from attnscale.lab import cache, runner

MODULE = '''
from dataclasses import dataclass

import torch

from attnscale.lab.base import Claim, Judgement, Verdict


@dataclass(frozen=True)
class Config:
    size: int = 1

    @classmethod
    def for_profile(cls, profile):
        return cls()


CLAIM = Claim(id="{id}", statement="s", sources=("a test",), method="m", rule="holds")


def run(config, seed, progress):
    return {{"threads": torch.get_num_threads()}}


def judge(measured):
    return Judgement(Verdict.HOLDS, "fine")


def plot(measured, outdir):
    return []
'''


@pytest.fixture
def lab(tmp_path, monkeypatch):
    name = f"foldlab_{uuid.uuid4().hex[:8]}"
    pkg = tmp_path / "src" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for cid in ("fold-a", "fold-b"):
        (pkg / f"{cid.replace('-', '_')}.py").write_text(MODULE.format(id=cid))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "src"))
    monkeypatch.setattr(cache, "library_source_hash", lambda: "fixed")
    return name


def _quiet():
    return Console(file=io.StringIO(), width=120)


def test_run_single_uses_one_torch_thread_like_the_report_and_restores_the_count(lab):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        record = runner.run_single("fold-a", profile="tiny", console=_quiet(), package=lab)
        assert record["measured"]["threads"] == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_report_of_another_profile_or_subset_does_not_replace_the_one_in_the_folder(lab, tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    claims = [{"id": "fold-a"}, {"id": "fold-b"}]
    first = json.dumps({"profile": "tiny", "seed": 0, "claims": claims})
    (out / "results.json").write_text(first)
    for kwargs, shown in (({"only": ["fold-a"]}, "fold-a, fold-b"), ({"profile": "quick"}, "profile tiny"), ({"seed": 1}, "seed 0")):
        with pytest.raises(ValueError, match=r"^outdir: expected a folder without a report") as err:
            runner.run_report(out, **{"profile": "tiny", "jobs": 1, "console": _quiet(), "package": lab, **kwargs})
        assert shown in str(err.value) and "replace=True to overwrite" in str(err.value)  # the Python name; the CLI says --replace
        assert (out / "results.json").read_text() == first
    runner.check_replaces(out, "tiny", 0, ["fold-b", "fold-a"])  # the same run again (resumed) is fine
    runner.run_report(out, profile="tiny", only=["fold-a"], jobs=1, console=_quiet(), package=lab, replace=True)
    assert [c["id"] for c in json.loads((out / "results.json").read_text())["claims"]] == ["fold-a"]


def test_the_cli_writes_other_profiles_and_subsets_beside_the_default_report():
    assert runner.default_outdir("default", None) == "attnscale-report"
    assert runner.default_outdir("quick", None) == "attnscale-report-quick"
    assert runner.default_outdir("default", ["variance-law"]) == "attnscale-report-default-only"
