"""The runner: discovery, parallel runs, failures as inconclusive, the cache, and resuming after a crash.

These tests run small fake experiment packages written into tmp_path, so they do not depend on how
long the real experiments take.
"""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from attnscale.lab import cache, registry, runner, schema
from attnscale.lab.base import Verdict, no_progress

HEADER = '''
import os
import time
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from attnscale.lab.base import Claim, Judgement, Verdict, save_figure


@dataclass(frozen=True)
class Config:
    size: int = 3

    @classmethod
    def for_profile(cls, profile):
        return cls(size={{"tiny": 2}}.get(profile, 3))


COUNTER = Path(r"{root}") / "counter.txt"
SLOW_FLAG = Path(r"{root}") / "slow"
HEADLINE = "n"

CLAIM = Claim(id="{id}", statement="{id} holds", sources=("a test",), method="count", rule="holds if n > 0")


def judge(measured):
    return Judgement(Verdict.HOLDS if measured["n"] > 0 else Verdict.DOES_NOT_HOLD, f"n = {{measured['n']}}")


def plot(measured, outdir):
    fig = Figure(figsize=(2, 2))
    fig.add_subplot().plot([0, measured["n"]])
    return [save_figure(fig, outdir, "line")]
'''

RUN_OK = '''
def run(config, seed, progress):
    with open(COUNTER, "a") as f:
        f.write("{id}\\n")
    for i in range(config.size):
        progress(i + 1, config.size)
    return {{"n": config.size + seed, "nan": float("nan"), "table": {{"a": {{"x": 1.0}}, "b": {{"x": 2.0}}}}}}
'''

RUN_SLOW = '''
def run(config, seed, progress):
    with open(COUNTER, "a") as f:
        f.write("{id}\\n")
    if SLOW_FLAG.exists():
        time.sleep(120)
    return {{"n": 1}}
'''

RUN_RAISES = '''
def run(config, seed, progress):
    raise RuntimeError("measurement exploded")
'''

RUN_DIES = '''
def run(config, seed, progress):
    os._exit(3)
'''

RUN_FOREVER = '''
def run(config, seed, progress):
    (COUNTER.parent / "{id}.pid").write_text(str(os.getpid()))
    while True:  # until its process is killed
        time.sleep(1)
'''

PLOT_RAISES = '''
def plot(measured, outdir):
    raise ValueError("no figure today")
'''


def _module(root, claim_id, *bodies):
    # Paths are written into the source: worker processes do not see environment changes made by a test.
    return HEADER.format(id=claim_id, root=root) + "".join(b.format(id=claim_id) for b in bodies)


@pytest.fixture
def fake_lab(tmp_path, monkeypatch):
    """Write a fake experiments package; return (package name, counter file, root)."""
    name = f"fakelab_{uuid.uuid4().hex[:8]}"
    pkg = tmp_path / "src" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a_ok.py").write_text(_module(tmp_path, "fake-a-ok", RUN_OK))
    (pkg / "b_slow.py").write_text(_module(tmp_path, "fake-b-slow", RUN_SLOW))
    (pkg / "c_raises.py").write_text(_module(tmp_path, "fake-c-raises", RUN_RAISES))
    (pkg / "d_bad_plot.py").write_text(_module(tmp_path, "fake-d-bad-plot", RUN_OK, PLOT_RAISES))
    (pkg / "e_broken_import.py").write_text("import not_a_module_anywhere\n")
    (pkg / "_helpers.py").write_text("VALUE = 1\n")
    (pkg / "helper_without_claim.py").write_text("VALUE = 2\n")
    counter = tmp_path / "counter.txt"
    counter.touch()
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "src"), os.environ.get("PYTHONPATH", "")]))
    # The library's sources may change while the tests run; the fake experiments do not depend on them.
    monkeypatch.setattr(cache, "library_source_hash", lambda: "fixed")
    return name, counter, tmp_path


def _quiet():
    return Console(file=io.StringIO(), width=120)


def test_discover_orders_by_claims_and_skips_helpers(fake_lab):
    name, _, root = fake_lab
    (root / "src" / name / "f_duplicate.py").write_text(_module(root, "fake-a-ok", RUN_OK))
    found = registry.discover(name)
    assert [e.id for e in found.experiments] == ["fake-a-ok", "fake-b-slow", "fake-c-raises", "fake-d-bad-plot"]
    assert found.experiments[0].module_name == f"{name}.a_ok"
    assert [m for m, _ in found.broken] == [f"{name}.e_broken_import", f"{name}.f_duplicate"]
    assert "ModuleNotFoundError" in found.broken[0][1]
    assert f"already measured by {name}.a_ok" in found.broken[1][1]


