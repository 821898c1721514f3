"""The Ray executor: the same results as the local one, failures as inconclusive, one cache for both.

One local Ray instance (2 CPUs, no dashboard) serves the whole module; the report's Ray executor
uses it as it is and leaves it running. Without Ray, only the tests that need no Ray run. Fake
experiments live in a package written to a temporary folder, put on PYTHONPATH before Ray starts
so that its workers import it too.
"""

import io
import logging
import os
import sys
import textwrap
import uuid

import pytest
import torch
from rich.console import Console

from attnscale import cli
from attnscale.lab import cache, executors, runner

FAKE = '''
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.figure import Figure

from attnscale.lab.base import Claim, Judgement, Verdict, save_figure

COUNTER = Path(r"{counter}")
CLAIM = Claim(id="{id}", statement="{id} holds", sources=("a test",), method="draw", rule="holds if n > 0")


@dataclass(frozen=True)
class Config:
    size: int = 4

    @classmethod
    def for_profile(cls, profile):
        return cls()


def run(config, seed, progress):
    with open(COUNTER, "a") as f:
        f.write("{id}\\n")
{body}
    for i in range(config.size):
        progress(i + 1, config.size)
    draws = torch.randn(config.size, generator=torch.Generator().manual_seed(seed))
    return {{"n": config.size + seed, "draws": draws.tolist(), "threads": torch.get_num_threads()}}


def judge(measured):
    return Judgement(Verdict.HOLDS if measured["n"] > 0 else Verdict.DOES_NOT_HOLD, f"n = {{measured['n']}}")


def plot(measured, outdir):
    fig = Figure(figsize=(2, 2))
    fig.add_subplot().plot(measured["draws"])
    return [save_figure(fig, outdir, "draws")]
'''

BODIES = {
    "a_ok": ("fake-ok", ""),
    "b_raises": ("fake-raises", 'raise RuntimeError("measurement exploded")'),
    "c_dies": ("fake-dies", "os._exit(3)"),
}


@pytest.fixture(scope="module")
def fake_lab(tmp_path_factory):
    """A fake experiments package on this process's sys.path and on PYTHONPATH; (package name, counter file)."""
    root = tmp_path_factory.mktemp("fakelab")
    name = f"fakelab_{uuid.uuid4().hex[:8]}"
    pkg = root / "src" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    counter = root / "counter.txt"
    for module, (claim_id, body) in BODIES.items():
        (pkg / f"{module}.py").write_text(FAKE.format(id=claim_id, counter=counter, body=textwrap.indent(body, "    ")))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root / "src"))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
        # The library's sources may change while the tests run; the fake experiments do not depend on them.
        mp.setattr(cache, "library_source_hash", lambda: "fixed")
        yield name, counter


@pytest.fixture(scope="module")
def ray_instance(fake_lab):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'attnscale[ray]')")
    # Ray's processes talk over loopback only: the node advertises 127.0.0.1, not the host's address.
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


def _quiet():
    return Console(file=io.StringIO(), width=120)


def _ran(counter):
    return sorted(counter.read_text().split()) if counter.exists() else []


def test_ray_gives_the_local_numbers_for_the_same_seed(ray_instance, tmp_path):
    only = ["softmax-peak-example", "variance-law"]
    local = runner.run_report(tmp_path / "local", profile="tiny", seed=3, only=only, jobs=2, console=_quiet())
    remote = runner.run_report(
        tmp_path / "ray", profile="tiny", seed=3, only=only, jobs=2, console=_quiet(), executor="ray"
    )
    assert [c["id"] for c in remote["claims"]] == ["variance-law", "softmax-peak-example"]  # claims order
    assert remote["environment"]["executor"] == "ray" and local["environment"]["executor"] == "local"
    for a, b in zip(local["claims"], remote["claims"], strict=True):
        assert b["error"] is None, b["error"]
        assert (b["measured"], b["verdict"], b["headline"], b["figures"]) == (
            a["measured"],
            a["verdict"],
            a["headline"],
            a["figures"],
        )
        for fig in b["figures"]:
            assert (tmp_path / "ray" / fig["svg"]).is_file() and (tmp_path / "ray" / fig["png"]).is_file()


