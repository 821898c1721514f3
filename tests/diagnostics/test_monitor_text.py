"""print(report) shows the monitor's table as text, not an object's repr."""

import torch

import attnscale


def test_printing_a_report_shows_its_table():
    torch.manual_seed(0)
    model = attnscale.MultiHeadAttention(64, num_heads=4)
    with attnscale.monitor(model) as mon:
        model(torch.randn(2, 10, 64))
    text = str(mon.report())
    assert "object at 0x" not in text
    assert "S_max" in text and text.count("MultiHeadAttention") == 4  # one row per head


def test_heatmap_uses_a_log_colour_scale_when_max_logits_span_orders_of_magnitude():
    from matplotlib.colors import LogNorm

    torch.manual_seed(0)
    model = attnscale.MultiHeadAttention(64, num_heads=4, bias=False)
    with torch.no_grad():
        model.q_proj.weight[:16] *= 60.0  # head 0's queries: logits far above the other heads'
        model.k_proj.weight[:16] *= 60.0
    with attnscale.monitor(model) as mon:
        model(torch.randn(2, 10, 64))
    report = mon.report()
    logits = sorted(h.max_logit for h in report.heads)
    assert logits[-1] > 10 * logits[0] > 0
    image = report.heatmap().axes[1].images[0]  # the max-logit panel
    assert isinstance(image.norm, LogNorm)
