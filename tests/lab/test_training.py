import dataclasses
import math

import pytest
import torch

import attnscale
from attnscale import AttentionConfig
from attnscale.lab.tasks import MQAR, PointerCopy, oracle_predictions
from attnscale.lab.training import (
    ModelConfig,
    TemperedLinear,
    TinyTransformer,
    TrainConfig,
    evaluate,
    init_logit_std,
    median_steps,
    qk_clip,
    train,
)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


TASKS = [
    MQAR(context=5, queries=7, n_keys=5, n_values=3),
    MQAR(context=16, queries=8, n_keys=32, n_values=32),
    PointerCopy.of(context=9, queries=4, n_values=11),
]


@pytest.mark.parametrize("task", TASKS, ids=repr)
def test_generator_is_deterministic_and_independent_of_the_global_generator(task):
    a = task.sample(16, gen(3))
    torch.manual_seed(123)
    torch.rand(10)
    b = task.sample(16, gen(3))
    c = task.sample(16, gen(4))
    for name in ("keys", "values", "targets", "sources"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.values, c.values)


@pytest.mark.parametrize("task", TASKS, ids=repr)
def test_layout_and_oracle_solves_every_query(task):
    b = task.sample(64, gen(0))
    S, Q = task.context, task.queries
    assert b.keys.shape == b.values.shape == (64, S + Q)
    assert b.targets.shape == b.sources.shape == (64, Q)
    assert bool((b.values[:, S:] == task.n_values).all()), "query positions carry the blank value"
    assert int(b.values[:, :S].max()) < task.n_values and int(b.keys.max()) < task.key_vocab
    assert torch.equal(oracle_predictions(task, b), b.targets)
    assert torch.equal(b.values[:, :S].gather(1, b.sources), b.targets)


def test_mqar_keys_are_distinct_and_queries_ask_for_present_keys():
    task = MQAR(context=12, queries=20, n_keys=12, n_values=4)
    b = task.sample(32, gen(1))
    ctx = b.keys[:, :12]
    assert torch.equal(ctx.sort(dim=-1).values, torch.arange(12).expand(32, 12)), "a permutation of all keys"
    assert torch.equal(ctx.gather(1, b.sources), b.keys[:, 12:])


