"""Context-parallel attention across processes, checked against single-process attention.

Run with N processes (gloo on CPU, nccl when CUDA is available)::

    torchrun --standalone --nproc-per-node 4 examples/context_parallel.py
    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py --length 1000 --no-causal

Every rank builds the same full q, k, v from one seed, computes
``attnscale.scaled_dot_product_attention`` on the whole sequence, then runs
``context_parallel_attention`` on its shard for each method and layout, and compares its shard of
the output and of the gradients. Rank 0 prints the largest error over all ranks.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import attnscale
from attnscale.distributed import context_parallel_attention, shard_sequence


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=256, help="sequence length L (= S)")
    parser.add_argument("--heads", type=int, default=8, help="query heads H")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads Hkv (GQA when < H)")
    parser.add_argument("--dim", type=int, default=32, help="head dim D")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    return parser.parse_args(argv)


def max_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Largest absolute difference over every rank (a 0-dim tensor)."""
    err = (a.detach().double() - b.detach().double()).abs().max().reshape(1)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    return err[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    rank, N = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, L, D = 1, args.heads, args.kv_heads, args.length, args.dim
    q, g = (torch.randn(B, H, L, D, generator=gen, dtype=dtype) for _ in range(2))  # (B, H, L, D)
    k, v = (torch.randn(B, Hkv, L, D, generator=gen, dtype=dtype) for _ in range(2))  # (B, Hkv, L, D)
    q, g, k, v = (t.to(device) for t in (q, g, k, v))
    options = dict(is_causal=args.causal, softcap=30.0)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    full = attnscale.scaled_dot_product_attention(*leaves, enable_gqa=H != Hkv, **options)
    (full * g).sum().backward()

    if rank == 0:
        print(f"{N} ranks, L={L}, H={H}, Hkv={Hkv}, D={D}, {args.dtype}, causal={args.causal}, backend={dist.get_backend()}")
        print(f"{'method':8} {'layout':10} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}")
    for method in ("ring", "ulysses"):
        for layout in ("contiguous", "zigzag"):
            if method == "ulysses" and (H % N or L % N):
                if rank == 0:
                    print(f"{method:8} {layout:10} skipped: ulysses needs H and L divisible by {N}")
                continue
            if layout == "zigzag" and L % (2 * N):
                if rank == 0:
                    print(f"{method:8} {layout:10} skipped: zigzag needs L divisible by {2 * N}")
                continue
            mine = [shard_sequence(t, rank, N, layout).detach().requires_grad_() for t in (q, k, v)]
            out = context_parallel_attention(*mine, method=method, layout=layout, **options)
            (out * shard_sequence(g, rank, N, layout)).sum().backward()
            errors = [max_error(out, shard_sequence(full, rank, N, layout))]
            errors += [max_error(m.grad, shard_sequence(leaf.grad, rank, N, layout)) for m, leaf in zip(mine, leaves)]
            if rank == 0:
                print(f"{method:8} {layout:10} " + " ".join(f"{float(e):9.2e}" for e in errors))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
