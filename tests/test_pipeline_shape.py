"""The shape of the call pipeline (docs/backends.md): each of its modules does one step, in
functions a reader takes in at once. No function of functional, backends, guard or varlen
runs past 60 lines, docstring included (the entry points' API reference is their ``__doc__``,
kept beside them as torch keeps its own), and varlen, a client of the pipeline, stays under 300
lines."""

import ast
from pathlib import Path

import pytest

import attnscale

SRC = Path(attnscale.__file__).parent
PIPELINE = ("functional.py", "backends.py", "guard.py", "varlen.py")


def _lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("module", PIPELINE)
def test_no_function_of_the_pipeline_runs_past_60_lines(module):
    tree = ast.parse((SRC / module).read_text())
    long = {node.name: _lines(node) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > 60}
    assert long == {}


def test_varlen_stays_a_client_of_the_pipeline_under_300_lines():
    assert len((SRC / "varlen.py").read_text().splitlines()) < 300


@pytest.mark.parametrize(("entry", "reference"), [("scaled_dot_product_attention", "functional._SDPA_DOC"), ("varlen_attention", "varlen._VARLEN_DOC")])
def test_the_entry_points_reference_is_their_doc(entry, reference):
    import importlib
    import inspect

    module, name = reference.split(".")
    doc = getattr(importlib.import_module(f"attnscale.{module}"), name)
    assert getattr(attnscale, entry).__doc__ is doc and "Args:" in inspect.getdoc(getattr(attnscale, entry))
