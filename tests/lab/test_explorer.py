"""The explorer page: its Python twin, its links and files, and the page itself in headless Chromium.

The browser tests drive Debian's Chromium over the DevTools protocol (websocket-client) and compare
every number the page displays with attnscale.lab.explorer.measure for the same URL state.
"""

import html
import json
import math
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from attnscale.cli import main
from attnscale.lab import explorer, registry
from attnscale.lab.experiments import saturation_example
from attnscale.lab.explorer import State, measure

CHROMIUM = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and Path(p).exists()), None)


def _mulberry32_sequential(seed: int, count: int) -> list[int]:
    """The generator as usually written: a state advanced by 0x6D2B79F5 before each output."""
    out, a = [], seed
    for _ in range(count):
        a = (a + 0x6D2B79F5) & 0xFFFFFFFF
        t = a
        t = ((t ^ (t >> 15)) * (t | 1)) & 0xFFFFFFFF
        t ^= (t + ((t ^ (t >> 7)) * (t | 61))) & 0xFFFFFFFF
        out.append((t ^ (t >> 14)) & 0xFFFFFFFF)
    return out


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 - 1])
def test_generator_is_mulberry32_at_any_offset(seed):
    words = _mulberry32_sequential(seed, 300)
    assert explorer.mulberry32(seed, 0, 300).tolist() == words
    assert explorer.mulberry32(seed, 137, 50).tolist() == words[137:187]


def test_normals_are_box_muller_on_word_pairs_and_standard():
    u = explorer.uniforms(7, 20, 2)
    r, theta = math.sqrt(-2 * math.log(1 - u[0])), 2 * math.pi * u[1]
    assert explorer.normals(7, 20, 2).tolist() == pytest.approx([r * math.cos(theta), r * math.sin(theta)], rel=1e-14)
    assert explorer.normals(7, 11, 4).tolist() == explorer.normals(7, 0, 15)[11:].tolist()  # any offset, odd ones too
    z = explorer.normals(3, 0, 100_000)
    assert abs(z.mean()) < 4 / math.sqrt(z.size)
    assert abs(z.var() - 1) < 4 * math.sqrt(2 / z.size)
    assert abs(np.mean(z[0::2] * z[1::2])) < 4 / math.sqrt(z.size / 2)  # the two normals of a pair are uncorrelated


@pytest.mark.parametrize(
    "query",
    ["dk=128&divisor=1&keys=64", "dk=7&divisor=free&temp=2.5&keys=3&seed=9&draws=11", "dk=64&divisor=sqrt-dk&keys=64&qk=correlated&rho=-0.25"],
)
def test_query_round_trip(query):
    assert State.from_query(query).to_query() == query
    assert State.from_query("?" + query) == State.from_query(query)


@pytest.mark.parametrize(
    ("query", "arg"),
    [
        ("dk=0", "dk"),
        ("dk=2000", "dk"),
        ("dk=abc", "dk"),
        ("keys=1", "keys"),
        ("draws=2.5", "draws"),
        ("divisor=sqrt", "divisor"),
        ("qk=gauss", "qk"),
        ("temp=-1", "temp"),
        ("temp=nan", "temp"),
        ("rho=1.5", "rho"),
        ("d_k=64", "query"),
    ],
)
def test_bad_query_names_the_parameter(query, arg):
    with pytest.raises(ValueError, match=rf"^{arg}: expected .+, got .+\. Fix: "):
        State.from_query(query)


