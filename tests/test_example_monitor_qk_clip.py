"""examples/monitor_qk_clip.py, shortened: both runs are recorded, QK-Clip clips, the files are written."""

import importlib.util
import json
from pathlib import Path

from attnscale.diagnostics.monitor import read_run


def test_example_runs_and_writes_its_outputs(tmp_path, capsys):
    path = Path(__file__).parents[1] / "examples" / "monitor_qk_clip.py"
    spec = importlib.util.spec_from_file_location("monitor_qk_clip", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "25", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["qk-clip"]["clipped_heads"] > 0 and summary["plain"]["clipped_heads"] == 0
    assert summary["plain"]["alerts"]  # the logits pass 60 within 25 steps at lr 0.05
    assert [r.step for r in read_run(tmp_path / "plain.jsonl")] == [0, 5, 10, 15, 20]
    assert len(read_run(tmp_path / "qk-clip.jsonl")) == 25
    assert (tmp_path / "monitor_qk_clip.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads(capsys.readouterr().out) == summary
