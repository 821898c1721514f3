"""TensorBoardWriter: every statistic of every head becomes a scalar at the record's step, read back
from the event files with TensorBoard's own reader."""

import pytest
import torch

pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'attnscale[tensorboard]')")

import attnscale  # noqa: E402
from attnscale.integrations.tensorboard import TensorBoardWriter  # noqa: E402


def test_scalars_round_trip_through_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    mha = attnscale.MultiHeadAttention(16, num_heads=2)
    writer = TensorBoardWriter(tmp_path)
    with attnscale.monitor(mha, every=2, writers=[writer]) as mon, torch.no_grad():
        for _ in range(3):
            mha(torch.randn(2, 5, 16))
            mon.step()
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    expected = {}
    for record in mon.history:
        for tag, value in record.scalars().items():
            expected.setdefault(tag, []).append((record.step, value))
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in points]


def test_log_dir_must_be_a_folder_or_a_summary_writer():
    with pytest.raises(TypeError, match="log_dir: expected a folder or a torch.utils.tensorboard.SummaryWriter"):
        TensorBoardWriter(3)
