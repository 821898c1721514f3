"""Fixtures the lab's tests share."""

import importlib
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from attnscale.lab import base
from attnscale.lab.base import no_progress
from attnscale.lab.execute import Task, execute


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """``tiny_run(claim_id)``: the experiment executed once per test session at profile tiny, seed 0,
    as the report executes it (run, judge, plot with real files): ``(record, [(name, Figure)])``, the
    figures as drawn (Agg) when saved. The caption and figure tests read the same run."""
    done: dict[str, tuple[dict, list]] = {}

    def get(claim_id: str) -> tuple[dict, list]:
        if claim_id not in done:
            module_name = f"attnscale.lab.experiments.{claim_id.replace('-', '_')}"
            figdir = Path(tmp_path_factory.mktemp("figures")) / claim_id
            saved = []

            def record(fig, outdir, name):
                written = base.save_figure(fig, outdir, name)
                FigureCanvasAgg(fig).draw()  # after the files: the layout the tests measure is at the figure's own dpi
                saved.append((name, fig))
                return written

            module = importlib.import_module(module_name)
            mp = pytest.MonkeyPatch()
            mp.setattr(module, "save_figure", record)
            try:
                result = execute(Task(module_name, claim_id, "tiny", 0, str(figdir), f"figures/{claim_id}", None), no_progress)
            finally:
                mp.undo()
            done[claim_id] = result, saved
        return done[claim_id]

    return get