def test_real_experiments_follow_claims_order():
    ids = [e.id for e in registry.discover().experiments]
    known = [i for i in ids if i in registry.CLAIM_IDS]
    assert known == sorted(known, key=registry.CLAIM_IDS.index)
    assert {"variance-law", "saturation-example", "softmax-peak-example"} <= set(ids)


def test_select_rejects_unknown_ids(fake_lab):
    found = registry.discover(fake_lab[0])
    with pytest.raises(ValueError, match="no-such-claim"):
        runner.select(found, ["no-such-claim"])
    with pytest.raises(ValueError, match="no experiment yet for training-stall"):
        runner.select(found, ["training-stall"])
    assert [e.id for e in runner.select(found, ["fake-c-raises"])] == ["fake-c-raises"]


def test_run_single_explains_a_claim_it_cannot_run(fake_lab):
    name = fake_lab[0]
    with pytest.raises(ValueError, match=r"claim_id: .*'fake-a-okk'.*did you mean 'fake-a-ok'"):
        runner.run_single("fake-a-okk", profile="tiny", console=_quiet(), package=name)
    with pytest.raises(ValueError, match="claim_id: .*no experiment yet for variance-law"):
        runner.run_single("variance-law", profile="tiny", console=_quiet(), package=name)
    with pytest.raises(ValueError, match=f"claim_id: .*{name}.e_broken_import failed to import: ModuleNotFoundError"):
        runner.run_single("e-broken-import", profile="tiny", console=_quiet(), package=name)


def test_execute_turns_errors_into_inconclusive(fake_lab, tmp_path):
    name, _, _ = fake_lab
    task = runner.Task(f"{name}.c_raises", "fake-c-raises", "tiny", 0, str(tmp_path / "f"), "f", None)
    record = runner.execute(task, no_progress)
    assert record["verdict"] == Verdict.INCONCLUSIVE
    assert "run: RuntimeError: measurement exploded" in record["reason"]
    assert "Traceback" in record["error"]
    assert schema.validate(record, schema.SCHEMA["properties"]["claims"]["items"]) == []

    task = runner.Task(f"{name}.d_bad_plot", "fake-d-bad-plot", "tiny", 0, str(tmp_path / "f"), "f", None)
    record = runner.execute(task, no_progress)
    assert record["verdict"] == Verdict.HOLDS  # the measurement stands; only its figures failed
    assert "figures failed: ValueError: no figure today" in record["reason"]
    assert record["figures"] == [] and record["error"]


def test_report_survives_failures_and_caches_successes(fake_lab):
    name, counter, root = fake_lab
    out = root / "out"
    results = runner.run_report(out, profile="tiny", seed=1, jobs=2, console=_quiet(), package=name)
    assert schema.validate(results) == []
    by_id = {c["id"]: c for c in results["claims"]}
    assert list(by_id) == ["e-broken-import", "fake-a-ok", "fake-b-slow", "fake-c-raises", "fake-d-bad-plot"]
    assert by_id["fake-a-ok"]["verdict"] == "holds"
    assert by_id["fake-a-ok"]["measured"]["n"] == 3  # size 2 at tiny, plus seed 1
    assert by_id["fake-a-ok"]["measured"]["nan"] == "NaN"
    assert by_id["fake-a-ok"]["headline"] == {"key": "n", "value": 3, "label": "n", "unit": ""}
    assert by_id["fake-a-ok"]["figures"][0]["svg"] == "figures/fake-a-ok/line.svg"
    assert by_id["fake-c-raises"]["verdict"] == "inconclusive"
    assert "measurement exploded" in by_id["fake-c-raises"]["reason"]
    assert by_id["e-broken-import"]["verdict"] == "inconclusive"
    assert "failed to import" in by_id["e-broken-import"]["reason"]
    assert {c["id"] for c in results["not_measured"]} == set(registry.CLAIM_IDS)
    for fname in ("index.html", "report.md", "results.json"):
        assert (out / fname).is_file()
    assert json.loads((out / "results.json").read_text()) == results
    cached = sorted(p.name.rsplit("-", 1)[0] for p in (out / "cache").glob("*.json"))
    assert cached == ["fake-a-ok", "fake-b-slow"]  # failures are not cached: the next run retries them
    assert sorted(counter.read_text().split()) == ["fake-a-ok", "fake-b-slow", "fake-d-bad-plot"]

    again = runner.run_report(out, profile="tiny", seed=1, jobs=2, console=_quiet(), package=name)
    assert {c["id"] for c in again["claims"] if c["cached"]} == {"fake-a-ok", "fake-b-slow"}
    assert sorted(counter.read_text().split()) == ["fake-a-ok", "fake-b-slow", "fake-d-bad-plot", "fake-d-bad-plot"]

    (out / "figures" / "fake-a-ok" / "line.svg").unlink()  # a cached entry whose figure is gone is recomputed
    runner.run_report(out, profile="tiny", seed=1, jobs=1, only=["fake-a-ok"], console=_quiet(), package=name, replace=True)
    assert counter.read_text().split().count("fake-a-ok") == 2
    assert (out / "figures" / "fake-a-ok" / "line.svg").is_file()


