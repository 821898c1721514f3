"""A tiny transformer for the lab's synthetic tasks, and the training loop that watches its attention.

The model (pre-LN, ``layers`` blocks of attention + MLP, attnscale's own
:class:`~attnscale.MultiHeadAttention`) reads the :class:`~attnscale.lab.tasks.RecallBatch`
layout: at each position the key and value embeddings are summed, every position attends to the
context positions only, and a linear head names the value at the query positions.

What the attention divides q.k by is the experiment's knob (:class:`ModelConfig`):

* ``divisor`` - ``"sqrt"`` (``sqrt(D)``, the formula), ``"1"`` (no scale) or ``"dk"`` (``D``, muP);
* ``qk_init_gain`` - multiplies the initial q and k projection weights (``nn.Linear``'s default
  init gives q and k components of variance ``1/3`` of the input's; a gain of ``sqrt(3)`` gives
  the unit-variance components of the textbook argument, 0.1 gives small logits);
* ``learned_temperature`` - a per-head log-scale ``t`` (initialised at 0) multiplies q by ``exp(t)``;
* ``attention`` - an :class:`~attnscale.AttentionConfig` for the variant (QK-norm, softcap); the
  divisor still sets the scale.

:func:`train` runs AdamW (or SGD with momentum, ``TrainConfig.optimizer``) on fresh batches from
a dedicated generator, evaluates every ``log_every`` steps on one fixed held-out batch (accuracy,
loss and, through ``return_stats``, the largest attention logit, mean entropy and share of
saturated rows, ``max_prob > 0.99``) and stops early once held-out accuracy reaches ``stop_at``.
With ``TrainConfig.qk_clip = tau`` it applies QK-Clip (:func:`qk_clip`) after every step.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import AttentionConfig, AttentionKernel, ScaleMode
from ..modules import AttentionOutput, MultiHeadAttention
from ..stats import AttentionStats
from . import grouped
from .base import Progress, no_progress
from .tasks import RecallBatch, Task

__all__ = [
    "SATURATED",
    "Divisor",
    "ModelConfig",
    "RunLog",
    "TemperedLinear",
    "TinyTransformer",
    "TrainConfig",
    "divisor_value",
    "evaluate",
    "init_logit_std",
    "median_steps",
    "qk_clip",
    "train",
    "train_seeds",
]

Divisor = Literal["1", "sqrt", "dk"]
Optimizer = Literal["adamw", "sgd"]
SATURATED = 0.99
"""A softmax row counts as saturated when its largest probability exceeds this."""


def divisor_value(divisor: Divisor, head_dim: int) -> float:
    """What q.k is divided by: ``1``, ``sqrt(D)`` or ``D``."""
    values = {"1": 1.0, "sqrt": math.sqrt(head_dim), "dk": float(head_dim)}
    if divisor not in values:
        raise ValueError(f"divisor must be one of {sorted(values)}; got {divisor!r}.")
    return values[divisor]


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and the scale knob of :class:`TinyTransformer` (``head_dim`` is the d_k)."""

    d_model: int = 64
    num_heads: int = 1
    head_dim: int = 64
    layers: int = 1
    divisor: Divisor = "sqrt"
    qk_init_gain: float = 1.0
    learned_temperature: bool = False
    attention: AttentionConfig | None = None

    def __post_init__(self) -> None:
        divisor_value(self.divisor, self.head_dim)
        for name in ("d_model", "num_heads", "head_dim", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}.")
        if not self.qk_init_gain > 0:
            raise ValueError(f"qk_init_gain must be > 0; got {self.qk_init_gain!r}.")
        attention = self.attention
        if attention is None:
            return
        if not isinstance(attention, AttentionConfig):
            raise TypeError(f"attention must be None or an attnscale.AttentionConfig; got {type(attention).__name__}.")
        if attention.scale is not ScaleMode.INVERSE_SQRT or attention.kernel is not AttentionKernel.SOFTMAX:
            raise ValueError(
                f"attention must keep scale='inverse_sqrt' and kernel='softmax' (the divisor sets the scale and the "
                f"loop reads softmax statistics); got scale={attention.scale.value!r}, kernel={attention.kernel.value!r}. "
                "Set the scale with divisor=..."
            )


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer and loop settings; ``stop_at`` is the held-out accuracy that ends training early.

    ``optimizer`` is ``"adamw"`` (decoupled weight decay) or ``"sgd"`` (heavy-ball ``momentum``,
    weight decay added to the gradient); ``qk_clip`` is QK-Clip's threshold tau (None: off).
    """

    steps: int = 500
    batch: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 20
    log_every: int = 10
    eval_batch: int = 256
    stop_at: float | None = 0.99
    optimizer: Optimizer = "adamw"
    momentum: float = 0.9
    qk_clip: float | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd'; got {self.optimizer!r}.")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1); got {self.momentum!r}.")
        if self.qk_clip is not None and not self.qk_clip > 0:
            raise ValueError(f"qk_clip must be None or a threshold > 0; got {self.qk_clip!r}. Pass e.g. qk_clip=30.0.")


class TemperedLinear(nn.Linear):
    """The q projection with a learned per-head temperature: head ``h``'s output is multiplied by
    ``exp(log_temperature[h])`` (initialised at 0, so the model starts as the fixed-scale one).

    A log-parameter keeps the multiplier positive and makes its updates relative, like a learned
    softmax temperature (Henry et al. 2020 learn the scale of normalised q.k this way).
    """

    def __init__(self, in_features: int, num_heads: int, head_dim: int) -> None:
        super().__init__(in_features, num_heads * head_dim)
        self.head_dim = head_dim
        self.log_temperature = nn.Parameter(torch.zeros(num_heads))

    def forward(self, x: Tensor) -> Tensor:
        gain = self.log_temperature.exp().repeat_interleave(self.head_dim)  # (H * D,), head-major like the q layout
        return super().forward(x) * gain


class _GroupedTemperedLinear(grouped.GroupedLinear):
    """:class:`TemperedLinear` for several members: log-temperatures (G, H)."""

    def __init__(self, layers: list[TemperedLinear]) -> None:
        super().__init__(layers)
        self.head_dim = layers[0].head_dim

    def forward(self, x: Tensor) -> Tensor:
        gain = self.log_temperature.exp().repeat_interleave(self.head_dim, dim=-1)  # (G, H * D)
        out = super().forward(x)  # (G * B, ..., H * D)
        return (out.unflatten(0, (self.groups, -1)) * gain.reshape(self.groups, *([1] * (out.ndim - 1)), -1)).flatten(0, 1)


grouped.register(TemperedLinear, _GroupedTemperedLinear)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.num_heads, head_dim=cfg.head_dim, scale=1.0 / divisor_value(cfg.divisor, cfg.head_dim), config=cfg.attention
        )
        if cfg.learned_temperature:
            # the fixed-scale model's q weights, and no draw from the generator: both arms start equal
            with torch.random.fork_rng(devices=[]):
                tempered = TemperedLinear(cfg.d_model, cfg.num_heads, cfg.head_dim)
            tempered.load_state_dict(self.attn.q_proj.state_dict(), strict=False)
            self.attn.q_proj = tempered
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(
        self, x: Tensor, context: int, *, last: bool, stats: bool, weights: bool
    ) -> tuple[Tensor, AttentionOutput | None]:
        """Every row attends to the ``context`` first positions (keys and values); the last block
        computes the query rows only, since nothing reads the context rows after it."""
        h = self.ln1(x)  # (B, T, d_model)
        if last:
            x, rows = x[:, context:], h[:, context:]  # (B, Q, d_model)
        else:
            rows = h
        memory = h[:, :context]  # (B, S, d_model)
        result = self.attn(rows, memory, memory, return_stats=stats, need_weights=weights)
        seen = result if isinstance(result, AttentionOutput) else None
        x = x + (result.output if seen is not None else result)
        return x + self.mlp(self.ln2(x)), seen


class TinyTransformer(nn.Module):
    """Embeddings, ``layers`` pre-LN blocks of attnscale's :class:`~attnscale.MultiHeadAttention`
    and an MLP, a final LayerNorm and a value classifier read at the query positions."""

    def __init__(self, task: Task, cfg: ModelConfig) -> None:
        super().__init__()
        self.task, self.cfg = task, cfg
        self.key_emb = nn.Embedding(task.key_vocab, cfg.d_model)
        self.value_emb = nn.Embedding(task.value_vocab, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, task.n_values)
        with torch.no_grad():
            for block in self.blocks:
                block.attn.q_proj.weight.mul_(cfg.qk_init_gain)
                block.attn.k_proj.weight.mul_(cfg.qk_init_gain)

    def forward(
        self, batch: RecallBatch, *, divisor: float | None = None, watch: bool = False
    ) -> tuple[Tensor, list[AttentionOutput]]:
        """Value logits at the query positions (B, Q, n_values) and, if ``watch``, each layer's
        :class:`~attnscale.modules.AttentionOutput` of the query rows: stats (B, H, Q), weights
        (B, H, Q, S) over the context positions (an empty list otherwise).

        ``divisor`` overrides every layer's divisor for this call (evaluation with the scale changed).
        """
        logits, seen = self.forward_all_rows(batch, divisor=divisor, stats=watch, weights=watch)
        S, last = self.task.context, len(seen) - 1
        return logits, [out if i == last else _query_rows(out, S) for i, out in enumerate(seen)]

    def forward_all_rows(
        self, batch: RecallBatch, *, divisor: float | None = None, stats: bool = False, weights: bool = False
    ) -> tuple[Tensor, list[AttentionOutput]]:
        """Value logits (B, Q, n_values) and, if ``stats`` or ``weights``, each layer's
        :class:`~attnscale.modules.AttentionOutput` over every row the layer computes: all T rows,
        stats (B, H, T), in the earlier layers, the Q query rows in the last one. QK-Clip reads
        the largest logit of every row from it."""
        x = self.key_emb(batch.keys) + self.value_emb(batch.values)  # (B, T, d_model)
        S, seen = self.task.context, []
        for i, block in enumerate(self.blocks):
            trained = block.attn.scale
            if divisor is not None:
                block.attn.scale = 1.0 / divisor
            try:
                x, out = block(x, S, last=i == len(self.blocks) - 1, stats=stats, weights=weights)
            finally:
                block.attn.scale = trained
            if out is not None:
                seen.append(out)
        return self.head(self.ln_f(x)), seen  # x is (B, Q, d_model) after the last block


def _query_rows(out: AttentionOutput, context: int) -> AttentionOutput:
    """Keep the query positions' rows of a block that computed every row."""
    stats = None
    if out.stats is not None:
        stats = AttentionStats(
            **{f.name: getattr(out.stats, f.name)[..., context:] for f in fields(AttentionStats) if getattr(out.stats, f.name) is not None}
        )
    weights = out.weights[:, :, context:] if out.weights is not None else None
    return AttentionOutput(output=out.output[:, context:], weights=weights, stats=stats)


