"""Every benchmark figure in README.md and the docs is the rendering of a recorded run: the block
between ``<!-- FILE.json: COMMAND -->`` and ``<!-- end FILE.json -->`` must equal what the
benchmark's ``--markdown FILE.json`` prints, so that a rerun that changes a number changes the text,
and a hand edit of a number fails here."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from attnscale import kernels
from attnscale.kernels import ops

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- (benchmarks/recorded/[\w.]+\.json): python (benchmarks/bench_\w+\.py) --markdown \1 -->\n(.*?)\n<!-- end \1 -->", re.S)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(doc, *m.groups()) for doc in DOCS for m in BLOCK.finditer(doc.read_text())]


def _benchmark(script: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import their sibling machine.py
    try:
        name = Path(script).stem
        spec = importlib.util.spec_from_file_location(name, ROOT / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_recorded_benchmarks_appear_in_the_docs():
    found = {(doc.name, data) for doc, data, _, _ in BLOCKS}
    assert found >= {
        ("compile.md", "benchmarks/recorded/compile.json"),
        ("monitor.md", "benchmarks/recorded/monitor.json"),
        ("performance.md", "benchmarks/recorded/fused.json"),
        ("performance.md", "benchmarks/recorded/fused_amd_epyc_quick.json"),
        ("performance.md", "benchmarks/recorded/fused_amd_epyc_avx512.json"),
        ("performance.md", "benchmarks/recorded/fused_amd_epyc_avx2_code.json"),
        ("performance.md", "benchmarks/recorded/sdpa_memory.json"),
        ("backends.md", "benchmarks/recorded/flex_gpu.json"),
        ("monitor.md", "benchmarks/recorded/monitor_train.json"),
    }


@pytest.mark.parametrize("doc, data, script, text", BLOCKS, ids=[f"{doc.name}:{data}" for doc, data, _, _ in BLOCKS])
def test_each_figure_block_is_the_rendering_of_its_recorded_run(doc, data, script, text):
    recorded = json.loads((ROOT / data).read_text())
    assert "+dirty" not in recorded["commit"] and recorded["commit"] != "unknown", f"{data} was not recorded at a commit"
    assert recorded["cpu"]  # every figure names its CPU
    assert text == _benchmark(script).markdown(recorded), f"{doc.name}: rerun `python {script} --markdown {data}` and paste its output"


def test_a_run_held_to_other_code_is_named_with_the_variables_that_held_it(monkeypatch):
    machine = _benchmark("benchmarks/machine.py")
    for var in machine.HOLDS:
        monkeypatch.delenv(var, raising=False)
    own = machine.cpu_name()
    assert "run with" not in own
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ATTNSCALE_KERNEL_ISA", "avx2")
    assert machine.cpu_name().endswith("run with ATEN_CPU_CAPABILITY=avx2 ATTNSCALE_KERNEL_ISA=avx2)")


def test_bench_fused_times_only_the_cases_asked_for():
    bench = _benchmark("benchmarks/bench_fused.py")
    assert bench.selected(None) == list(bench.CHECKED) == list(bench.TARGETS)
    assert bench.selected(["bf16"]) == [name for name in bench.TARGETS if name.startswith("bf16")]
    assert bench.selected(["decoding", "fp16"]) == ["decoding (L = 1, S = 4 L) with softcap", "fp16 causal + softcap, forward"]
    with pytest.raises(SystemExit):  # a word no case has: an error naming the cases, nothing timed
        bench.main(["--cases", "int8"])
    for other in (["--tanh"], ["--varlen"], ["--blocks"], ["--half-paths"], ["--markdown", "x.json"]):
        with pytest.raises(SystemExit):  # another mode beside --cases: an error, never one of them dropped
            bench.main(["--cases", "bf16", *other])


@pytest.mark.skipif(kernels.build_precondition() is not None, reason="the compiled kernel cannot be had here")
def test_bench_fused_half_paths_time_each_way_the_kernel_takes_16_bit_inputs(monkeypatch, tmp_path):
    """--half-paths toggles ATTNSCALE_HALF_PRODUCTS per call (and restores it): each path is the one
    it is named for, and every row has a ratio per path after each path's output was checked."""
    bench = _benchmark("benchmarks/bench_fused.py")
    monkeypatch.delenv("ATTNSCALE_HALF_PRODUCTS", raising=False)
    # Both paths where this torch has oneMKL's 16-bit products (every x86 build of it), else the tiles alone.
    paths = bench.half_paths()
    assert set(paths) == (set(bench.HALF_PATHS) if kernels.load().half_gemm(1) and kernels.load().half_gemm(2) else {"float32 tiles"})
    for value in paths.values():
        assert bench._under(value, lambda: ops.half_products(torch.bfloat16))() is (value == "1")
    assert "ATTNSCALE_HALF_PRODUCTS" not in os.environ
    out, threads = tmp_path / "half.json", torch.get_num_threads()
    try:
        assert bench.main(["--half-paths", "--lengths", "96", "--dims", "16", "--threads", "1", "--repeats", "1", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())["half_paths"]
    assert [r["case"] for r in rows] == list(bench.HALF_CASES)
    assert all(set(r["ratio"]) == set(paths) and all(x > 0 for x in r["ratio"].values()) for r in rows)


def test_bench_fused_compare_groups_runs_by_commit_and_says_which_cells_moved_apart(capsys):
    """Two runs a side: a cell whose ranges meet is within noise; one whose ranges do not is named
    with the change of its medians; one commit alone, or three, is an error."""
    bench = _benchmark("benchmarks/bench_fused.py")

    def run(commit, causal, decoding):
        rows = [
            {"case": "causal, no features (fused forced)", "L": 2048, "D": 64, "threads": 1, "ratio": causal},
            {"case": "decoding (L = 1, S = 4 L) with softcap", "L": 2048, "D": 64, "threads": 1, "ratio": decoding},
        ]
        return {"commit": commit, "cpu": "a CPU", "rows": rows}

    text = bench.compare([run("old", 0.90, 1.00), run("old", 0.92, 1.02), run("new", 0.91, 1.10), run("new", 0.93, 1.12)])
    assert "| 1t L=2048 D=64 causal, no features (fused forced) | 0.900/0.920 | 0.910/0.930 | overlap |" in text
    assert "| 1t L=2048 D=64 decoding (L = 1, S = 4 L) with softcap | 1.000/1.020 | 1.100/1.120 | slower by 9.9% |" in text
    assert "1 of 2 cells overlap: apart, 1t L=2048 D=64 decoding (L = 1, S = 4 L) with softcap: slower by 9.9%" in text
    assert text.endswith("Change of the medians over the cells: median +5.5%, from +1.1% to +9.9%")
    for wrong in ([run("old", 0.9, 1.0)], [run("a", 0.9, 1.0), run("b", 0.9, 1.0), run("c", 0.9, 1.0)]):
        with pytest.raises(SystemExit, match="exactly two commits"):
            bench.compare(wrong)