def test_a_query_alone_gives_no_information():
    # the targets are uniform over values whatever the query's key: only attention can answer
    task = MQAR(context=4, queries=4, n_keys=8, n_values=4)
    b = task.sample(4000, gen(2))
    counts = torch.bincount(b.targets[b.keys[:, 4:] == 0], minlength=4).float()
    assert (counts / counts.sum() - 0.25).abs().max() < 0.05


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: MQAR(context=9, queries=2, n_keys=8, n_values=4), "n_keys"),
        (lambda: MQAR(context=0, queries=2, n_keys=8, n_values=4), "context"),
        (lambda: PointerCopy(context=4, queries=2, n_keys=4, n_values=4), "PointerCopy.of"),
        (lambda: ModelConfig(divisor="2"), "divisor"),
        (lambda: ModelConfig(head_dim=0), "head_dim"),
        (lambda: MQAR(context=2, queries=2, n_keys=4, n_values=4).sample(0, gen(0)), "batch"),
        (lambda: ModelConfig(attention=AttentionConfig(scale="none")), "divisor"),
        (lambda: TrainConfig(optimizer="adam"), "optimizer"),
        (lambda: TrainConfig(qk_clip=0.0), "qk_clip"),
        (
            lambda: train(TASKS[0], ModelConfig(attention=AttentionConfig(qk_norm="rms")), TrainConfig(qk_clip=5.0), seed=0),
            "QK-norm",
        ),
    ],
)
def test_bad_sizes_are_rejected_with_a_fix(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(("divisor", "scale"), [("1", 1.0), ("sqrt", 1 / 8), ("dk", 1 / 64)])
def test_model_is_built_on_attnscale_multihead_attention_with_the_divisor(divisor, scale):
    model = TinyTransformer(TASKS[1], ModelConfig(head_dim=64, divisor=divisor))
    attn = model.blocks[0].attn
    assert isinstance(attn, attnscale.MultiHeadAttention)
    assert attn.scale == pytest.approx(scale)


def test_divisor_override_changes_only_that_call():
    task = TASKS[1]
    torch.manual_seed(0)
    model = TinyTransformer(task, ModelConfig(head_dim=16))
    b = task.sample(32, gen(0))
    trained = evaluate(model, b)
    assert evaluate(model, b, divisor=4.0) == trained
    removed = evaluate(model, b, divisor=1.0)
    assert removed.max_logit == pytest.approx(4 * trained.max_logit, rel=1e-5)
    assert model.blocks[0].attn.scale == 0.25
    assert evaluate(model, b) == trained


def test_stats_match_the_weights():
    task = TASKS[1]
    torch.manual_seed(0)
    model = TinyTransformer(task, ModelConfig(head_dim=32, num_heads=2, qk_init_gain=3.0))
    b = task.sample(32, gen(0))
    _, seen = model(b, watch=True)
    p = seen[0].weights  # (B, H, Q, S)
    assert p.shape == (32, 2, task.queries, task.context)
    torch.testing.assert_close(seen[0].stats.max_prob, p.amax(-1), rtol=1e-5, atol=1e-6)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    torch.testing.assert_close(seen[0].stats.entropy, entropy, rtol=1e-4, atol=1e-5)
    ev = evaluate(model, b)
    assert ev.saturated == pytest.approx((p.amax(-1) > 0.99).float().mean().item())
    assert ev.source_prob == pytest.approx(p.gather(-1, b.sources[:, None, :, None].expand(-1, 2, -1, 1)).mean().item(), rel=1e-5)


def test_two_layer_model_reports_query_rows_of_every_layer():
    task = TASKS[1]
    model = TinyTransformer(task, ModelConfig(head_dim=16, layers=2))
    logits, seen = model(task.sample(8, gen(0)), watch=True)
    assert logits.shape == (8, task.queries, task.n_values)
    assert [s.stats.max_prob.shape for s in seen] == [(8, 1, task.queries)] * 2


def test_init_logit_std_follows_the_default_linear_init():
    # nn.Linear's default init gives q components of variance 1/3 of the (LayerNorm'd) input's
    task = MQAR(context=16, queries=8, n_keys=32, n_values=8)
    b = task.sample(256, gen(0))
    torch.manual_seed(0)
    default = init_logit_std(TinyTransformer(task, ModelConfig(d_model=128, head_dim=128, divisor="1")), b)
    torch.manual_seed(0)
    unit = init_logit_std(TinyTransformer(task, ModelConfig(d_model=128, head_dim=128, divisor="1", qk_init_gain=math.sqrt(3))), b)
    assert default["q_component_var"] == pytest.approx(1 / 3, rel=0.15)
    assert unit["q_component_var"] == pytest.approx(1.0, rel=0.15)
    assert unit["raw"] == pytest.approx(3 * default["raw"], rel=0.02)  # the biases are not scaled
    assert unit["raw"] == pytest.approx(math.sqrt(128), rel=0.25)


def test_learned_temperature_starts_as_the_fixed_model_and_is_trained():
    task = TASKS[2]
    b = task.sample(16, gen(0))
    torch.manual_seed(0)
    fixed = TinyTransformer(task, ModelConfig(head_dim=16, num_heads=2))
    torch.manual_seed(0)
    learned = TinyTransformer(task, ModelConfig(head_dim=16, num_heads=2, learned_temperature=True))
    q_proj = learned.blocks[0].attn.q_proj
    assert isinstance(q_proj, TemperedLinear)
    torch.testing.assert_close(learned(b)[0], fixed(b)[0], rtol=0, atol=0)
    with torch.no_grad():
        q_proj.log_temperature.copy_(torch.tensor([math.log(2.0), 0.0]))
    x = torch.randn(3, learned.cfg.d_model)
    out = q_proj(x).unflatten(-1, (2, 16))
    plain = torch.nn.functional.linear(x, q_proj.weight, q_proj.bias).unflatten(-1, (2, 16))
    torch.testing.assert_close(out[:, 0], 2 * plain[:, 0])
    torch.testing.assert_close(out[:, 1], plain[:, 1])

    model, _ = train(task, ModelConfig(head_dim=16, learned_temperature=True), TrainConfig(steps=20, stop_at=None), seed=0)
    assert model.blocks[0].attn.q_proj.log_temperature.item() != 0.0


def test_training_is_deterministic_under_a_seed():
    task = MQAR(context=4, queries=4, n_keys=8, n_values=8)
    cfg, tc = ModelConfig(head_dim=16), TrainConfig(steps=20, log_every=5, eval_batch=32, stop_at=None)
    _, a = train(task, cfg, tc, seed=5)
    torch.manual_seed(99)
    _, b = train(task, cfg, tc, seed=5)
    _, c = train(task, cfg, tc, seed=6)
    assert a.to_dict() == b.to_dict()
    assert a.loss != c.loss
    assert a.steps == [0, 5, 10, 15, 20]


def test_training_with_the_scale_learns_an_easy_recall_task_and_stops_early():
    task = MQAR(context=4, queries=4, n_keys=8, n_values=8)
    calls = []
    _, log = train(
        task,
        ModelConfig(d_model=32, head_dim=16),
        TrainConfig(steps=400, lr=3e-3, eval_batch=128, stop_at=0.97),
        seed=0,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert log.accuracy[0] < 0.3
    assert log.accuracy[-1] >= 0.97
    assert log.steps[-1] < 400, "stopped early"
    assert log.steps_to(0.9) is not None and log.steps_to(0.9) <= log.steps[-1]
    assert calls[-1] == (400, 400)


def test_median_steps_treats_never_as_slowest():
    assert median_steps([10, None, 30]) == 30
    assert median_steps([None, None, 30]) is None
    assert median_steps([]) is None


def head_max_logits(model: TinyTransformer, batch) -> list[torch.Tensor]:
    _, seen = model.forward_all_rows(batch, stats=True)
    return [out.stats.max_logit.amax(dim=(0, 2)) for out in seen]


def test_qk_clip_rescales_only_the_heads_above_tau_in_every_layer():
    task = TASKS[1]
    torch.manual_seed(0)
    model = TinyTransformer(task, ModelConfig(head_dim=16, num_heads=4, layers=2, qk_init_gain=3.0))
    b = task.sample(32, gen(0))
    before = head_max_logits(model, b)
    assert [m.shape for m in before] == [(4,), (4,)]
    tau = torch.cat(before).median().item()
    v_before = model.blocks[0].attn.v_proj.weight.clone()
    first = [m.clone() for m in before]
    clipped = qk_clip(model, before, tau)
    assert clipped == int(sum((m > tau).sum() for m in first))
    layer0 = head_max_logits(model, b)[0]  # the first layer's input does not depend on any q/k weight
    torch.testing.assert_close(layer0, torch.minimum(first[0], torch.tensor(tau)), rtol=1e-5, atol=1e-5)
    assert torch.equal(model.blocks[0].attn.v_proj.weight, v_before)


def test_qk_clip_in_training_holds_the_logits_that_grow_without_it():
    task = MQAR(context=8, queries=4, n_keys=16, n_values=16)
    model_cfg = ModelConfig(d_model=32, num_heads=2, head_dim=32)
    tc = TrainConfig(steps=60, batch=32, lr=5e-2, log_every=20, eval_batch=64, stop_at=None)
    _, free = train(task, model_cfg, tc, seed=0)
    _, clipped = train(task, model_cfg, dataclasses.replace(tc, qk_clip=20.0), seed=0)
    assert free.clipped_heads == 0 and clipped.clipped_heads > 0
    assert max(free.max_logit) > 10 * 20.0
    # the clip uses the step's own batch and precedes the next update, so held-out logits overshoot a little
    assert max(clipped.max_logit) < 1.5 * 20.0


def test_sgd_optimizer_trains_without_adam_and_forward_all_rows_matches_forward():
    task = MQAR(context=4, queries=4, n_keys=8, n_values=8)
    cfg = ModelConfig(d_model=32, head_dim=16, layers=2)
    tc = TrainConfig(steps=10, log_every=5, eval_batch=32, stop_at=None, optimizer="sgd", lr=0.1, weight_decay=0.0)
    model, log = train(task, cfg, tc, seed=0)
    _, adam = train(task, cfg, TrainConfig(steps=10, log_every=5, eval_batch=32, stop_at=None), seed=0)
    assert log.loss != adam.loss and log.steps == [0, 5, 10]
    b = task.sample(8, gen(1))
    logits, seen = model(b, watch=True)
    all_logits, all_rows = model.forward_all_rows(b, stats=True)
    torch.testing.assert_close(logits, all_logits)
    assert all_rows[0].stats.max_logit.shape == (8, 1, task.length) and all_rows[0].weights is None
    torch.testing.assert_close(seen[0].stats.max_logit, all_rows[0].stats.max_logit[..., task.context :])


@pytest.mark.parametrize("attention", [AttentionConfig(qk_norm="rms"), AttentionConfig(softcap=5.0)], ids=["qk-norm", "softcap"])
def test_model_attention_variant_is_used(attention):
    task = TASKS[1]
    torch.manual_seed(0)
    model = TinyTransformer(task, ModelConfig(head_dim=16, qk_init_gain=4.0, attention=attention))
    assert model.blocks[0].attn.config.qk_norm == attention.qk_norm
    assert model.blocks[0].attn.scale == pytest.approx(0.25)
    ev = evaluate(model, task.sample(32, gen(0)))
    if attention.softcap is not None:
        assert ev.max_logit <= 5.0
    else:
        assert ev.max_logit <= 16**0.5 + 1e-4  # rms-normalised q.k / sqrt(D) is at most sqrt(D) at unit gains