@dataclass(frozen=True)
class Eval:
    """Held-out metrics of one model state. Attention statistics are over the query rows of all
    layers: the largest logit, the mean entropy (nats), the share of saturated rows and the mean
    largest probability; ``source_prob`` is the first layer's mean weight on the position each
    query must read."""

    accuracy: float
    loss: float
    max_logit: float
    entropy: float
    saturated: float
    max_prob: float
    source_prob: float


def evaluate(model: TinyTransformer, batch: RecallBatch, *, divisor: float | None = None) -> Eval:
    """Accuracy, loss and attention statistics on ``batch`` (no gradients, eval mode)."""
    if grouped.groups(model) != 1:
        raise ValueError("evaluate takes a plain model; a stack of models is evaluated member by member inside train_seeds.")
    return _evaluate(model, batch, divisor=divisor)[0]


def _member_means(x: Tensor, G: int) -> Tensor:
    """(G * B, ...) -> (G,): the mean of each member's rows."""
    return x.reshape(G, -1).mean(dim=1)


def _evaluate(model: nn.Module, batch: RecallBatch, *, divisor: float | None = None) -> list[Eval]:
    """:func:`evaluate` of each member of a (possibly stacked) model, on ``batch``'s rows of that member."""
    G = grouped.groups(model)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits, seen = model(batch, divisor=divisor, watch=True)  # logits (G * B, Q, n_values)
    model.train(was_training)
    stats = [out.stats for out in seen]
    max_prob = torch.stack([s.max_prob for s in stats], dim=1)  # (G * B, layers, H, Q)
    entropy = torch.stack([s.entropy for s in stats], dim=1)  # (G * B, layers, H, Q)
    max_logit = torch.stack([s.max_logit for s in stats], dim=1)  # (G * B, layers, H, Q)
    weights = seen[0].weights  # (G * B, H, Q, S)
    index = batch.sources[:, None, :, None].expand(-1, weights.shape[1], -1, 1)  # (G * B, H, Q, 1)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")  # (G * B * Q,)
    columns = {
        "accuracy": _member_means((logits.argmax(-1) == batch.targets).float(), G),
        "loss": _member_means(loss, G),
        "max_logit": max_logit.reshape(G, -1).amax(dim=1),
        "entropy": _member_means(entropy, G),
        "saturated": _member_means((max_prob > SATURATED).float(), G),
        "max_prob": _member_means(max_prob, G),
        "source_prob": _member_means(weights.gather(-1, index), G),
    }
    values = {name: column.tolist() for name, column in columns.items()}
    return [Eval(**{name: values[name][g] for name in values}) for g in range(G)]


