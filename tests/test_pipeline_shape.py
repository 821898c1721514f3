"""The shape of the call pipeline (docs/backends.md): each of its modules does one step, in
functions a reader takes in at once. No function of functional, backends, guard or varlen
runs past 60 lines of code (its docstring, the API's reference, not counted), and varlen, a
client of the pipeline, stays under 300 lines."""

import ast
from pathlib import Path

import pytest

import attnscale

SRC = Path(attnscale.__file__).parent
PIPELINE = ("functional.py", "backends.py", "guard.py", "varlen.py")


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


@pytest.mark.parametrize("module", PIPELINE)
def test_no_function_of_the_pipeline_runs_past_60_lines_of_code(module):
    tree = ast.parse((SRC / module).read_text())
    long = {node.name: _code_lines(node) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > 60}
    assert long == {}


def test_varlen_stays_a_client_of_the_pipeline_under_300_lines():
    assert len((SRC / "varlen.py").read_text().splitlines()) < 300
