"""attnscale.monitor on small modules: statistics against a direct float64 computation, restoring
torch's function, nesting, flags, and the report's JSON / CSV / table / heatmap forms."""

import json
import math
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnscale
from attnscale.diagnostics.monitor import (
    ROUTE_SDPA,
    HeadReport,
    MonitorReport,
    MonitorThresholds,
    read_csv,
    score_moments,
)

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, with optional grouped-query heads."""

    def __init__(self, d_model: int, n_head: int, n_kv_head: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.n_head, self.n_kv_head, self.D = n_head, n_kv_head, d_model // n_head
        self.c_attn = nn.Linear(d_model, (n_head + 2 * n_kv_head) * self.D)
        self.c_proj = nn.Linear(n_head * self.D, d_model)

    def qkv(self, x, mask=None):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split([self.n_head * self.D, self.n_kv_head * self.D, self.n_kv_head * self.D], dim=-1)
        q = q.view(B, T, self.n_head, self.D).transpose(1, 2)  # (B, H, L, D)
        k = k.view(B, T, self.n_kv_head, self.D).transpose(1, 2)  # (B, Hkv, S, D)
        v = v.view(B, T, self.n_kv_head, self.D).transpose(1, 2)  # (B, Hkv, S, D)
        return q, k, v

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_head != self.n_kv_head
        )  # (B, H, L, D)
        return self.c_proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, d_model=48, n_head=4, n_kv_head=4, layers=2):
        super().__init__()
        self.h = nn.ModuleList(CausalSelfAttention(d_model, n_head, n_kv_head, seed=i) for i in range(layers))

    def forward(self, x, mask=None):
        for layer in self.h:
            x = x + layer(x, mask)
        return x


def _direct(attn: CausalSelfAttention, x: torch.Tensor, mask: torch.Tensor | None, saturation: float) -> list[dict]:
    """Per-head statistics from the full (L, S) score matrix in float64."""
    q, k, _ = (t.double() for t in attn.qkv(x))
    k = k.repeat_interleave(attn.n_head // attn.n_kv_head, dim=1)  # (B, H, S, D)
    qk = q @ k.transpose(-1, -2)  # (B, H, L, S)
    L, S = qk.shape[-2:]
    keep = torch.ones(L, S, dtype=torch.bool).tril() if mask is None else mask.expand_as(qk)
    logits = (qk / math.sqrt(attn.D)).masked_fill(~keep, -math.inf)
    p = torch.softmax(logits, dim=-1)
    entropy = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)  # (B, H, L)
    n = keep.expand_as(qk).sum(-1).double()
    norm = torch.where(n > 1, entropy / n.clamp_min(2).log(), torch.zeros_like(entropy))
    out = []
    for h in range(attn.n_head):
        rows = n[:, h] > 0
        out.append(
            dict(
                rows=int(rows.sum()),
                score_std=qk[:, h].std(unbiased=False).item(),
                scaled_score_std=(qk[:, h] / math.sqrt(attn.D)).std(unbiased=False).item(),
                max_logit=logits[:, h][rows].amax().item(),
                entropy=entropy[:, h][rows].mean().item(),
                normalized_entropy=norm[:, h][rows].mean().item(),
                max_prob=p[:, h].amax(-1)[rows].mean().item(),
                saturated_share=(p[:, h].amax(-1)[rows] > saturation).double().mean().item(),
            )
        )
    return out


@pytest.mark.parametrize(("n_kv_head", "padded"), [(4, False), (2, False), (1, True)], ids=["MHA-causal", "GQA-causal", "MQA-padded"])
def test_statistics_match_a_direct_computation(n_kv_head, padded):
    torch.manual_seed(0)
    model = Block(n_kv_head=n_kv_head)
    x = torch.randn(3, 13, 48)  # (B, T, d_model)
    mask = None
    if padded:
        lengths = torch.tensor([13, 9, 4])
        mask = (torch.arange(13) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S), True = attend
    with torch.no_grad():
        expected_out = model(x, mask)
        with attnscale.monitor(model, thresholds=MonitorThresholds(saturation_prob=0.5)) as mon:
            out = model(x, mask)
    torch.testing.assert_close(out, expected_out, atol=2e-6, rtol=1e-5)
    report = mon.report()
    assert report.layers == ("h.0", "h.1")
    assert len(report.heads) == 8 and report.skipped_calls == 0
    with torch.no_grad():
        inputs = [x, x + model.h[0](x, mask)]
        expected = [_direct(model.h[i], inputs[i], mask, saturation=0.5) for i in range(2)]
    for head in report.heads:
        want = expected[int(head.layer[-1])][head.head]
        assert head.route == ROUTE_SDPA and head.calls == 1
        assert head.rows == want.pop("rows")
        for name, value in want.items():
            assert getattr(head, name) == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
def test_score_moments_never_need_the_score_matrix_and_handle_broadcast_batches(dtype, rtol):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 6, 5, 7, generator=gen).to(dtype)  # (B1, B2=1, H, L, D)
    k = (torch.randn(1, 3, 2, 4, 7, generator=gen) + 2.0).to(dtype)  # (B1=1, B2, Hkv, S, D), mean != 0
    total, total2, pairs = score_moments(q, k, (2, 3))
    qk = q.double() @ k.double().repeat_interleave(3, dim=-3).transpose(-1, -2)  # (2, 3, H, L, S)
    torch.testing.assert_close(total, qk.sum((0, 1, 3, 4)), rtol=rtol, atol=1e-9)
    torch.testing.assert_close(total2, (qk**2).sum((0, 1, 3, 4)), rtol=rtol, atol=1e-9)
    assert total.dtype == torch.float64 and pairs == 2 * 3 * 5 * 4


def test_torch_function_is_restored_after_exit_and_after_an_exception():
    model = Block()
    with attnscale.monitor(model):
        assert F.scaled_dot_product_attention is not TORCH_SDPA
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with pytest.raises(KeyError, match="boom"):
        with attnscale.monitor(model):
            model(torch.randn(1, 4, 48))
            raise KeyError("boom")
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_an_exception_inside_the_model_keeps_the_module_stack_consistent():
    model = Block()
    with attnscale.monitor(model) as mon, torch.no_grad():
        with pytest.raises(RuntimeError):
            model(torch.randn(1, 4, 47))  # wrong width: fails inside h.0
        assert mon.current_layer() is None
        model(torch.randn(1, 4, 48))
    assert [h.calls for h in mon.report().heads] == [1] * 8


def test_nesting_and_misuse_are_rejected_clearly():
    a, b = Block(), Block()
    with attnscale.monitor(a) as mon:
        with pytest.raises(RuntimeError, match="already active; nesting is not supported"):
            attnscale.monitor(b).start()
        with pytest.raises(RuntimeError, match="this monitor is already active"):
            mon.start()
    with pytest.raises(RuntimeError, match="not active"):
        mon.stop()
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        attnscale.monitor(F.scaled_dot_product_attention)
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_training_loop_api_keeps_gradients_and_accumulates_calls():
    model = Block()
    x = torch.randn(2, 6, 48)
    grads = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    mon = attnscale.monitor(model).start()
    try:
        for _ in range(2):
            monitored = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
        assert mon.report().heads[0].calls == 2
        mon.reset()
        model(x)
    finally:
        report = mon.stop()
    for g, m in zip(grads, monitored):
        torch.testing.assert_close(m, g, atol=1e-5, rtol=1e-4)
    assert report.heads[0].calls == 1


def test_training_statistics_see_non_finite_values_as_inference_does():
    # In a training step the statistics come from a call without v (width 0); the rows a NaN or
    # inf value makes NaN must still get NaN statistics, as in one call with v.
    from attnscale.diagnostics.monitor import ROUTE_SDPA

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    v[0, 1, 3, 2] = math.nan  # seen by rows 3.. of batch 0, head 1 (causal)
    v[1, 2, 6, 0] = math.inf
    mon = attnscale.monitor(Block())
    with torch.no_grad():
        _, expected = mon.attend("x", ROUTE_SDPA, q, k, v, is_causal=True)
    _, got = mon.attend("x", ROUTE_SDPA, q.requires_grad_(), k, v, is_causal=True)
    assert expected.lse.isnan().sum() == 6 + 3  # the rows that see a non-finite value
    for name in ("lse", "max_logit", "max_prob", "entropy", "visible_keys"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=0, atol=0, equal_nan=True, msg=name)


def test_forwards_in_several_threads_are_attributed_to_their_own_layers():
    model = Block()
    x = torch.randn(2, 6, 48)
    def forward():
        with torch.no_grad():  # grad mode is per thread; with gradients the output would come from another kernel
            model(x)

    with attnscale.monitor(model) as mon:
        threads = [threading.Thread(target=forward) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report = mon.report()
    assert report.layers == ("h.0", "h.1") and {h.calls for h in report.heads} == {4}
    with attnscale.monitor(model) as once, torch.no_grad():
        model(x)
    for a, b in zip(report.heads, once.report().heads):
        assert a.rows == 4 * b.rows and a.max_logit == b.max_logit
        assert a.entropy == pytest.approx(b.entropy, rel=1e-12)


def test_calls_outside_the_model_and_inputs_attnscale_refuses_go_to_torch():
    class TwoDims(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q)  # (L, D): torch accepts it, attnscale does not

    model = TwoDims()
    q = torch.randn(5, 8)
    with attnscale.monitor(model) as mon:
        out = model(q)
        F.scaled_dot_product_attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    torch.testing.assert_close(out, TORCH_SDPA(q, q, q))
    report = mon.report()
    assert report.heads == () and report.skipped_calls == 1


def test_multihead_attention_is_seen_only_when_it_calls_the_function():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 5, 32)
    with attnscale.monitor(mha) as mon:
        mha(x, x, x)  # need_weights=True (default): softmax computed by MultiheadAttention itself
        assert mon.report().heads == ()
        out, _ = mha(x, x, x, need_weights=False)  # training mode: goes through the function
    expected, _ = mha(x, x, x, need_weights=False)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert [h.layer for h in mon.report().heads] == ["MultiheadAttention"] * 4
    mha.eval()
    with attnscale.monitor(mha) as mon, torch.no_grad():
        mha(x, x, x, need_weights=False)  # inference fast path: a fused kernel, not the function
    assert mon.report().heads == ()


class Fixed(nn.Module):
    """Three heads with chosen logits: one-hot, uniform, and ordinary with one row whose logit is huge."""

    def forward(self, _):
        L = D = 16
        gen = torch.Generator().manual_seed(0)
        q = torch.stack([torch.eye(L) * 40.0, torch.zeros(L, D), torch.randn(L, D, generator=gen)])  # (H, L, D)
        k = torch.stack([torch.eye(L) * 40.0, torch.randn(L, D, generator=gen), torch.randn(L, D, generator=gen)])
        q[2, 0] = k[2, 0] * 60.0  # logit 60 * |k_0|^2 / 4, far above 100
        return F.scaled_dot_product_attention(q[None], k[None], torch.randn(1, 3, L, D, generator=gen))


def test_flags_trigger_on_saturated_uniform_and_large_logit_heads():
    model = Fixed()
    with attnscale.monitor(model) as mon:
        model(None)
    report = mon.report()
    assert {(f.head, f.kind) for f in report.flags} == {(0, "saturated"), (0, "max_logit"), (1, "uniform"), (2, "max_logit")}
    one_hot, uniform, ordinary = report.heads
    assert one_hot.saturated_share == 1.0 and one_hot.max_logit == pytest.approx(400.0)
    assert uniform.normalized_entropy == pytest.approx(1.0) and uniform.max_prob == pytest.approx(1 / 16)
    assert 0.3 < ordinary.normalized_entropy < 0.98 and ordinary.saturated_share < 0.5
    assert "QK-Clip" in next(f.reason for f in report.flags if f.kind == "max_logit")
    relaxed = MonitorReport.from_heads(report.heads, MonitorThresholds(max_logit=1e6))
    assert {(f.head, f.kind) for f in relaxed.flags} == {(0, "saturated"), (1, "uniform")}


def test_low_mean_entropy_alone_flags_saturation():
    head = HeadReport("x", 0, ROUTE_SDPA, 1, 10, 1.0, 1.0, 5.0, 0.01, 0.01, 0.98, 0.2)
    (flag,) = MonitorReport.from_heads([head], MonitorThresholds()).flags
    assert flag.kind == "saturated" and "normalised entropy 0.010 < 0.05" in flag.reason


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        (dict(saturation_prob=1.0), ValueError, r"saturation_prob: expected a float in \(0, 1\)"),
        (dict(max_logit=-1.0), ValueError, "max_logit: expected a finite float > 0"),
        (dict(max_logit="100"), TypeError, "max_logit: expected a float"),
        (dict(low_entropy=0.99), ValueError, "low_entropy: expected a value below uniform_entropy"),
        (dict(saturated_share=True), TypeError, "saturated_share: expected a float"),
    ],
)
def test_thresholds_are_validated(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        MonitorThresholds(**kwargs)


def _report() -> MonitorReport:
    model = Block(layers=3)
    with attnscale.monitor(model, thresholds=MonitorThresholds(max_logit=0.7)) as mon, torch.no_grad():
        model(torch.randn(2, 7, 48))
    return mon.report()


def test_json_and_csv_round_trip(tmp_path):
    report = _report()
    assert report.flags  # max_logit=0.7 flags some heads, so flags take part in the round trip
    assert MonitorReport.from_json(report.to_json()) == report
    assert json.loads(report.to_json())["schema"] == "attnscale.monitor/1"
    assert read_csv(report.to_csv()) == report.heads
    paths = report.save(tmp_path)
    assert MonitorReport.from_json(paths["json"].read_text()) == report
    assert read_csv(paths["csv"].read_text()) == report.heads
    assert paths["svg"].read_text().lstrip().startswith("<?xml")
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="schema"):
        MonitorReport.from_dict({"schema": "other"})
    with pytest.raises(ValueError, match="header"):
        read_csv("a,b\n1,2\n")


def test_none_survives_csv_and_json():
    head = HeadReport("x", 0, ROUTE_SDPA, 1, 0, None, None, None, None, None, None, None)
    report = MonitorReport.from_heads([head], MonitorThresholds())
    assert read_csv(report.to_csv()) == (head,) and MonitorReport.from_json(report.to_json()) == report


def test_table_heatmap_and_layer_summaries():
    from matplotlib.figure import Figure
    from rich.console import Console

    report = _report()
    console = Console(width=200, record=True)
    console.print(report.table())
    text = console.export_text()
    assert "layer = h.*" in text and "S_max" in text and "max_logit" in text
    fig = report.heatmap()
    assert isinstance(fig, Figure) and len(fig.axes) == 4  # two heatmaps and their colorbars
    summaries = report.layer_summaries()
    assert [s.layer for s in summaries] == ["h.0", "h.1", "h.2"]
    first = [h for h in report.heads if h.layer == "h.0"]
    assert summaries[0].max_logit == max(h.max_logit for h in first)
    assert summaries[0].normalized_entropy == pytest.approx(sum(h.normalized_entropy for h in first) / 4)


class TwoHeadCounts(nn.Module):
    """One module that calls attention twice per forward, with 4 heads and then with 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.reshape(x.shape[0], 2, -1, x.shape[-1])  # (B, 2, 2 L, D)
        return F.scaled_dot_product_attention(x, x, x).sum() + F.scaled_dot_product_attention(y, y, y).sum()