def init_logit_std(model: TinyTransformer, batch: RecallBatch) -> dict[str, float]:
    """Std of the first layer's logits of the query rows at the model's current state, before and
    after the divisor: ``raw`` = std of q.k, ``scaled`` = std of the logits softmax sees."""
    if grouped.groups(model) != 1:
        raise ValueError("init_logit_std takes a plain model; got a stack of models.")
    return _init_logit_std(model, batch)[0]


def _init_logit_std(model: nn.Module, batch: RecallBatch) -> list[dict[str, float]]:
    """:func:`init_logit_std` of each member of a (possibly stacked) model."""
    G = grouped.groups(model)
    attn = model.blocks[0].attn
    H, D, S = attn.num_heads, attn.head_dim, model.task.context
    with torch.no_grad():
        x = model.blocks[0].ln1(model.key_emb(batch.keys) + model.value_emb(batch.values))  # (G * B, T, d_model)
        q = attn.q_proj(x[:, S:]).unflatten(-1, (H, D)).transpose(1, 2)  # (G * B, H, Q, D)
        k = attn.k_proj(x[:, :S]).unflatten(-1, (H, D)).transpose(1, 2)  # (G * B, H, S, D)
        raw = (q @ k.transpose(-1, -2)).reshape(G, -1)  # (G, B * H * Q * S)
        values = {"raw": raw.std(dim=1), "scaled": (raw * attn.scale).std(dim=1), "q_component_var": q.reshape(G, -1).var(dim=1)}
        lists = {name: v.tolist() for name, v in values.items()}
    return [{name: lists[name][g] for name in lists} for g in range(G)]


