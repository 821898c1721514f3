"""Stacks of models (attnscale.lab.grouped) and training seeds together (train_seeds) against
models and training loops that know nothing of stacking, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnscale import AttentionConfig
from attnscale.variants import QKNorm
from attnscale.lab import grouped
from attnscale.lab.tasks import MQAR
from attnscale.lab.training import (
    ModelConfig,
    TemperedLinear,
    TinyTransformer,
    TrainConfig,
    evaluate,
    init_logit_std,
    qk_clip,
    train,
    train_seeds,
)

TASK = MQAR(context=4, queries=2, n_keys=4, n_values=4)
METRICS = ("accuracy", "loss", "max_logit", "entropy", "saturated", "max_prob", "source_prob")


@pytest.fixture
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Linear(5, 3),
        lambda: nn.Linear(5, 3, bias=False),
        lambda: nn.LayerNorm(5),
        lambda: TemperedLinear(5, 2, 3),
    ],
    ids=["linear", "linear-no-bias", "layernorm", "tempered"],
)
def test_a_stack_computes_each_member(float64, make):
    torch.manual_seed(0)
    layers = [make() for _ in range(3)]
    with torch.no_grad():  # away from the initial values, so every parameter matters
        for layer in layers:
            for p in layer.parameters():
                p.add_(torch.randn_like(p))
    x = torch.randn(3 * 4, 2, 5)  # member g's rows are 4g .. 4g + 3
    out = grouped.stack(layers)(x)
    want = torch.cat([layer(x[4 * g : 4 * g + 4]) for g, layer in enumerate(layers)])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-13)


def test_a_stack_of_embeddings_and_qknorm(float64):
    torch.manual_seed(0)
    tables = [nn.Embedding(7, 4) for _ in range(2)]
    ids = torch.randint(0, 7, (2 * 3, 5))
    want = torch.cat([t(ids[3 * g : 3 * g + 3]) for g, t in enumerate(tables)])
    torch.testing.assert_close(grouped.stack(tables)(ids), want, rtol=0, atol=0)
    norms = [QKNorm(4, kind=kind, scale="learned", scale_init=1.5) for kind in ("layer", "layer")]
    with torch.no_grad():
        for n in norms:
            for p in n.parameters():
                p.add_(torch.randn_like(p))
    q, k = torch.randn(2 * 3, 2, 5, 4), torch.randn(2 * 3, 2, 6, 4)
    got_q, got_k = grouped.stack(norms)(q, k)
    for g, n in enumerate(norms):
        want_q, want_k = n(q[3 * g : 3 * g + 3], k[3 * g : 3 * g + 3])
        torch.testing.assert_close(got_q[3 * g : 3 * g + 3], want_q, rtol=0, atol=1e-14)
        torch.testing.assert_close(got_k[3 * g : 3 * g + 3], want_k, rtol=0, atol=1e-14)


def test_stack_refuses_what_it_cannot_group():
    with pytest.raises(TypeError, match="cannot group 0 .Conv1d.*register"):
        grouped.stack([nn.Sequential(nn.Conv1d(2, 2, 1))] * 2)
    with pytest.raises(ValueError, match="same parameters"):
        grouped.stack([nn.Linear(2, 3), nn.Linear(3, 3)])
    with pytest.raises(ValueError, match="at least one"):
        grouped.stack([])
    both = grouped.stack([TinyTransformer(TASK, ModelConfig(d_model=8, head_dim=4)) for _ in range(2)])
    batch = TASK.sample(2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="plain model"):
        evaluate(both, batch)
    with pytest.raises(ValueError, match="plain model"):
        init_logit_std(both, batch)


def _reference(model_cfg: ModelConfig, cfg: TrainConfig, seed: int) -> tuple[TinyTransformer, list[tuple[int, object]], int]:
    """The training loop on one plain model, written out without stacks: each logged (step, Eval),
    and QK-Clip's count."""
    torch.manual_seed(seed)
    model = TinyTransformer(TASK, model_cfg)
    data = torch.Generator().manual_seed(seed)
    held_out = TASK.sample(cfg.eval_batch, torch.Generator().manual_seed(seed + 10**6))
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if cfg.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    logged, clipped = [(0, evaluate(model, held_out))], 0
    for step in range(1, cfg.steps + 1):
        batch = TASK.sample(cfg.batch, data)
        logits, seen = model.forward_all_rows(batch, stats=cfg.qk_clip is not None)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if cfg.qk_clip is not None:
            clipped += qk_clip(model, [out.stats.max_logit.amax(dim=(0, 2)) for out in seen], cfg.qk_clip)
        if step % cfg.log_every == 0 or step == cfg.steps:
            ev = evaluate(model, held_out)
            logged.append((step, ev))
            if cfg.stop_at is not None and ev.accuracy >= cfg.stop_at:
                break
    return model, logged, clipped