def test_measures_are_the_lab_quantities():
    unscaled, scaled = measure(State(divisor="1", draws=400)), measure(State(draws=400))
    # the saturation-example experiment's own measurement, on its own draws, at the same setting
    lab = saturation_example.run(saturation_example.Config(draws=400), seed=1, progress=lambda done, total: None)
    for mine, case in ((unscaled, "unscaled"), (scaled, "scaled")):
        lo, hi = lab[f"{case}_max_prob_median_ci95"]
        assert lo <= mine.max_prob_median <= hi, (case, mine.max_prob_median, lo, hi)
    assert scaled.var_over_dk == unscaled.var_over_dk  # the same draws, only the divisor differs
    se = math.sqrt(2 / (400 * 64))  # sampling error of Var / d_k over 400 x 64 scores, roughly
    assert abs(scaled.var_over_dk - 1) < 8 * se
    assert scaled.law_std == 1.0 and unscaled.law_std == pytest.approx(math.sqrt(128))
    assert sum(scaled.weights) == pytest.approx(1.0)
    assert unscaled.offpeak_mean < 0.1 * scaled.offpeak_mean  # the jacobian-collapse claim's ratio
    assert scaled.offpeak_uniform == pytest.approx(63 * 125 / 64**2)
    assert unscaled.vanish_std is not None and unscaled.vanish_std < unscaled.fp16_overflow_std / 10
    double = measure(State(qk="l2", draws=50))  # qknorm-double-shrink: near uniform
    assert double.entropy_ratio > 0.95 and double.max_prob_median < 2 / 64


def test_linear_draw_has_default_init_variance():
    m = measure(State(dk=16, qk="linear", draws=100))
    # W ~ U(+-1/sqrt(M)), |LayerNorm(x)|^2 = M, bias variance 1/(3M): q's components have variance ~1/3, so Var(q.k)/d_k ~ 1/9
    assert 0.07 < m.var_over_dk < 0.16


def test_every_claim_view_parses_and_the_page_lists_the_same_views():
    views = {cid: explorer.explorer_link(cid) for cid in registry.CLAIM_IDS}
    linked = {cid: link for cid, link in views.items() if link}
    assert {"saturation-example", "variance-law", "divisor-table", "jacobian-collapse", "fp16-secondary", "qknorm-double-shrink"} <= set(linked)
    assert linked["saturation-example"] == "explore.html?dk=128&divisor=1&keys=64"
    for link in linked.values():
        page, _, query = link.partition("?")
        assert page == "explore.html" and State.from_query(query).to_query() == query
    assert explorer.explorer_link("no-such-claim") is None
    block = explorer.page_html().split("const VIEWS = [", 1)[1].split("];", 1)[0]
    page_views = dict(re.findall(r'\["([a-z0-9-]+)", "[^"]+", "([^"]+)"\]', block))
    assert {cid: f"explore.html?{q}" for cid, q in page_views.items()} == linked


def test_page_is_self_contained(tmp_path):
    path = explorer.write_explorer(tmp_path / "new")
    html = path.read_text(encoding="utf-8")
    assert path == tmp_path / "new" / "explore.html" and html == explorer.page_html()
    addresses = set(re.findall(r"https?://[^\s\"'<>]+", html))
    assert addresses == {"http://www.w3.org/2000/svg"}  # the SVG namespace name, never fetched
    assert not re.search(r"<(link|img|iframe)\b|<script\s+src|@import|url\(|fetch\(|XMLHttpRequest", html)


def test_explore_command_writes_the_page(tmp_path, monkeypatch, capsys):
    opened = []
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    target = tmp_path / "sub" / "view.html"
    assert main(["explore", "--out", str(target), "--open"]) == 0
    assert target.read_text(encoding="utf-8") == explorer.page_html()
    assert opened == [target.resolve().as_uri()]
    assert str(target) in capsys.readouterr().out