@dataclass
class RunLog:
    """Held-out metrics every ``log_every`` steps (step 0 is the initial model)."""

    steps: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    max_logit: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    saturated: list[float] = field(default_factory=list)
    max_prob: list[float] = field(default_factory=list)
    source_prob: list[float] = field(default_factory=list)
    init_logit_std: dict[str, float] = field(default_factory=dict)
    clipped_heads: int = 0
    """QK-Clip's count of (step, layer, head) rescalings."""

    def append(self, step: int, ev: Eval) -> None:
        self.steps.append(step)
        for name in ("accuracy", "loss", "max_logit", "entropy", "saturated", "max_prob", "source_prob"):
            getattr(self, name).append(getattr(ev, name))

    def steps_to(self, threshold: float) -> int | None:
        """First logged step whose held-out accuracy is at least ``threshold`` (None if never)."""
        return next((s for s, a in zip(self.steps, self.accuracy) if a >= threshold), None)

    def to_dict(self) -> dict:
        return asdict(self)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases, LayerNorm gains and log-temperatures keep their
    scale (decaying a log-temperature would pull the learned scale back to the fixed one). In a
    stack of models every parameter has a leading member dimension, which does not count."""
    params = list(model.parameters())
    member = 1 if any(isinstance(m, grouped.GroupedModule) for m in model.modules()) else 0
    return [
        {"params": [p for p in params if p.ndim - member >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim - member < 2], "weight_decay": 0.0},
    ]


def _lr_factor(step: int, warmup: int) -> float:
    return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW or SGD with torch's ``fused`` implementation: the per-parameter update's arithmetic in
    one kernel per parameter (torch's CPU default loops over the parameters in Python, which for
    these tiny models costs about a fifth of a step)."""
    groups = _param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=True)