def test_a_layer_called_with_another_head_count_runs_unrecorded_with_one_warning():
    model, x = TwoHeadCounts(), torch.randn(1, 4, 6, 8, generator=torch.Generator().manual_seed(0))
    want = model(x)
    with pytest.warns(RuntimeWarning, match=r"^attnscale.monitor: a call of 'TwoHeadCounts' was not recorded: it was called with 4 heads before and 2 now") as caught:
        with attnscale.monitor(model) as mon:
            outs = [model(x) for _ in range(3)]
    assert len(caught) == 1  # once per layer and reason, not once per call
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    report = mon.report()
    assert report.skipped_calls == 3 and {h.calls for h in report.heads} == {3} and len(report.heads) == 4


def test_inference_mode_then_training_in_one_monitor():
    mha = attnscale.MultiHeadAttention(32, num_heads=4)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    with attnscale.monitor(mha) as mon:
        with torch.inference_mode():
            mha(x)
        mha(x).square().sum().backward()  # raised "Inplace update to inference tensor outside InferenceMode"
        with torch.inference_mode():
            mha(x)
    assert [h.calls for h in mon.report().heads] == [3, 3, 3, 3]
    assert all(p.grad is not None for p in mha.parameters())


def test_a_statistics_call_that_fails_leaves_the_models_result_and_warns(monkeypatch):
    import attnscale.diagnostics.monitor.recording as recording

    model, x = TwoHeadCounts(), torch.randn(1, 4, 6, 8, generator=torch.Generator().manual_seed(2))
    want = model(x)
    real = recording.scaled_dot_product_attention

    def no_statistics(*args, **kwargs):
        if kwargs.get("return_stats"):
            raise MemoryError("no room for statistics")
        return real(*args, **kwargs)

    monkeypatch.setattr(recording, "scaled_dot_product_attention", no_statistics)
    with pytest.warns(RuntimeWarning, match=r"its statistics call failed \(MemoryError: no room for statistics\)"):
        with attnscale.monitor(model) as mon:
            got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert mon.report().heads == () and mon.report().skipped_calls == 2