def test_explore_command_refuses_an_unusable_out(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as exc:
        main(["explore", "--out", str(blocker / "explore.html")])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err


# ---- the page in headless Chromium


class Browser:
    """One headless Chromium and its first tab, driven over the DevTools protocol."""

    def __init__(self, chromium: str, profile: Path):
        websocket = pytest.importorskip("websocket", reason="websocket-client is needed to drive Chromium")
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--remote-debugging-port=0", "--window-size=1400,900",
        ]
        self.proc = subprocess.Popen([chromium, *flags, "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"  # Chromium writes the port it chose here
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and len(port_file.read_text().split()) >= 2):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                pytest.fail("Chromium did not open its DevTools port within 30 s")
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:
            page = next(t for t in json.load(answer) if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self.calls = 0
        self.events: list[dict] = []
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            self.call(method)

    def call(self, method: str, **params):
        self.calls += 1
        self.ws.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.calls:
                assert "error" not in msg, msg
                return msg.get("result", {})
            self.events.append(msg)

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.eval("document.readyState === 'complete' && document.body.dataset.state") != "ready":
            assert time.monotonic() < deadline, "the page did not finish computing"
            time.sleep(0.02)

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_ready()

    def key(self, key: str, code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key if len(key) > 1 else f"Key{key.upper()}",
                      windowsVirtualKeyCode=code, text=key if kind == "keyDown" and len(key) == 1 else "")

    def numbers(self) -> dict[str, tuple[str, str, str]]:
        """Every displayed number: key -> (full-precision value, shown text, its unit label)."""
        return self.eval(
            "Object.fromEntries([...document.querySelectorAll('[data-key]')].map(n => [n.dataset.key, "
            "[n.dataset.value, n.textContent, (n.nextElementSibling || {}).textContent || '']]))"
        )

    def problems(self) -> list[dict]:
        """Console errors and warnings, uncaught exceptions, and browser log errors so far."""
        return [
            e for e in self.events
            if e["method"] == "Runtime.exceptionThrown"
            or (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "warning", "assert"))
            or (e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] in ("error", "warning"))
        ]

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no chromium at /usr/bin/chromium or on PATH: the page is not opened")
    b = Browser(CHROMIUM, tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    return explorer.write_explorer(tmp_path_factory.mktemp("explorer")).as_uri()


def _check_against_python(numbers: dict, query: str) -> None:
    m = measure(State.from_query(query))
    expected = {f: getattr(m, f) for f in m.__dataclass_fields__ if f != "weights"}
    expected |= {"score_std_again": m.score_std, "uniform": 1 / State.from_query(query).keys}
    assert set(expected) | {"argmax"} == set(numbers)
    assert numbers["argmax"][0] == str(int(np.argmax(m.weights)))
    for key, want in expected.items():
        value, text, unit = numbers[key]
        assert unit.strip(), f"{key} has no unit label"
        if want is None:
            assert value == "null" and text == ("not reached" if key == "vanish_std" else "undefined: all scores are equal"), key
            continue
        assert float(value) == pytest.approx(want, rel=1e-9, abs=1e-12), (key, query)
        assert float(text) == pytest.approx(want, rel=6e-4, abs=1e-300), (key, text)


STATES = [
    "dk=128&divisor=1&keys=64",
    "dk=128&divisor=sqrt-dk&keys=64&draws=100",
    "dk=32&divisor=dk&keys=16&seed=5&draws=60",
    "dk=64&divisor=sqrt-dmodel&heads=4&keys=24&draws=50",
    "dk=6&divisor=free&temp=0.3&keys=2&draws=30",
    "dk=16&divisor=sqrt-dk&keys=12&qk=linear&draws=20",
    "dk=256&divisor=sqrt-dk&keys=8&qk=correlated&rho=0.9&draws=40",
    "dk=48&divisor=1&keys=32&qk=l2&draws=40",
    "dk=1&divisor=1&keys=96&qk=rms&draws=25",
    "dk=1&divisor=1&keys=2&qk=l2&seed=1&draws=1",  # both scores equal: std 0, nothing to rescale
]


@pytest.mark.parametrize("query", STATES)
def test_page_numbers_match_python(browser, page_url, query):
    browser.open(f"{page_url}?{query}")
    assert browser.eval("location.search") == f"?{query}"
    assert browser.eval("document.getElementById('error').hidden") is True
    _check_against_python(browser.numbers(), query)
    assert browser.problems() == []


def _panels(browser) -> dict[str, tuple[str, str]]:
    """Each panel's picture (its SVG markup or canvas pixels) and its numbers."""
    return browser.eval(
        "Object.fromEntries([...document.querySelectorAll('main section:not(#views)')].map(s => {"
        " const c = s.querySelector('canvas'), g = s.querySelector('svg');"
        " return [s.id, [c ? c.toDataURL() : g.innerHTML, [...s.querySelectorAll('[data-key]')].map(n => n.dataset.value).join()]]; }))"
    )


def _unchanged(before: dict, after: dict) -> list[str]:
    return [f"{panel} {part}" for panel in before for i, part in enumerate(("picture", "numbers")) if before[panel][i] == after[panel][i]]


def test_keyboard_controls_update_every_panel_and_the_url(browser, page_url):
    browser.open(f"{page_url}?dk=64&divisor=1&keys=16&draws=40")
    before = _panels(browser)
    assert len(before) == 5
    browser.eval("document.getElementById('dk').focus()")
    browser.key("ArrowRight", 39)
    browser.wait_ready()
    query = "dk=96&divisor=1&keys=16&draws=40"
    assert browser.eval("location.search") == f"?{query}"
    after = _panels(browser)
    assert _unchanged(before, after) == []  # every panel's picture and numbers changed
    _check_against_python(browser.numbers(), query)

    browser.eval("document.getElementById('keys').focus()")
    browser.key("ArrowLeft", 37)
    browser.wait_ready()
    browser.key("n", 78)  # a new draw: the next seed
    browser.wait_ready()
    query = "dk=96&divisor=1&keys=12&seed=1&draws=40"
    assert browser.eval("location.search") == f"?{query}"
    moved = _panels(browser)
    assert _unchanged(after, moved) == []
    _check_against_python(browser.numbers(), query)
    assert browser.problems() == []


def test_select_moves_by_keyboard(browser, page_url):
    browser.open(f"{page_url}?dk=32&divisor=1&keys=8&draws=20")
    browser.eval("document.getElementById('divisor').focus()")
    browser.key("ArrowDown", 40)
    browser.wait_ready()
    assert browser.eval("location.search") == "?dk=32&divisor=sqrt-dk&keys=8&draws=20"
    _check_against_python(browser.numbers(), "dk=32&divisor=sqrt-dk&keys=8&draws=20")


def test_bad_url_shows_the_library_message_and_uses_defaults(browser, page_url):
    browser.open(f"{page_url}?dk=0&divisor=sqrt&keys=8&draws=20")
    shown = browser.eval("document.getElementById('error').hidden ? '' : document.getElementById('error').textContent")
    for bad in ("dk=0", "divisor=sqrt"):
        with pytest.raises(ValueError) as exc:
            State.from_query(bad)
        assert str(exc.value) in shown
    assert browser.eval("location.search") == "?dk=128&divisor=sqrt-dk&keys=8&draws=20"
    _check_against_python(browser.numbers(), "dk=128&divisor=sqrt-dk&keys=8&draws=20")
    assert browser.problems() == []


@pytest.mark.parametrize("name", ["toString", "__proto__", "constructor", "hasOwnProperty", "valueOf"])
def test_built_in_object_properties_in_the_url_are_unknown_parameters(browser, page_url, name):
    # The page once stopped silently on these: `name in DEFAULTS` matched Object's own properties.
    browser.open(f"{page_url}?{name}=1&keys=8&draws=20")
    shown = browser.eval("document.getElementById('error').hidden ? '' : document.getElementById('error').textContent")
    with pytest.raises(ValueError) as exc:
        State.from_query(f"{name}=1")
    assert str(exc.value) in shown
    assert browser.eval("location.search") == "?dk=128&divisor=sqrt-dk&keys=8&draws=20"  # the page always shows dk and divisor
    _check_against_python(browser.numbers(), "dk=128&divisor=sqrt-dk&keys=8&draws=20")
    assert browser.problems() == []


def test_report_writes_the_explorer_and_links_each_claim_to_its_view(tmp_path):
    claims = ["saturation-example", "softmax-peak-example"]
    assert main(["report", "--out", str(tmp_path), "--profile", "tiny", "--jobs", "1", "--only", *claims]) == 0
    assert (tmp_path / "explore.html").read_text(encoding="utf-8") == explorer.page_html()
    sections = dict(re.findall(r'<section id="([^"]+)">(.*?)</section>', (tmp_path / "index.html").read_text(), re.S))
    markdown = (tmp_path / "report.md").read_text()
    assert sorted(sections) == sorted(claims)
    for cid, body in sections.items():
        view = explorer.explorer_link(cid)
        assert [html.unescape(h) for h in re.findall(r'href="(explore\.html[^"]*)"', body)] == [view]
        assert (tmp_path / view.partition("?")[0]).is_file()
        md_section = markdown.split(f"## {cid}\n", 1)[1].split("\n## ", 1)[0]
        assert re.findall(r"\]\((explore\.html[^)]*)\)", md_section) == [view]