def _head_max_logits(seen: list[AttentionOutput], G: int | None = None) -> list[Tensor]:
    """Per layer, the heads' largest logits over the batch and all rows: (H,) tensors for a plain
    model (``G`` None), (G, H) for a stack of ``G`` members (each over its own rows)."""
    out = []
    for layer in seen:
        assert layer.stats is not None, "computed with stats=True"
        m = layer.stats.max_logit.unflatten(0, (G or 1, -1)).amax(dim=(1, 3))  # (G * B, H, rows) -> (G, H)
        out.append(m[0] if G is None else m)
    return out


def _clip(model: nn.Module, head_max_logits: list[Tensor], tau: float) -> Tensor:
    """QK-Clip on a plain model ((H,) maxima per layer) or a stack ((G, H)); the clipped heads per member."""
    clipped = torch.zeros(head_max_logits[0].shape[:-1], dtype=torch.long)
    with torch.no_grad():
        for block, s_max in zip(model.blocks, head_max_logits, strict=True):
            attn = block.attn
            assert attn.num_kv_heads == attn.num_heads, "QK-Clip here rescales k per query head"
            over = s_max > tau  # (..., H)
            gamma = torch.where(over, tau / s_max.clamp_min(tau), torch.ones_like(s_max))  # (..., H)
            factor = gamma.sqrt().repeat_interleave(attn.head_dim, dim=-1)  # (..., H * D), head-major like the q/k layout
            for proj in (attn.q_proj, attn.k_proj):
                proj.weight.mul_(factor[..., :, None].to(proj.weight.dtype))
                if proj.bias is not None:
                    proj.bias.mul_(factor.to(proj.bias.dtype))
            clipped += over.sum(dim=-1)
    return clipped


def qk_clip(model: TinyTransformer, head_max_logits: list[Tensor], tau: float) -> int:
    """QK-Clip (Kimi K2, 2025, the clip of MuonClip): for every head whose largest logit
    ``S_max`` in the step exceeded ``tau``, multiply that head's rows of ``W_q`` and ``W_k`` (and
    their biases) by ``sqrt(tau / S_max)``, so that the same inputs give logits ``tau / S_max``
    times smaller and the largest one equals ``tau``. Other heads are left alone.

    ``head_max_logits`` holds, per layer, the (H,) largest logits after the scale (what softmax
    sees) of the step's forward pass; call this after the optimizer step, as Kimi K2 does.
    Returns the number of clipped heads.

    >>> import torch
    >>> from attnscale.lab.tasks import MQAR
    >>> task = MQAR(context=4, queries=2, n_keys=8, n_values=8)
    >>> model = TinyTransformer(task, ModelConfig(d_model=16, num_heads=2, head_dim=8))
    >>> batch = task.sample(4, torch.Generator().manual_seed(0))
    >>> def head_max():
    ...     return [out.stats.max_logit.amax(dim=(0, 2)) for out in model.forward_all_rows(batch, stats=True)[1]]
    >>> before = head_max()[0]
    >>> tau = (before[0] / 2).item()  # head 0 is clipped to tau, head 1 only if it is above tau
    >>> qk_clip(model, head_max(), tau) >= 1
    True
    >>> torch.allclose(head_max()[0], torch.minimum(before, torch.tensor(tau)), rtol=1e-5)
    True
    """
    if grouped.groups(model) != 1:
        raise ValueError("qk_clip takes a plain model; got a stack of models.")
    return int(_clip(model, head_max_logits, tau))


def _cat(batches: list[RecallBatch]) -> RecallBatch:
    """Members' batches as one, member-major along the batch dimension."""
    return RecallBatch(*(torch.cat([getattr(b, f.name) for b in batches]) for f in fields(RecallBatch)))


