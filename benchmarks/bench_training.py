"""The lab's training: the seeds of one configuration trained together (one stack of models) vs one by one.

    python benchmarks/bench_training.py [--repeats 5] [--steps 300] [--seeds 3] [--json PATH]

One configuration of the ``training-stall`` experiment at its default profile (multi-query
associative recall, 16 context and 8 query positions, 32 keys and values; a one-layer
transformer, d_model 32, one head of d_k 128 with the 1/sqrt(d_k) scale; AdamW, batch 32, held-out
batch 64 evaluated every 10 steps), ``--steps`` steps without early stop so that both ways do the
same work:

* ``one by one``  ``train(..., seed)`` for each of ``--seeds`` seeds
* ``together``    ``train_seeds(..., seeds)``: all seeds as one stack of models (attnscale.lab.grouped)

Each repeat times both, interleaved; the medians of ``--repeats`` repeats give the speed-up
(one by one / together), at torch's default thread count and at one thread (the report's
setting: its job slots run one thread each). Also checks that both ways log the same held-out
losses (to 1e-4 relative: float32 rounding differs between one product and a batched one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from machine import DEFAULT_THREADS, describe

from attnscale.lab.tasks import MQAR
from attnscale.lab.training import ModelConfig, TrainConfig, train, train_seeds


def _setup(steps: int) -> tuple[MQAR, ModelConfig, TrainConfig]:
    task = MQAR(context=16, queries=8, n_keys=32, n_values=32)
    model_cfg = ModelConfig(d_model=32, head_dim=128, divisor="sqrt")
    train_cfg = TrainConfig(steps=steps, batch=32, lr=1e-3, log_every=10, eval_batch=64, stop_at=None)
    return task, model_cfg, train_cfg


def measure(threads: int, repeats: int, steps: int, seeds: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    task, model_cfg, train_cfg = _setup(steps)
    ids = list(range(seeds))
    train_seeds(task, model_cfg, TrainConfig(steps=5, batch=32, eval_batch=64, stop_at=None), ids)  # warm-up
    alone_s, together_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        alone = [train(task, model_cfg, train_cfg, s)[1] for s in ids]
        alone_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        together = [log for _, log in train_seeds(task, model_cfg, train_cfg, ids)]
        together_s.append(time.perf_counter() - start)
        for a, b in zip(alone, together, strict=True):
            worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a.loss, b.loss, strict=True))
            if worst > 1e-4:
                raise SystemExit(f"together and one by one disagree: held-out loss off by {worst:.2e} (relative)")
    one, grouped = statistics.median(alone_s), statistics.median(together_s)
    return {"threads": threads, "one_by_one_s": one, "together_s": grouped, "speedup": one / grouped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each way (median reported)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the configuration (the default profile trains 3)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    rows = [measure(t, args.repeats, args.steps, args.seeds) for t in sorted({DEFAULT_THREADS, 1}, reverse=True)]
    machine = describe()
    print(f"{machine['cpu']}, torch {machine['torch']}, commit {machine['commit']}: {args.seeds} seeds x {args.steps} steps, medians of {args.repeats}")
    print(f"{'threads':>7}  {'one by one (s)':>14}  {'together (s)':>12}  {'speed-up':>8}")
    for r in rows:
        print(f"{r['threads']:>7}  {r['one_by_one_s']:>14.2f}  {r['together_s']:>12.2f}  {r['speedup']:>7.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({**machine, "command": "python benchmarks/bench_training.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None), "seeds": args.seeds, "steps": args.steps, "repeats": args.repeats, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
