"""A nanoGPT-sized character model on attnscale's MultiHeadAttention, with and without the scale.

Pre-LN blocks (LayerNorm, causal self-attention, LayerNorm, GELU MLP 4x wide), learned position
embeddings, the output head tied to the token embedding: nanoGPT's model. ``arm`` says what
multiplies q.k:

* ``"scaled"``: 1/sqrt(d_k), the formula's scale;
* ``"unscaled"``: 1 (the scale removed);
* ``"qknorm"``: 1, after LayerNorm of q and k over the head dim and with a learned temperature per
  head starting at 1 (Wortsman et al.'s qk-layernorm, whose norm bounds the logits instead);
* ``"mup"``: 1/d_k (muP's attention scale).

``init`` is nanoGPT's (``"nanogpt"``: every Linear and embedding normal with std 0.02, the residual
projections 0.02 / sqrt(2 layers)) or PyTorch's own (``"torch"``: ``nn.Linear``'s and
``nn.Embedding``'s defaults), which start the logits far larger.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import AttentionConfig, TemperatureOptions
from ..modules import AttentionOutput, MultiHeadAttention
from ..stats import AttentionStats
from .base import Progress, no_progress
from .shakespeare import Corpus, batch, load

ARMS = ("scaled", "unscaled", "qknorm", "mup")
INITS = ("nanogpt", "torch")


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    layers: int = 4
    width: int = 128
    heads: int = 4
    context: int = 64
    arm: str = "scaled"
    init: str = "nanogpt"

    def __post_init__(self) -> None:
        if self.arm not in ARMS:
            raise ValueError(f"arm: expected one of {ARMS}, got {self.arm!r}. Fix: pass one of them")
        if self.init not in INITS:
            raise ValueError(f"init: expected one of {INITS}, got {self.init!r}. Fix: pass one of them")
        if self.width % self.heads:
            raise ValueError(f"heads: expected a divisor of width {self.width}, got {self.heads}. Fix: d_k = width / heads must be whole")

    @property
    def d_k(self) -> int:
        return self.width // self.heads


def attention(config: GPTConfig) -> MultiHeadAttention:
    """The block's attention for ``config.arm``."""
    d_k = config.d_k
    if config.arm == "qknorm":
        variant = AttentionConfig(qk_norm="layer", scale="learned", temperature=TemperatureOptions(init=1.0))
        return MultiHeadAttention(config.width, config.heads, config=variant)
    scale = {"scaled": 1 / math.sqrt(d_k), "unscaled": 1.0, "mup": 1 / d_k}[config.arm]
    return MultiHeadAttention(config.width, config.heads, scale=scale)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(config.width), nn.LayerNorm(config.width)
        self.attn = attention(config)
        self.mlp = nn.Sequential(nn.Linear(config.width, 4 * config.width), nn.GELU(), nn.Linear(4 * config.width, config.width))

    def forward(self, x: Tensor, stats: list[AttentionStats] | None) -> Tensor:
        h = self.ln1(x)
        if stats is None:
            x = x + self.attn(h, is_causal=True)
        else:
            got = self.attn(h, is_causal=True, return_stats=True)
            assert isinstance(got, AttentionOutput) and got.stats is not None
            stats.append(got.stats)
            x = x + got.output
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Characters (B, T) -> next-character logits (B, T, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied
        if config.init == "nanogpt":
            self.apply(_nanogpt_init)
            for block in self.blocks:  # residual projections: 0.02 / sqrt(2 layers)
                for proj in (block.attn.out_proj, block.mlp[2]):
                    nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.layers))

    def forward(self, ids: Tensor, stats: list[AttentionStats] | None = None) -> Tensor:
        T = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(T, device=ids.device))
        for block in self.blocks:
            x = block(x, stats)
        return self.head(self.ln_f(x))


def _nanogpt_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


@dataclass(frozen=True)
class LMTrainConfig:
    """AdamW with linear warm-up and cosine decay to ``min_lr_ratio * lr``: nanoGPT's
    shakespeare_char recipe (betas 0.9 / 0.99, weight decay 0.1 on matrices, gradients clipped to
    norm 1) at its CPU size by default (batch 12, 2,000 steps)."""

    steps: int = 2000
    batch: int = 12
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_batches: int = 20
    seed: int = 0

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        done = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


@dataclass
class LMRun:
    """One training run: validation loss (nats per character) at each evaluation, the largest
    attention logit (over every layer, head and row of the first validation batch) and the lowest
    attention entropy in nats (a head's mean over the rows that see at least half the context,
    lowest over heads and layers) seen at any evaluation, and where it diverged (None: it did not).

    A run diverges at the first step whose training loss is not finite, or whose validation loss
    lies above the loss at initialisation; training stops there."""

    steps: list[int]
    val_loss: list[float]
    max_logit: float
    min_entropy: float
    diverged_at: int | None
    seconds: float

    @property
    def init_loss(self) -> float:
        return self.val_loss[0]

    @property
    def final_loss(self) -> float:
        """The last validation loss; the loss at initialisation for a run that diverged (a
        diverged run is as good as none)."""
        return self.init_loss if self.diverged_at is not None else self.val_loss[-1]

    def steps_to(self, target: float) -> int | None:
        """The first evaluated step at which the validation loss is at most ``target``."""
        return next((s for s, loss in zip(self.steps, self.val_loss) if loss <= target), None)


