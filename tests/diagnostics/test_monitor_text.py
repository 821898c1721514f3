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
