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


def _load_target(spec: str) -> object:
    """Import ``package.module:attribute`` (attribute may be dotted)."""
    import importlib

    import os

    if os.getcwd() not in sys.path:  # like `python -m`: modules in the current folder are importable
        sys.path.insert(0, os.getcwd())
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"attnscale check: TARGET: expected 'package.module:callable', got {spec!r}")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"attnscale check: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"attnscale check: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _check(args: argparse.Namespace) -> int:
    """Probe the scale of an attention callable or module and run the conformance checks."""
    from rich.console import Console
    from rich.table import Table

    from .diagnostics import check_attention, probe_module

    console = Console()
    target = _load_target(args.target)
    if isinstance(target, type) and issubclass(target, torch.nn.Module):
        raise SystemExit("attnscale check: TARGET is a module class; point it at an instance or a factory call result")
    if isinstance(target, torch.nn.Module):
        found = probe_module(target, num_heads=args.num_heads)
        ok = found.diagnosis == "1/sqrt(head_dim)"
        console.print(
            f"scale per head: {', '.join(f'{s:.6g}' for s in found.fit.scale)}\n"
            f"expected 1/sqrt(d_model / num_heads) = 1/sqrt({found.head_dim}) = {found.expected:.6g}\n"
            f"diagnosis: {found.diagnosis}"
        )
        return 0 if ok else 1
    if not callable(target):
        raise SystemExit(f"attnscale check: {args.target!r} is not callable")
    report = check_attention(target, head_dim=args.head_dim, num_heads=args.num_heads or 4)
    table = Table(title=f"attnscale check {args.target}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    marks = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[yellow]n/a[/]"}
    for c in report.checks:
        table.add_row(c.name, marks[c.passed], c.detail)
    console.print(table)
    return 0 if report.ok else 1


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

    check = sub.add_parser(
        "check",
        help="find the logit scale an attention implementation uses, and check its semantics",
        description=(
            "TARGET is 'package.module:name'. A callable with the SDPA layout fn(q, k, v, attn_mask=None, "
            "is_causal=False, enable_gqa=False) gets the scale probe and conformance checks (softmax axis, V, "
            "mask polarity, causal alignment, fully masked rows, large logits, fp16 overflow, GQA mapping). "
            "An nn.Module instance gets the per-head scale probe. Exit code 1 when a check fails."
        ),
    )
    check.add_argument("target", metavar="TARGET", help="e.g. mypkg.attention:attend or mypkg.model:layer0")
    check.add_argument("--head-dim", type=int, default=64, help="D used for the callable probe (default 64)")
    check.add_argument("--num-heads", type=int, default=None, help="query heads (modules: if not an attribute)")
    check.set_defaults(func=_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
