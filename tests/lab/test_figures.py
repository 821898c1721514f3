"""Every experiment's figures are legible at the size the report page shows them.

Each experiment runs at profile tiny and its ``plot`` is called with ``save_figure`` wrapped so the
test sees every figure as it is saved. For each figure: no two texts overlap (tick labels, axis labels,
titles, legend texts, annotations, of any axes), every axes with data has a title, and no text is
smaller than ``MIN_PT`` at display size. Display size: the page shows a figure's SVG at its natural
size (96 px per inch) capped at ``PAGE_MAX_PX`` wide and ``PAGE_MAX_PY`` tall (render_html's CSS),
so a font of ``s`` pt shows at ``s * min(1, cap / natural)`` pt.
"""

import importlib
import itertools

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from attnscale.diagnostics import census
from attnscale.lab.base import no_progress
from attnscale.lab.registry import CLAIM_IDS

MODULES = {cid: importlib.import_module(f"attnscale.lab.experiments.{cid.replace('-', '_')}") for cid in CLAIM_IDS}
MIN_PT = 7.0
PAGE_MAX_PX, PAGE_MAX_PY = 760, 560
TOUCH_PX = 1.0  # boxes that merely touch (shared edge, rounding) are not an overlap



def _full_census(measured):
    """The tiny census's rows repeated under new names to a full census's size: 330 probed types of
    every class, 250 not probed, and position curves for eight types."""
    classes = [census.SQRT, census.NORMALISED, census.OTHER_CONSTANT, census.POSITION, census.LAYER, census.HEAD, census.NOT_MEASURABLE]
    rows = [dict(r, model_type=f"{r['model_type']}{i}", **{"class": classes[i % 7]}) for i in range(66) for r in measured["census"][:5]]
    curves = [dict(c, model_type=f"{c['model_type']} {i}") for i in range(8) for c in measured["position_curves"][:1]]
    failed = [{"model_type": f"odd{i}", "reason": "not probed"} for i in range(250)]
    return dict(measured, census=rows, not_probed=failed, position_curves=curves)


# Figures whose layout depends on how much was measured, also drawn at a larger profile's count:
# flash-exp2 at the default profile's 4 x 3 x 2 cases (short lengths, so it stays fast), and
# scale-in-the-wild at a full census's size.
LARGER = {
    "flash-exp2 (24 cases)": (
        "flash-exp2",
        MODULES["flash-exp2"].Config(d_ks=(32, 64, 128, 256), lengths=(100, 200, 300), queries=4, heads=1, block=64),
        None,
    ),
    "scale-in-the-wild (full census)": ("scale-in-the-wild", None, _full_census),
}
CASES = {**{cid: (cid, None, None) for cid in CLAIM_IDS}, **LARGER}


@pytest.fixture(scope="module", params=list(CASES))
def figures(request, tiny_run):
    """(case, [(name, Figure)]) for one experiment at profile tiny (the session's run, shared with
    tests/lab/test_captions.py) or at its LARGER config, drawn once."""
    cid, config, widen = CASES[request.param]
    if config is None and widen is None:
        record, saved = tiny_run(cid)
        assert record["error"] is None, record["error"]
        return request.param, saved
    module = MODULES[cid]
    measured = widen(tiny_run(cid)[0]["measured"]) if config is None else module.run(config, 0, no_progress)
    saved = []

    def record(fig, outdir, name):
        FigureCanvasAgg(fig).draw()
        saved.append((name, fig))
        return name

    mp = pytest.MonkeyPatch()
    mp.setattr(module, "save_figure", record)
    try:
        names = module.plot(measured, None)
    finally:
        mp.undo()
    assert names == [name for name, _ in saved]
    return request.param, saved


def _in_view(axis, loc):
    lo, hi = sorted(axis.get_view_interval())
    tol = 1e-9 * max(abs(lo), abs(hi), 1.0)
    return lo - tol <= loc <= hi + tol


def _texts(fig):
    """Every text the figure draws: (label for messages, Text)."""
    found = [("figure text", t) for t in fig.texts]
    for legend in fig.legends:
        found += [("figure legend", t) for t in [legend.get_title(), *legend.get_texts()]]
    for i, ax in enumerate(fig.axes):
        where = f"axes {i} ({ax.get_title() or ax.get_label()!r})"
        found += [(f"{where} title", ax.title), (f"{where} left title", ax._left_title), (f"{where} right title", ax._right_title)]
        found += [(f"{where} {a.axis_name}label", a.label) for a in (ax.xaxis, ax.yaxis)]
        found += [(f"{where} {a.axis_name} offset", a.get_offset_text()) for a in (ax.xaxis, ax.yaxis)]
        for axis in (ax.xaxis, ax.yaxis):
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                if tick.get_visible() and _in_view(axis, tick.get_loc()):
                    found += [(f"{where} {axis.axis_name} tick", lab) for lab in (tick.label1, tick.label2)]
        found += [(f"{where} text", t) for t in ax.texts]
        legend = ax.get_legend()
        if legend is not None:
            found += [(f"{where} legend", t) for t in [legend.get_title(), *legend.get_texts()]]
    return [(label, t) for label, t in found if isinstance(t, Text) and t.get_visible() and t.get_text().strip()]


def _display_scale(fig):
    """How much the page shrinks the figure: its natural size is the tight bbox at 96 px per inch."""
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    return min(1.0, PAGE_MAX_PX / (box.width * 96), PAGE_MAX_PY / (box.height * 96))


def test_no_text_overlaps(figures):
    cid, saved = figures
    bad = []
    for name, fig in saved:
        renderer = fig.canvas.get_renderer()
        boxes = [(label, t.get_text(), t.get_window_extent(renderer)) for label, t in _texts(fig)]
        for (la, ta, a), (lb, tb, b) in itertools.combinations(boxes, 2):
            shrunk = Bbox.from_extents(a.x0 + TOUCH_PX, a.y0 + TOUCH_PX, a.x1 - TOUCH_PX, a.y1 - TOUCH_PX)
            if shrunk.width > 0 and shrunk.height > 0 and shrunk.overlaps(b):
                bad.append(f"{name}: {la} {ta!r} overlaps {lb} {tb!r}")
    assert not bad, f"{cid}: overlapping text:\n" + "\n".join(bad)


def test_every_panel_has_a_title(figures):
    cid, saved = figures
    bad = [
        f"{name}: axes {i}"
        for name, fig in saved
        for i, ax in enumerate(fig.axes)
        if ax.get_label() != "<colorbar>"
        and ax.has_data()
        and not any(ax.get_title(loc).strip() for loc in ("left", "center", "right"))
    ]
    assert not bad, f"{cid}: panels without a title: {bad}"


def test_text_readable_at_display_size(figures):
    cid, saved = figures
    bad = []
    for name, fig in saved:
        scale = _display_scale(fig)
        for label, t in _texts(fig):
            shown = t.get_fontsize() * scale
            if shown < MIN_PT:
                bad.append(f"{name}: {label} {t.get_text()!r} shows at {shown:.1f} pt")
    assert not bad, f"{cid}: text below {MIN_PT} pt at display size:\n" + "\n".join(bad)