def test_report_checks_the_output_folder_before_running(fake_lab):
    name, counter, root = fake_lab
    taken = root / "taken"
    taken.write_text("x")
    with pytest.raises(ValueError, match="outdir: expected a folder .* exists and is not a folder"):
        runner.run_report(taken, profile="tiny", jobs=1, console=_quiet(), package=name)
    with pytest.raises(ValueError, match="outdir: expected a folder .* inside the file"):
        runner.run_report(taken / "out", profile="tiny", jobs=1, console=_quiet(), package=name)
    assert counter.read_text() == ""  # no experiment started


def test_a_dying_process_loses_only_its_own_experiment(fake_lab):
    name, counter, root = fake_lab
    (root / "src" / name / "g_dies.py").write_text(_module(root, "fake-g-dies", RUN_DIES))
    only = ["fake-g-dies", "fake-a-ok"]
    results = runner.run_report(root / "out", profile="tiny", jobs=2, only=only, console=_quiet(), package=name)
    by_id = {c["id"]: c for c in results["claims"]}
    assert by_id["fake-a-ok"]["verdict"] == "holds"
    assert by_id["fake-g-dies"]["verdict"] == "inconclusive"
    assert "exit code 3" in by_id["fake-g-dies"]["reason"]


def test_cache_key_tracks_what_decides_the_measurement():
    base = dict(config={"n": 1}, seed=0, version="1", module_source=b"x", library_hash="h")
    key = cache.cache_key(**base)
    assert cache.cache_key(**base) == key
    for change in ({"config": {"n": 2}}, {"seed": 1}, {"version": "2"}, {"module_source": b"y"}, {"library_hash": "g"}):
        assert cache.cache_key(**{**base, **change}) != key, change


def test_cache_ignores_unreadable_entries(tmp_path):
    path = tmp_path / "cache" / "x-1.json"
    path.parent.mkdir()
    path.write_text("{ truncated")
    assert cache.read(path, "x") == (None, "is not JSON")
    path.write_text('{"id": "x"}')
    assert cache.read(path, "x") == (None, "is not a cache entry")


def test_resume_after_a_crash_recomputes_nothing_finished(fake_lab):
    name, counter, root = fake_lab
    out = root / "out"
    script = textwrap.dedent(
        f"""
        from attnscale.lab import cache
        from attnscale.lab.runner import run_report
        cache.library_source_hash = lambda: "fixed"
        run_report({str(out)!r}, profile="tiny", jobs=1, package={name!r}, only=["fake-a-ok", "fake-b-slow"])
        """
    )
    (root / "slow").touch()
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not list((out / "cache").glob("fake-a-ok-*.json")):
            assert proc.poll() is None, "the report ended before it could be interrupted"
            assert time.monotonic() < deadline, "the first experiment was never cached"
            time.sleep(0.1)
        while "fake-b-slow" not in counter.read_text():  # the slow one has started: crash in the middle of it
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole report: main process, workers, forkserver
        proc.wait()
    assert not (out / "results.json").exists()
    (root / "slow").unlink()
    entry = next((out / "cache").glob("fake-a-ok-*.json"))
    mtime = entry.stat().st_mtime_ns

    results = runner.run_report(out, profile="tiny", jobs=1, only=["fake-a-ok", "fake-b-slow"], console=_quiet(), package=name)
    by_id = {c["id"]: c for c in results["claims"]}
    assert by_id["fake-a-ok"]["cached"] and not by_id["fake-b-slow"]["cached"]
    assert by_id["fake-b-slow"]["verdict"] == "holds"
    assert counter.read_text().split() == ["fake-a-ok", "fake-b-slow", "fake-b-slow"]
    assert entry.stat().st_mtime_ns == mtime


