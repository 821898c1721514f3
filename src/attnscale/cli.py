"""The ``attnscale`` command line. Thin: every command calls the library."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from . import __version__
from .functional import scaled_dot_product_attention


def _demo(args: argparse.Namespace) -> int:
    """Max attention probability with and without 1/sqrt(D), over many random draws."""
    from rich.console import Console
    from rich.table import Table

    gen = torch.Generator().manual_seed(args.seed)
    table = Table(title=f"max attention probability over {args.keys} keys, {args.draws} draws (median)")
    table.add_column("D (d_k)", justify="right")
    table.add_column("std of q.k", justify="right")
    table.add_column("unscaled", justify="right")
    table.add_column("scale 1/sqrt(D)", justify="right")
    for D in (4, 16, 64, 128, 512):
        q = torch.randn(args.draws, 1, 1, D, generator=gen)  # (N, H=1, L=1, D)
        k = torch.randn(args.draws, 1, args.keys, D, generator=gen)  # (N, H=1, S, D)
        v = torch.eye(args.keys).expand(args.draws, 1, args.keys, args.keys)  # out = weights
        unscaled = scaled_dot_product_attention(q, k, v, scale=1.0).amax(-1).median()
        scaled = scaled_dot_product_attention(q, k, v).amax(-1).median()
        std = (q @ k.transpose(-1, -2)).std()
        table.add_row(str(D), f"{std:.1f}", f"{unscaled:.3f}", f"{scaled:.3f}")
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnscale",
        description="Scaled dot-product attention and its 1/sqrt(d_k) scale: library, lab and diagnostics.",
    )
    parser.add_argument("--version", action="version", version=f"attnscale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="show softmax saturation without the scale (a few seconds)")
    demo.add_argument("--keys", type=int, default=64, help="number of keys S (default 64)")
    demo.add_argument("--draws", type=int, default=2000, help="random query draws per D (default 2000)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
