"""`attnscale report`, `list` and `run`, end to end through main(argv)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from attnscale.cli import main
from attnscale.lab import cache, registry, runner, schema

MINE = ["softmax-peak-example", "saturation-example", "variance-law"]
CHROMIUM = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and Path(p).exists()), None)


@pytest.fixture(scope="module", autouse=True)
def stable_library_hash():
    """The library's sources may change while these tests run; caching is tested on the experiments alone."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache, "library_source_hash", lambda: "fixed")
        yield


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    """One tiny report of three experiments, shared by the tests that inspect it."""
    out = tmp_path_factory.mktemp("report")
    assert main(["report", "--out", str(out), "--profile", "tiny", "--jobs", "2", "--only", *MINE]) == 0
    return out


def test_report_writes_every_output(report_dir):
    results = json.loads((report_dir / "results.json").read_text())
    assert schema.validate(results) == []
    assert results["profile"] == "tiny" and results["seed"] == 0
    assert [c["id"] for c in results["claims"]] == ["variance-law", "saturation-example", "softmax-peak-example"]
    for claim in results["claims"]:
        assert claim["error"] is None, claim["error"]
        assert claim["verdict"] in schema.VERDICTS
        assert claim["figures"]
        for fig in claim["figures"]:
            assert (report_dir / fig["svg"]).is_file() and (report_dir / fig["png"]).is_file()
    assert (report_dir / "report.md").read_text().startswith("# attnscale lab report")


def test_every_figure_the_pages_reference_exists(report_dir):
    html = (report_dir / "index.html").read_text()
    images = re.findall(r'<img src="([^"]+)"', html) + re.findall(r'<a href="([^"#][^"]*)"', html)
    assert len(images) >= 6
    for src in images:
        assert (report_dir / src).is_file(), src
    markdown = (report_dir / "report.md").read_text()
    for src in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown):
        assert (report_dir / src).is_file(), src


def test_second_run_takes_everything_from_the_cache(report_dir, capsys):
    capsys.readouterr()
    assert main(["report", "--out", str(report_dir), "--profile", "tiny", "--jobs", "2", "--only", *MINE]) == 0
    results = json.loads((report_dir / "results.json").read_text())
    assert all(c["cached"] for c in results["claims"])
    out = capsys.readouterr().out
    assert "cached" in out and "softmax-peak-example" in out

    argv = ["report", "--out", str(report_dir), "--profile", "tiny", "--jobs", "1", "--force", "--replace", "--only", MINE[0]]
    assert main(argv) == 0
    results = json.loads((report_dir / "results.json").read_text())
    assert [(c["id"], c["cached"]) for c in results["claims"]] == [(MINE[0], False)]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium at /usr/bin/chromium or on PATH: the page is not rendered")
def test_page_renders_in_a_browser_without_missing_images(report_dir, tmp_path):
    # A copy of the page, next to the original so relative paths resolve, that lists each image's size once loaded.
    probe = report_dir / "probe.html"
    html = (report_dir / "index.html").read_text()
    script = (
        "<script>window.addEventListener('load', () => { document.body.setAttribute('data-images', "
        "JSON.stringify([...document.images].map(i => [i.getAttribute('src'), i.naturalWidth]))); });</script>"
    )
    probe.write_text(html.replace("</body>", script + "</body>"))
    try:
        dom = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--allow-file-access-from-files", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
    finally:
        probe.unlink()
    found = re.search(r"data-images=\"([^\"]*)\"", dom)
    assert found, dom[:500]
    images = json.loads(found.group(1).replace("&quot;", '"'))
    assert images and all(width > 0 for _, width in images), images


def test_list_names_every_claim_and_its_experiment(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for claim_id in registry.CLAIM_IDS:
        assert claim_id in out
    assert "variance_law" in out


def test_run_prints_measurements_and_verdict(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("the user's own file")
    assert main(["run", "softmax-peak-example", "--profile", "tiny", "--figures", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "holds" in out and "peak_prob" in out and "0.99995" in out
    assert (tmp_path / "softmax_peak.svg").is_file()
    assert (tmp_path / "notes.txt").is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "no-such-claim", "--profile", "tiny"], "no-such-claim"),
        (["report", "--only", "no-such-claim", "--profile", "tiny"], "--only: expected claim ids"),
        (["report", "--jobs", "0", "--profile", "tiny"], "jobs must be >= 1"),
    ],
)
def test_bad_arguments_say_what_to_do(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=message) as info:
        main(argv)
    assert info.value.code == 2
    assert not (tmp_path / "attnscale-report").exists()