def test_a_cache_entry_copied_over_another_claims_is_recomputed_and_said(fake_lab):
    """Copying one claim's cache file over another's made the report list one claim twice and the
    other not at all (exit 0). An entry is used only as the record of the claim and key it is read for."""
    name, counter, root = fake_lab
    out, only = root / "out", ["fake-a-ok", "fake-d-other"]
    (root / "src" / name / "d_other.py").write_text(_module(root, "fake-d-other", RUN_OK))
    runner.run_report(out, profile="tiny", jobs=1, only=only, console=_quiet(), package=name)
    entries = {p.name.rsplit("-", 1)[0]: p for p in (out / "cache").glob("*.json")}
    entries["fake-d-other"].write_bytes(entries["fake-a-ok"].read_bytes())
    console = _quiet()
    results = runner.run_report(out, profile="tiny", jobs=1, only=only, console=console, package=name, replace=True)
    assert [c["id"] for c in results["claims"]] == only
    assert [c["cached"] for c in results["claims"]] == [True, False]
    said = " ".join(console.file.getvalue().split())
    assert f"fake-d-other: the cache entry {entries['fake-d-other'].name} holds 'fake-a-ok' under key" in said and "recomputed" in said
    # the same claim's entry of another key (profile, seed or rule): recomputed too
    other = entries["fake-a-ok"].with_name("fake-a-ok-" + "0" * 16 + ".json")
    other.write_bytes(entries["fake-a-ok"].read_bytes())
    assert cache.read(other, "fake-a-ok")[0] is None and "under key" in cache.read(other, "fake-a-ok")[1]


