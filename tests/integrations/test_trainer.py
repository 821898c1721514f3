"""MonitorCallback in a real transformers Trainer run on a tiny random BERT: the monitor's statistics
arrive through the Trainer's own logging, and an alert with stop=True ends training."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnscale[trainer]')")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install 'attnscale[trainer]')")

from attnscale.diagnostics.monitor import AlertRules  # noqa: E402
from attnscale.integrations.trainer import MonitorCallback  # noqa: E402


class Logs(transformers.TrainerCallback):
    """What every other reporting callback receives from trainer.log."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


def _trainer(tmp_path, steps):
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32, num_labels=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (12,), generator=gen), "labels": torch.tensor(i % 2)} for i in range(32)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, logging_steps=1000, report_to="none",
        use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=data)


def test_statistics_reach_the_trainers_logging(tmp_path):
    trainer = _trainer(tmp_path, steps=5)
    callback, logs = MonitorCallback(trainer, every=2), Logs()
    trainer.add_callback(callback)
    trainer.add_callback(logs)
    trainer.train()
    history = callback.monitor.history
    assert [r.step for r in history] == [0, 2, 4] and not callback.monitor.active
    attention = [(step, log) for step, log in logs.logs if any(k.startswith("attention/") for k in log)]
    assert [step for step, _ in attention] == [1, 3, 5]  # logged at the end of optimizer steps 0, 2, 4
    for record, (_, log) in zip(history, attention):
        scalars = record.scalars()
        assert {k: log[k] for k in scalars} == scalars
        assert {h.layer for h in record.heads} == {f"bert.encoder.layer.{i}.attention.self" for i in range(2)}
    assert sum(any(k.startswith("attention/") for k in e) for e in trainer.state.log_history) == 3


def test_an_alert_with_stop_ends_training(tmp_path):
    trainer = _trainer(tmp_path, steps=6)
    fired = []
    callback = MonitorCallback(trainer, every=1, alerts=AlertRules(max_logit=1e-3, stop=True), on_alert=fired.append)
    trainer.add_callback(callback)
    trainer.train()
    assert trainer.state.global_step == 1 and fired and all(a.step == 0 for a in fired)


def test_options_are_checked_when_the_callback_is_made(tmp_path):
    trainer = _trainer(tmp_path, steps=1)
    with pytest.raises(ValueError, match="every: expected an int >= 1"):
        MonitorCallback(trainer, every=0)
    with pytest.raises(TypeError, match="trainer: expected a transformers Trainer"):
        MonitorCallback(object())