def test_a_monitored_model_can_be_copied_pickled_saved_and_averaged():
    """While the monitor is attached: deepcopy, pickle, torch.save of the whole model and
    AveragedModel (EMA) work (the hooks held the monitor and its locks), and a copy's forward
    records nothing under the original's names."""
    import copy
    import io
    import pickle

    model = Block()
    x = torch.randn(2, 5, 48)
    with attnscale.monitor(model) as mon:
        clone = copy.deepcopy(model)
        restored = pickle.loads(pickle.dumps(model))
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        ema = torch.optim.swa_utils.AveragedModel(model)
        for other in (clone, restored, loaded, ema):
            torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
        mon.reset()
        for other in (clone, restored, loaded, ema):
            other(x)
        assert not mon.report().heads  # the copies' calls are nobody's
        model(x)
        assert {h.calls for h in mon.report().heads} == {1}


def test_activation_checkpointing_records_each_call_once():
    """With gradient checkpointing the forward runs again inside backward: that recompute is not
    recorded a second time (each head counted calls=2 before)."""
    from torch.utils.checkpoint import checkpoint

    model = Block()
    x = torch.randn(2, 5, 48, requires_grad=True)
    with attnscale.monitor(model) as mon:
        y = x
        for layer in model.h:
            y = y + checkpoint(layer, y, use_reentrant=False)
        y.sum().backward()
        heads = mon.report().heads
    assert heads and {h.calls for h in heads} == {1}
    assert x.grad is not None and torch.isfinite(x.grad).all()
