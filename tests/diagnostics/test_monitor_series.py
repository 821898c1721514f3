"""The monitor over training: attnscale.MultiHeadAttention's calls, sampled steps, the optimizer's
step, writers (JSON lines, CSV, callbacks), alerts, and the plot of a recorded run."""

import json
import logging
import math

import pytest
import torch
from torch import nn

import attnscale
from attnscale.diagnostics.monitor import (
    ROUTE_MHA,
    AlertRules,
    CsvWriter,
    HeadReport,
    JsonlWriter,
    StepRecord,
    TrainingStopped,
    plot_run,
    read_run,
)


def _mha(**kwargs) -> attnscale.MultiHeadAttention:
    torch.manual_seed(0)
    return attnscale.MultiHeadAttention(32, num_heads=4, **kwargs)


def test_multihead_attention_is_recorded_with_its_own_statistics():
    mha = _mha(num_kv_heads=2)
    x = torch.randn(3, 7, 32)
    expected = mha(x, is_causal=True, return_stats=True)
    with attnscale.monitor(mha) as mon, torch.no_grad():
        out = mha(x, is_causal=True)
    torch.testing.assert_close(out, expected.output, atol=1e-6, rtol=1e-5)
    heads = mon.report().heads
    assert [(h.layer, h.route) for h in heads] == [("MultiHeadAttention", ROUTE_MHA)] * 4
    stats = expected.stats
    for h in heads:
        assert h.rows == 3 * 7 and h.sink_share is None
        assert h.max_logit == pytest.approx(stats.max_logit[:, h.head].max().item(), rel=1e-6)
        assert h.max_prob == pytest.approx(stats.max_prob[:, h.head].mean().item(), rel=1e-5)
        assert h.entropy == pytest.approx(stats.entropy[:, h.head].mean().item(), rel=1e-5)


def test_sink_share_is_the_mean_probability_of_the_sink():
    mha = _mha(config=attnscale.AttentionConfig(sinks=True))
    with torch.no_grad():
        mha.sinks.copy_(torch.tensor([-2.0, 0.0, 1.0, 3.0]))
    x = torch.randn(2, 5, 32)
    stats = mha(x, return_stats=True).stats
    with attnscale.monitor(mha) as mon, torch.no_grad():
        mha(x)
    shares = [h.sink_share for h in mon.report().heads]
    want = stats.sink_share.mean((0, 2)).tolist()  # (B, H, L) -> (H,)
    assert shares == pytest.approx(want, rel=1e-5)
    assert shares == sorted(shares)  # a larger sink logit takes a larger share