@pytest.mark.parametrize(
    ("claim", "suggestion"),
    [("saturation-exampel", "did you mean 'saturation-example'"), ("no-such-claim", "attnscale list")],
)
def test_run_with_an_unknown_claim_names_the_argument_and_the_nearest_claim(claim, suggestion):
    with pytest.raises(SystemExit) as info:
        main(["run", claim, "--profile", "tiny"])
    assert info.value.code == 2
    message = str(info.value)
    assert message.startswith("attnscale run: claim_id: expected ") and repr(claim) in message
    assert "attnscale list" in message and suggestion in message
    assert "--only" not in message


def test_report_with_a_misspelt_claim_suggests_the_nearest(tmp_path, capsys, no_experiment_runs):
    with pytest.raises(SystemExit) as info:
        main(["report", "--out", str(tmp_path / "r"), "--profile", "tiny", "--only", "variance-law", "saturation-exampel"])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("attnscale report: error: --only: expected claim ids that have an experiment, got 'saturation-exampel'")
    assert "did you mean 'saturation-example'?" in err
    assert not (tmp_path / "r").exists()


def test_list_json_names_every_claim_with_its_status(capsys):
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "attnscale.claims/1"
    rows = {row["id"]: row for row in data["claims"]}
    assert list(rows)[: len(registry.CLAIM_IDS)] == list(registry.CLAIM_IDS)
    found = registry.discover().by_id()
    for cid, row in rows.items():
        assert row["statement"]
        assert (row["status"] == "experiment") == (cid in found)
        assert row["module"] == (found[cid].module_name if cid in found else row["module"])


def test_list_quiet_prints_only_the_summary(capsys):
    assert main(["list", "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    experiments = len(registry.discover().by_id())
    assert lines == [f"{len(registry.CLAIM_IDS)} claims, {experiments} with an experiment: attnscale run ID runs one, attnscale report all"]


def test_run_json_prints_the_record_alone(capsys):
    assert main(["run", "softmax-peak-example", "--profile", "tiny", "--json"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)  # nothing but the JSON on stdout
    assert record["id"] == "softmax-peak-example" and record["verdict"] in schema.VERDICTS
    assert record["measured"]["peak_prob"] == pytest.approx(0.99995, abs=5e-6)


def test_run_prints_a_one_line_summary_last(capsys):
    assert main(["run", "softmax-peak-example", "--profile", "tiny", "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("softmax-peak-example: holds")


@pytest.fixture
def no_experiment_runs(monkeypatch):
    """Fail the test if the report starts running experiments."""

    def refuse(*args, **kwargs):
        raise AssertionError("experiments ran before the output folder was checked")

    monkeypatch.setattr(runner, "_run_pending", refuse)


def _report_into(out):
    return main(["report", "--out", str(out), "--profile", "tiny", "--jobs", "1", "--only", MINE[0]])


def test_report_into_an_existing_file_fails_before_any_work(tmp_path, capsys, no_experiment_runs):
    taken = tmp_path / "taken"
    taken.write_text("the user's own file")
    for out in (taken, taken / "report"):
        with pytest.raises(SystemExit) as info:
            _report_into(out)
        assert info.value.code == 2  # like argparse's usage errors
        err = " ".join(capsys.readouterr().err.split())
        assert err.startswith("attnscale report: error: --out: expected ") and str(out) in err and "Fix:" in err
    assert taken.read_text() == "the user's own file"


def test_report_into_a_read_only_folder_fails_before_any_work(tmp_path, capsys, no_experiment_runs):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user (root?) can write into a folder without write permission")
        for out in (locked, locked / "report"):
            with pytest.raises(SystemExit) as info:
                _report_into(out)
            assert info.value.code == 2
            err = " ".join(capsys.readouterr().err.split())
            assert err.startswith("attnscale report: error: --out: expected ") and str(out) in err
    finally:
        locked.chmod(0o755)
    assert list(locked.iterdir()) == []


def test_help_explains_the_report(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = capsys.readouterr().out
    for phrase in ("index.html", "cache", "resumes", "inconclusive", "--force", "quick"):
        assert phrase in text


def test_report_into_an_empty_path_fails_before_any_work(tmp_path, monkeypatch, capsys, no_experiment_runs):
    """--out "" (an unset shell variable) wrote into the current folder and printed "report: /index.html"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        _report_into("")
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("attnscale report: error: --out: expected ") and "got an empty path" in err
    assert list(tmp_path.iterdir()) == []


def test_a_report_of_another_run_is_kept_and_the_error_names_the_flags(tmp_path, capsys, no_experiment_runs):
    """Refusing to overwrite another profile's report, the error names --out and --replace (it named
    the Python arguments outdir and replace=True)."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"profile": "default", "seed": 0, "claims": [{"id": "training-stall"}]}))
    with pytest.raises(SystemExit) as info:
        _report_into(out)
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("attnscale report: error: --out: expected a folder without a report") and "Fix: pass another folder, or --replace to overwrite" in err
    assert "outdir" not in err and "replace=True" not in err