def _descendants(pid):
    """The pids of every process below ``pid``, from the parent pids in /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process ended while being read
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _running(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended: only its exit status is left to collect


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the worker processes in /proc")
def test_workers_end_when_the_report_is_killed(fake_lab):
    name, counter, root = fake_lab
    (root / "src" / name / "h_forever.py").write_text(_module(root, "fake-h-forever", RUN_FOREVER))
    (root / "slow").touch()
    script = textwrap.dedent(
        f"""
        from attnscale.lab import cache
        from attnscale.lab.runner import run_report
        cache.library_source_hash = lambda: "fixed"
        run_report({str(root / "out")!r}, profile="tiny", jobs=2, package={name!r}, only=["fake-h-forever", "fake-b-slow"])
        """
    )
    pid_file = root / "fake-h-forever.pid"
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) or "fake-b-slow" not in counter.read_text():
            assert proc.poll() is None, "the report ended before it could be killed"
            assert time.monotonic() < deadline, "the experiments never started"
            time.sleep(0.1)
        below = _descendants(proc.pid)
        assert int(pid_file.read_text()) in below
        os.kill(proc.pid, signal.SIGKILL)  # the report alone, not its process group
        proc.wait()
        deadline = time.monotonic() + 5
        while any(_running(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in below if _running(p)] == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the test left behind


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process semantics")
def test_without_pidfds_the_watchdog_polls_the_report_process():
    report = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    script = (
        f"import os\ndel os.pidfd_open\nfrom attnscale.lab import runner\nprint('watching', flush=True)\n"
        f"runner._watch({report.pid}, os.getppid())"
    )
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "watching\n"
        time.sleep(1.0)
        assert worker.poll() is None  # it waits while the report runs
        report.kill()
        report.wait()
        assert worker.wait(timeout=10) == 1
    finally:
        for proc in (report, worker):
            proc.kill()
            proc.wait()
        worker.stdout.close()


def test_summary_table_lists_every_claim(fake_lab):
    results = runner.run_report(
        fake_lab[2] / "out", profile="tiny", jobs=1, only=["fake-c-raises"], console=_quiet(), package=fake_lab[0]
    )
    console = _quiet()
    console.print(runner.summary_table(results))
    text = console.file.getvalue()
    assert "fake-c-raises" in text and "inconclusive" in text


def test_last_seconds_reads_the_newest_entry_of_that_claim_only(tmp_path):
    record = {
        "id": "x", "statement": "", "sources": [], "method": "", "rule": "", "rule_history": [], "rule_version": None,
        "rule_fingerprint": "", "verdict": "holds", "reason": "", "arms": [], "headline": None, "measured": {}, "figures": [], "config": {}, "seconds": 7.5, "cpu_seconds": 7.0, "cached": False, "error": None,
    }
    cache.store(cache.cache_path(tmp_path, "x", "0" * 16), record)
    cache.store(cache.cache_path(tmp_path, "x-longer", "1" * 16), {**record, "id": "x-longer", "seconds": 99.0})
    assert cache.last_seconds(tmp_path, "x") == 7.5
    assert cache.last_seconds(tmp_path, "y") is None
    assert not list((tmp_path / "cache").glob("*.tmp"))


RUN_PARTS = '''
def parts(config):
    return ["x", "yy", "zzz"][: config.size + 1]


def run_part(config, seed, part, progress):
    if part == "yy" and (COUNTER.parent / "break-yy").exists():
        raise RuntimeError("part exploded")
    progress(1, 1)
    return {{"v": len(part) + seed, "pid": os.getpid()}}


def combine(config, seed, results):
    return {{"n": sum(r["v"] for r in results.values()), "pids": [r["pid"] for r in results.values()], "order": list(results)}}


def run(config, seed, progress):
    return combine(config, seed, {{p: run_part(config, seed, p, progress) for p in parts(config)}})
'''


def test_an_experiment_with_parts_runs_them_side_by_side_and_combines_them(fake_lab):
    name, _, root = fake_lab
    (root / "src" / name / "f_parts.py").write_text(_module(root, "fake-f-parts", RUN_PARTS))
    out = root / "out"
    rec = runner.run_report(out, profile="tiny", seed=2, jobs=2, only=["fake-f-parts"], console=_quiet(), package=name)["claims"][0]
    assert rec["verdict"] == "holds" and rec["error"] is None
    alone = runner.run_single("fake-f-parts", profile="tiny", seed=2, console=_quiet(), package=name)
    assert rec["measured"]["n"] == alone["measured"]["n"] == 1 + 2 + 3 + 3 * 2
    assert rec["measured"]["order"] == ["x", "yy", "zzz"], "combine sees the parts in parts() order"
    assert len(set(rec["measured"]["pids"])) == 3, "each part in its own worker process"
    assert [p["name"] for p in rec["parts"]] == ["x", "yy", "zzz"]
    assert rec["seconds"] >= sum(p["seconds"] for p in rec["parts"])
    assert rec["figures"] and schema.validate(json.loads((out / "results.json").read_text())) == []
    again = runner.run_report(out, profile="tiny", seed=2, jobs=2, only=["fake-f-parts"], console=_quiet(), package=name)["claims"][0]
    assert again["cached"] and again["measured"] == rec["measured"]
    assert cache.last_seconds(out, "fake-f-parts", "yy") == rec["parts"][1]["seconds"]
    assert cache.last_seconds(out, "fake-f-parts", "nope") is None


def test_a_failing_part_makes_the_claim_inconclusive_and_is_retried(fake_lab):
    name, _, root = fake_lab
    (root / "src" / name / "f_parts.py").write_text(_module(root, "fake-f-parts", RUN_PARTS))
    (root / "break-yy").touch()
    out = root / "out"
    rec = runner.run_report(out, profile="tiny", jobs=2, only=["fake-f-parts"], console=_quiet(), package=name)["claims"][0]
    assert rec["verdict"] == "inconclusive"
    assert "part 'yy'" in rec["reason"] and "RuntimeError: part exploded" in rec["reason"]
    assert "Traceback" in rec["error"]
    (root / "break-yy").unlink()
    rec = runner.run_report(out, profile="tiny", jobs=2, only=["fake-f-parts"], console=_quiet(), package=name)["claims"][0]
    assert rec["verdict"] == "holds" and not rec["cached"]


@pytest.mark.parametrize("seed", [-1, 2**32, 10**20, 1.0, True], ids=str)
def test_run_report_refuses_a_seed_outside_0_to_2_to_the_32_before_any_work(tmp_path, seed):
    with pytest.raises(ValueError, match="seed: expected an integer from 0 to 2\\*\\*32 - 1"):
        runner.run_report(tmp_path / "out", profile="tiny", seed=seed, console=_quiet())
    assert not (tmp_path / "out").exists()