def test_training_under_the_monitor_is_identical_to_training_without_it():
    def run(watch: bool) -> list[torch.Tensor]:
        mha = _mha(dropout=0.1)
        opt = torch.optim.AdamW(mha.parameters(), lr=1e-2)
        mon = attnscale.monitor(mha, optimizer=opt).start() if watch else None
        torch.manual_seed(1)
        try:
            for _ in range(3):
                mha(torch.randn(2, 9, 32), is_causal=True).square().mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            if mon is not None:
                mon.stop()
                assert [r.step for r in mon.history] == [0, 1, 2]
        return [p.detach().clone() for p in mha.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_every_n_samples_steps_zero_n_2n_and_leaves_the_others_alone():
    mha = _mha()
    calls = []
    mon = attnscale.monitor(mha, every=3, writers=[calls.append]).start()
    try:
        for step in range(7):
            assert mon.current_step == step and mon.sampling == (step % 3 == 0)
            with torch.no_grad():
                mha(torch.randn(2, 4, 32))
            record = mon.step()
            assert (record is not None) == (step % 3 == 0)
    finally:
        mon.stop()
    assert [r.step for r in mon.history] == [0, 3, 6] and calls == mon.history
    assert all(h.calls == 1 for r in mon.history for h in r.heads)


def test_a_step_without_forward_gives_no_record_and_current_step_can_be_set():
    mha = _mha()
    with attnscale.monitor(mha, every=5) as mon:
        assert mon.step() is None
        mon.current_step = 10
        with torch.no_grad():
            mha(torch.randn(1, 3, 32))
        assert mon.step().step == 10
    with pytest.raises(ValueError, match="current_step: expected an int >= 0"):
        mon.current_step = -1


def _recorded_run(tmp_path):
    mha = _mha(config=attnscale.AttentionConfig(sinks=True))
    paths = tmp_path / "run.jsonl", tmp_path / "run.csv"
    mon = attnscale.monitor(mha, every=2, writers=[JsonlWriter(paths[0]), CsvWriter(paths[1])], alerts=AlertRules(max_logit=0.5))
    with mon, torch.no_grad():
        for _ in range(5):
            mha(torch.randn(2, 6, 32))
            mon.step()
    return mon.history, paths


def test_jsonl_and_csv_writers_round_trip(tmp_path):
    history, (jsonl, csv_path) = _recorded_run(tmp_path)
    assert [r.step for r in history] == [0, 2, 4] and history[0].alerts  # max_logit=0.5 fires at step 0
    assert all(h.sink_share is not None for r in history for h in r.heads)
    assert read_run(jsonl) == tuple(history)
    assert read_run(csv_path) == tuple(StepRecord(r.step, r.heads) for r in history)  # alerts are not in the CSV
    lines = jsonl.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["schema"] == "attnscale.monitor.step/1"


def test_scalars_name_every_statistic_of_every_head():
    head = HeadReport("h.0", 2, ROUTE_MHA, 1, 4, 1.0, 0.25, 3.0, 1.1, 0.8, 0.5, 0.25, 0.1)
    scalars = StepRecord(7, (head,)).scalars(prefix="attn")
    assert scalars == {
        "attn/h.0/head_2/max_logit": 3.0,
        "attn/h.0/head_2/entropy": 1.1,
        "attn/h.0/head_2/normalized_entropy": 0.8,
        "attn/h.0/head_2/max_prob": 0.5,
        "attn/h.0/head_2/saturated_share": 0.25,
        "attn/h.0/head_2/score_std": 1.0,
        "attn/h.0/head_2/scaled_score_std": 0.25,
        "attn/h.0/head_2/sink_share": 0.1,
    }
    blank = HeadReport("h.0", 0, ROUTE_MHA, 1, 0, None, None, None, None, None, None, None)
    assert StepRecord(0, (blank,)).scalars() == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"schema": "other"}\n', "schema 'attnscale.monitor.step/1'"),
        ("{not json\n", "one JSON object per line"),
    ],
)
def test_read_run_refuses_what_the_writers_did_not_write(tmp_path, text, message):
    path = tmp_path / "run.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_run(path)
    bad_csv = tmp_path / "run.csv"
    bad_csv.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="a CSV with header step,layer"):
        read_run(bad_csv)
    with pytest.raises(ValueError, match="path: expected a .jsonl or .csv file"):
        read_run(tmp_path / "missing.jsonl")