def test_failures_inside_ray_tasks_become_inconclusive(ray_instance, fake_lab, tmp_path):
    name, counter = fake_lab
    out = tmp_path / "out"
    results = runner.run_report(out, profile="tiny", seed=1, jobs=2, console=_quiet(), package=name, executor="ray")
    by_id = {c["id"]: c for c in results["claims"]}
    assert by_id["fake-ok"]["verdict"] == "holds"
    assert by_id["fake-ok"]["measured"]["n"] == 5
    assert by_id["fake-ok"]["measured"]["threads"] == 1
    assert (out / "figures" / "fake-ok" / "draws.png").is_file()
    assert by_id["fake-raises"]["verdict"] == "inconclusive"
    assert "run: RuntimeError: measurement exploded" in by_id["fake-raises"]["reason"]
    assert by_id["fake-dies"]["verdict"] == "inconclusive"
    assert "Ray task running the experiment failed" in by_id["fake-dies"]["reason"]
    assert [p.name.rsplit("-", 1)[0] for p in (out / "cache").glob("*.json")] == ["fake-ok"]


def test_either_executor_resumes_from_the_others_cache(ray_instance, fake_lab, tmp_path):
    name, counter = fake_lab
    before = _ran(counter)
    kwargs = {"profile": "tiny", "seed": 2, "only": ["fake-ok"], "jobs": 1, "console": _quiet(), "package": name}

    first = runner.run_report(tmp_path / "a", executor="ray", **kwargs)
    second = runner.run_report(tmp_path / "a", executor="local", **kwargs)
    assert second["claims"][0]["cached"] and second["claims"][0]["measured"] == first["claims"][0]["measured"]

    first = runner.run_report(tmp_path / "b", executor="local", **kwargs)
    second = runner.run_report(tmp_path / "b", executor="ray", **kwargs)
    assert second["claims"][0]["cached"] and second["claims"][0]["measured"] == first["claims"][0]["measured"]
    assert _ran(counter) == sorted([*before, "fake-ok", "fake-ok"])  # each computed once, then reused


def test_a_ray_task_streams_start_progress_and_result(fake_lab, tmp_path):
    name, _ = fake_lab
    figdir, cache_file = str(tmp_path / "f"), str(tmp_path / "c")
    task = runner.Task(f"{name}.a_ok", "fake-ok", "tiny", 0, figdir, "figures/fake-ok", cache_file)
    threads = torch.get_num_threads()
    try:
        messages = list(executors._run_in_worker(task))  # the task's body, here without Ray
    finally:
        torch.set_num_threads(threads)
    assert messages[0] == ("started", None)
    assert ("progress", (4, 4)) in messages[1:-1]
    kind, (record, figures) = messages[-1]
    assert kind == "done" and record["verdict"] == "holds" and record["measured"]["threads"] == 1
    assert sorted(figures) == ["draws.png", "draws.svg"] and figures["draws.svg"].startswith(b"<?xml")
    assert not (tmp_path / "c").exists() and not (tmp_path / "f").exists()  # the driver writes those


def test_executor_options_are_checked_before_anything_runs(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="executor must be one of local, ray, got 'dask'"):
        runner.run_report(tmp_path, executor="dask", console=_quiet())
    with pytest.raises(ValueError, match="use it with executor 'ray'"):
        runner.run_report(tmp_path, address="auto", console=_quiet())
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ValueError, match=r"pip install 'attnscale\[ray\]'"):
        executors.validate("ray", None)
    with pytest.raises(SystemExit, match=r"attnscale report: executor 'ray' needs Ray.*attnscale\[ray\]"):
        cli.main(["report", "--out", str(tmp_path), "--executor", "ray"])
    assert not any(tmp_path.iterdir())