def train(
    task: Task,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    seed: int,
    *,
    progress: Progress = no_progress,
) -> tuple[TinyTransformer, RunLog]:
    """Train a fresh :class:`TinyTransformer` on ``task``; deterministic for (configs, seed).

    Model initialisation draws from ``torch.manual_seed(seed)``; training batches from a generator
    seeded with ``seed``; the held-out batch from a generator seeded with ``seed + 10**6``.
    """
    return train_seeds(task, model_cfg, train_cfg, [seed], progress=progress)[0]


def train_seeds(
    task: Task,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    seeds: list[int],
    *,
    progress: Progress = no_progress,
) -> list[tuple[TinyTransformer, RunLog]]:
    """:func:`train` of each seed, all seeds trained together as one stack of models
    (:mod:`attnscale.lab.grouped`): one call per layer for all of them, each with its own
    initialisation, batches, held-out batch, optimizer state and early stop (a seed that reaches
    ``stop_at`` leaves the stack). Returns each seed's final model and log, in ``seeds``' order;
    the same as training the seeds one by one but for rounding.
    """
    if not seeds:
        raise ValueError("seeds must hold at least one seed; got an empty list.")
    clip = train_cfg.qk_clip
    if clip is not None and model_cfg.attention is not None and model_cfg.attention.qk_norm != "none":
        raise ValueError(
            "qk_clip rescales W_q and W_k, which QK-norm undoes; got qk_clip with "
            f"attention.qk_norm={model_cfg.attention.qk_norm.value!r}. Use one guard or the other."
        )
    plain = []
    for seed in seeds:
        torch.manual_seed(seed)
        plain.append(TinyTransformer(task, model_cfg))
    model = grouped.stack(plain)
    template = plain[0]
    data = [torch.Generator().manual_seed(seed) for seed in seeds]
    held_out = [task.sample(train_cfg.eval_batch, torch.Generator().manual_seed(seed + 10**6)) for seed in seeds]
    opt = _optimizer(model, train_cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, train_cfg.warmup))
    logs = [RunLog(init_logit_std=std) for std in _init_logit_std(model, _cat(held_out))]
    for log, ev in zip(logs, _evaluate(model, _cat(held_out)), strict=True):
        log.append(0, ev)
    active = list(range(len(seeds)))  # the seeds still in the stack, in stack order
    models: list[TinyTransformer | None] = [None] * len(seeds)
    for step in range(1, train_cfg.steps + 1):
        G = len(active)
        batch = _cat([task.sample(train_cfg.batch, data[i]) for i in active])
        logits, seen = model.forward_all_rows(batch, stats=clip is not None)
        losses = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")  # (G * B * Q,)
        loss = _member_means(losses, G).sum()  # each member's gradient is that of its own mean loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if clip is not None:
            for i, n in zip(active, _clip(model, _head_max_logits(seen, G), clip).tolist(), strict=True):
                logs[i].clipped_heads += n
        if step % train_cfg.log_every == 0 or step == train_cfg.steps:
            evs = _evaluate(model, _cat([held_out[i] for i in active]))
            for i, ev in zip(active, evs, strict=True):
                logs[i].append(step, ev)
            progress(step, train_cfg.steps)
            if train_cfg.stop_at is not None:
                done = [j for j, ev in enumerate(evs) if ev.accuracy >= train_cfg.stop_at]
                for j in done:
                    models[active[j]] = grouped.member(model, template, j)
                if done:
                    remaining = [j for j in range(G) if j not in done]
                    if not remaining:
                        active = []
                        break
                    grouped.keep(model, remaining, opt)
                    active = [active[j] for j in remaining]
    for j, i in enumerate(active):
        models[i] = grouped.member(model, template, j)
    progress(train_cfg.steps, train_cfg.steps)
    return [(m, log) for m, log in zip(models, logs, strict=True)]  # type: ignore[misc]


def median_steps(steps: list[int | None]) -> float | None:
    """Median of steps-to-criterion over seeds, a run that never got there counting as infinitely
    slow; None when the median itself is such a run (half the seeds or more did not get there).

    >>> median_steps([100, 300, None]), median_steps([100, None]), median_steps([40, 60])
    (300, None, 50.0)
    """
    if not steps:
        return None
    value = statistics.median(math.inf if s is None else s for s in steps)
    return None if math.isinf(value) else value