class Gain(nn.Module):
    """One head whose q is multiplied by ``gain``: its logits, and their peak, grow with it."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = attnscale.MultiHeadAttention(16, num_heads=1, bias=False)
        self.gain = 1.0

    def forward(self, x):
        q = x * self.gain
        return self.attn(q, x, x)


def _alerts(rules, gains, **kwargs):
    torch.manual_seed(0)
    model = Gain()
    x = torch.randn(2, 16, 16)
    fired = []
    mon = attnscale.monitor(model, alerts=rules, on_alert=fired.append, **kwargs).start()
    try:
        for gain in gains:
            model.gain = gain
            with torch.no_grad():
                model(x)
            mon.step()
    finally:
        mon.stop()
    return fired, mon


def test_each_rule_fires_once_when_its_condition_becomes_true(caplog):
    rules = AlertRules(max_logit=20.0, growth_factor=3.0, growth_window=3, growth_floor=2.0, min_normalized_entropy=0.3, saturation_jump=0.2)
    with caplog.at_level(logging.WARNING, logger="attnscale.monitor"):
        fired, mon = _alerts(rules, [1, 1, 1, 4, 8, 16, 64, 64, 64])
    by_rule = {}
    for alert in fired:
        by_rule.setdefault(alert.rule, []).append(alert)
    assert set(by_rule) == {"max_logit", "logit_growth", "entropy_collapse", "saturation_jump"}
    assert len(by_rule["max_logit"]) == 1  # the max logit stays above 20 from its first alert on
    logits = {r.step: r.heads[0].max_logit for r in mon.history}
    (over,) = by_rule["max_logit"]
    assert logits[over.step] > 20.0 and all(logits[s] <= 20.0 for s in logits if s < over.step)
    growth = by_rule["logit_growth"][0]
    window = [logits[s] for s in logits if growth.step - 3 <= s < growth.step]
    assert growth.value == pytest.approx(logits[growth.step] / min(window)) and growth.value >= 3.0
    assert {a.message for a in fired} == {r.getMessage().removeprefix("attnscale.monitor alert: ") for r in caplog.records}
    assert [a for r in mon.history for a in r.alerts] == fired


def test_rules_that_are_off_never_fire_and_stop_raises():
    fired, _ = _alerts(AlertRules(max_logit=None, growth_factor=None, min_normalized_entropy=None, saturation_jump=None), [1, 64, 64])
    assert fired == []
    with pytest.raises(TrainingStopped, match="max logit") as info:
        _alerts(AlertRules(max_logit=20.0, stop=True), [1, 64, 64])
    assert info.value.alerts[0].step == 1
    torch.manual_seed(0)
    model = Gain()
    with attnscale.monitor(model, alerts=AlertRules(max_logit=20.0, stop=True)) as mon:
        model.gain = 64.0
        with torch.no_grad():
            model(torch.randn(2, 16, 16))
        mon.step(raise_on_stop=False)
        assert mon.stop_requested
        with torch.no_grad():  # a loop that goes on after the alert: its steps keep counting
            model(torch.randn(2, 16, 16))
        mon.step(raise_on_stop=False)
    assert [r.step for r in mon.history] == [0, 1]
    assert [bool(r.alerts) for r in mon.history] == [True, False]  # the max logit rule fires when it becomes true


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        (dict(every=0), ValueError, "every: expected an int >= 1"),
        (dict(every=2.0), TypeError, "every: expected an int >= 1"),
        (dict(writers=[1]), TypeError, "writers: expected a sequence of callables"),
        (dict(alerts={"max_logit": 1}), TypeError, "alerts: expected None or an AlertRules"),
        (dict(optimizer="adam"), TypeError, "optimizer: expected None or a torch.optim.Optimizer"),
        (dict(on_alert=3), TypeError, "on_alert: expected None or a callable"),
    ],
)
def test_monitor_options_are_validated(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        attnscale.monitor(nn.Identity(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        (dict(max_logit=0.0), ValueError, "max_logit: expected None or a finite float > 0"),
        (dict(growth_factor=1.0), ValueError, "growth_factor: expected None or a factor > 1"),
        (dict(growth_factor="2"), TypeError, "growth_factor: expected None or a float"),
        (dict(min_normalized_entropy=1.5), ValueError, r"min_normalized_entropy: expected a float in \(0, 1\)"),
        (dict(stop=1), TypeError, "stop: expected a bool"),
        (dict(growth_floor=math.inf), ValueError, "growth_floor: expected a finite float"),
    ],
)
def test_alert_rules_are_validated(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        AlertRules(**kwargs)


def test_plot_run_draws_three_statistics_per_layer_and_names_flagged_heads(tmp_path):
    from matplotlib.figure import Figure

    history, (jsonl, _) = _recorded_run(tmp_path)
    fig = plot_run(read_run(jsonl), title="run")
    assert isinstance(fig, Figure) and len(fig.axes) == 3  # one layer: max logit, entropy, saturated share
    (legend,) = fig.legends
    labels = {t.get_text() for t in legend.get_texts()}
    assert labels == {f"MultiHeadAttention head {a.head}" for r in history for a in r.alerts}
    with pytest.raises(ValueError, match="records: expected at least one StepRecord"):
        plot_run([])


def test_cli_plots_a_recorded_run(tmp_path, capsys):
    from attnscale import cli

    history, (jsonl, csv_path) = _recorded_run(tmp_path)
    assert cli.main(["monitor", "--run", str(jsonl), "--title", "tiny run"]) == 0
    out = capsys.readouterr().out
    assert f"3 recorded steps (0 .. 4), {sum(len(r.alerts) for r in history)} alerts" in out and "alert: step 0" in out
    assert jsonl.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    svg = tmp_path / "plots" / "run.svg"
    assert cli.main(["monitor", "--run", str(csv_path), "--figure", str(svg)]) == 0
    assert svg.read_text().lstrip().startswith("<?xml")
    for argv, message in [
        (["monitor", "--run", str(tmp_path / "none.jsonl")], "path: expected a .jsonl or .csv file"),
        (["monitor", "--run", str(jsonl), "--figure", str(tmp_path / "x.txt")], "--figure: expected a .png, .svg or .pdf path"),
        (["monitor", "--run", str(jsonl), "--hf", "x"], "--run plots a recorded run; it takes no --hf"),
        (["monitor"], "expected --hf and --text"),
    ]:
        with pytest.raises(SystemExit, match=message):
            cli.main(argv)