CASES = {
    # early stops at different steps, so seeds leave the stack one by one
    "adamw-early-stop": (ModelConfig(d_model=16, head_dim=8), TrainConfig(steps=200, batch=16, log_every=10, eval_batch=32, stop_at=0.6, lr=1e-2)),
    "sgd-temperature-2-layers": (
        ModelConfig(d_model=16, num_heads=2, head_dim=8, layers=2, learned_temperature=True, divisor="1"),
        TrainConfig(steps=40, batch=8, log_every=10, eval_batch=16, optimizer="sgd", lr=0.1, stop_at=None),
    ),
    "qk-norm": (ModelConfig(d_model=16, num_heads=2, head_dim=8, attention=AttentionConfig(qk_norm="rms")), TrainConfig(steps=40, batch=8, log_every=10, eval_batch=16)),
    "softcap-qk-clip": (
        ModelConfig(d_model=16, num_heads=2, head_dim=8, attention=AttentionConfig(softcap=5.0)),
        TrainConfig(steps=40, batch=8, log_every=10, eval_batch=16, qk_clip=1.0, lr=1e-2, stop_at=None),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_train_seeds_is_each_seed_trained_alone(float64, case):
    """Float64. Measured: relative to max(1, |value|), at most 3.3e-11 on any logged metric or final
    parameter (AdamW at lr 1e-2 for 50 steps: one batched product's rounding against separate
    products', grown by training), 1e-15 where training is short and gentle; bound 1e-10 + 1e-10 |value|."""
    model_cfg, cfg = CASES[case]
    seeds = [0, 1, 2, 3]
    together = train_seeds(TASK, model_cfg, cfg, seeds)
    ends = set()
    for seed, (model, log) in zip(seeds, together, strict=True):
        want_model, logged, clipped = _reference(model_cfg, cfg, seed)
        assert log.steps == [s for s, _ in logged]
        ends.add(log.steps[-1])
        for name in METRICS:
            torch.testing.assert_close(getattr(log, name), [getattr(ev, name) for _, ev in logged], rtol=1e-10, atol=1e-10)
        assert log.clipped_heads == clipped
        want = dict(want_model.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, want[name], rtol=1e-10, atol=1e-10)
        assert type(model) is TinyTransformer and grouped.groups(model) == 1
    if case == "adamw-early-stop":
        assert len(ends) > 1, "the seeds should stop at different steps"
    if case == "softcap-qk-clip":
        assert min(log.clipped_heads for _, log in together) > 0


def test_train_is_one_seed_of_train_seeds():
    model_cfg, cfg = CASES["adamw-early-stop"]
    _, alone = train(TASK, model_cfg, cfg, 2)
    _, together = train_seeds(TASK, model_cfg, cfg, [1, 2])[1]
    assert alone.steps == together.steps
    torch.testing.assert_close(alone.loss, together.loss, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="at least one seed"):
        train_seeds(TASK, model_cfg, cfg, [])