def _decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's weight decay: on matrices and embeddings, not on biases, LayerNorm gains or the
    qknorm arm's temperatures."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _validation_windows(corpus: Corpus, config: GPTConfig, train: LMTrainConfig) -> list[tuple[Tensor, Tensor]]:
    """The same validation batches for every run (their own generator, not the run's seed)."""
    generator = torch.Generator().manual_seed(20_231_107)
    return [batch(corpus.val, train.batch, config.context, generator) for _ in range(train.eval_batches)]


@torch.no_grad()
def _evaluate(model: GPT, windows: list[tuple[Tensor, Tensor]]) -> tuple[float, float, float]:
    """Mean validation loss, and the largest logit and lowest entropy of attention on the first batch."""
    model.eval()
    losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in windows]
    seen: list[AttentionStats] = []
    model(windows[0][0], seen)
    model.train()
    max_logit = max(float(s.max_logit.max()) for s in seen)
    # Entropy of the rows that see at least half the context (a causal row that sees one key has
    # entropy 0 whatever the model), averaged per head and layer: the lowest of those means.
    min_entropy = min(float(_wide_rows(s.entropy, s.visible_keys).min()) for s in seen)
    return sum(losses) / len(losses), max_logit, min_entropy


def _wide_rows(entropy: Tensor, visible: Tensor) -> Tensor:
    """Per head (H,): the mean entropy over batch and rows of (B, H, L) that see >= L/2 keys."""
    wide = (visible >= (entropy.shape[-1] + 1) // 2).to(entropy.dtype)
    return (entropy * wide).sum(dim=(0, 2)) / wide.sum(dim=(0, 2))


@contextlib.contextmanager
def subnormals_flushed() -> Iterator[None]:
    """Flush subnormal floats (below 1.2e-38 in float32) to zero inside, then restore the caller's
    mode: on x86 arithmetic on them is many times slower, and a saturated softmax's backward at a
    high learning rate is full of them."""
    was = float(torch.tensor(1e-38) * 0.01) == 0.0  # already flushing?
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was)


def train_lm(config: GPTConfig, train: LMTrainConfig, corpus: Corpus, progress: Progress = no_progress) -> LMRun:
    """Train :class:`GPT` on ``corpus.train`` (the model from seed ``train.seed``, the batches from
    a generator of the same seed) and evaluate every ``eval_every`` steps and at the end, with
    subnormal floats flushed to zero (:func:`subnormals_flushed`)."""
    with subnormals_flushed():
        return _train_lm(config, train, corpus, progress)


def _train_lm(config: GPTConfig, train: LMTrainConfig, corpus: Corpus, progress: Progress) -> LMRun:
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(train.seed)
        model = GPT(config)
    groups = _decay_groups(model, train.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, train.beta2), fused=True)
    generator = torch.Generator().manual_seed(train.seed)
    windows = _validation_windows(corpus, config, train)
    loss0, max_logit, min_entropy = _evaluate(model, windows)
    steps, val_loss, diverged_at = [0], [loss0], None
    for step in range(train.steps):
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step)
        x, y = batch(corpus.train, train.batch, config.context, generator)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if not math.isfinite(loss.item()):
            diverged_at = step + 1
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        if (step + 1) % train.eval_every == 0 or step + 1 == train.steps:
            loss_v, logit, entropy = _evaluate(model, windows)
            steps.append(step + 1)
            val_loss.append(loss_v)
            max_logit, min_entropy = max(max_logit, logit), min(min_entropy, entropy)
            if not loss_v <= loss0:  # NaN too
                diverged_at = step + 1
                break
        progress(step + 1, train.steps)
    return LMRun(steps, val_loss, max_logit, min_entropy, diverged_at, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    """``python -m attnscale.lab.gpt``: train one model on the plays and print its curve (nanoGPT's
    CPU recipe by default: 4 layers, width 128, 4 heads, context 64, batch 12, 2,000 steps)."""
    import argparse

    from rich.progress import Progress as Bar

    from .terminal import progress_columns

    parser = argparse.ArgumentParser(prog="python -m attnscale.lab.gpt", description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--arm", choices=ARMS, default="scaled", help="what multiplies q.k (default: 1/sqrt(d_k))")
    parser.add_argument("--init", choices=INITS, default="nanogpt", help="initialisation (default: nanoGPT's std 0.02)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3, nanoGPT's)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--heads", type=int, default=4, help="heads at width 128: d_k = 128 / heads (default 4: d_k 32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    corpus = load()
    config = GPTConfig(vocab=len(corpus.vocab), heads=args.heads, arm=args.arm, init=args.init)
    train = LMTrainConfig(steps=args.steps, lr=args.lr, seed=args.seed)
    with Bar(*progress_columns()) as bar:
        task = bar.add_task(f"{args.arm}, d_k {config.d_k}", total=train.steps)
        run = train_lm(config, train, corpus, lambda done, total: bar.update(task, completed=done))
    for step, loss in zip(run.steps, run.val_loss):
        print(f"step {step:5d}  validation loss {loss:.4f} nats/char")
    diverged = "no" if run.diverged_at is None else f"at step {run.diverged_at}"
    print(f"largest attention logit {run.max_logit:.3g}, lowest attention entropy {run.min_entropy:.3g} nats, diverged: {diverged}, {run.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
