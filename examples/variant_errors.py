"""The accuracy tables of docs/variants.md: Performer FAVOR+ and INT8 attention against exact attention.

    python examples/variant_errors.py [--seeds 5]

Prints Markdown. FAVOR+: the relative error ``|approx - exact| / |exact|`` (Frobenius norms over the
whole output) of ``favor_attention`` against ``scaled_dot_product_attention``, float64, for q, k ~
0.5 N(0, 1) and unit-variance q, k, D = 16, L = S = 64, H = 4 query and 2 key/value heads, mean over
seeds (the projection and the inputs both change with the seed). INT8: the largest and the mean
``|int8_attention - float64 attention|`` for unit-variance float32 inputs at the sizes that
tests/variants/test_quant.py checks, and the mean error with and without K smoothing when every key
shares a per-channel offset of 10 times the noise. A few seconds on two cores.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import numpy as np
import torch

import attnscale
from attnscale import reference
from attnscale.variants import favor_attention, gaussian_features, int8_attention

FEATURES = (8, 32, 128, 512, 2048, 32768)
FAVOR_ROWS = (("orthogonal, non-causal", True, False), ("i.i.d., non-causal", False, False), ("orthogonal, causal", True, True))
INT8_SIZES = ((64, 256), (59, 130))  # (D, L), as in tests/variants/test_quant.py


def favor_error(m: int, seed: int, *, orthogonal: bool, causal: bool, std: float) -> float:
    g = torch.Generator().manual_seed(100 + seed)
    q = std * torch.randn(1, 4, 64, 16, generator=g, dtype=torch.float64)  # (B, H, L, D)
    k = std * torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64)  # (B, Hkv, S, D)
    v = torch.randn(1, 2, 64, 8, generator=g, dtype=torch.float64)  # (B, Hkv, S, Dv)
    W = gaussian_features(m, 16, orthogonal=orthogonal, generator=torch.Generator().manual_seed(seed))
    approx = favor_attention(q, k, v, W, is_causal=causal)
    exact = attnscale.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return float((approx - exact).norm() / exact.norm())


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def int8_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, smooth: bool) -> np.ndarray:
    exact = reference.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), is_causal=causal)
    return np.abs(int8_attention(q, k, v, is_causal=causal, smooth_k=smooth).double().numpy() - exact)


def _fmt(x: float) -> str:
    """Two significant digits, trailing zeros kept: 0.50, 0.050, 0.0013."""
    return f"{x:#.2g}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds the FAVOR+ errors are averaged over (default 5)")
    args = parser.parse_args(argv)
    seeds = range(args.seeds)

    print(f"FAVOR+ relative error, q, k ~ 0.5 N(0, 1), D = 16, L = 64, mean over {args.seeds} seeds:\n")
    print("| features m | " + " | ".join(str(m) for m in FEATURES) + " |")
    print("|---|" + "---|" * len(FEATURES))
    for name, orthogonal, causal in FAVOR_ROWS:
        errors = [statistics.mean(favor_error(m, s, orthogonal=orthogonal, causal=causal, std=0.5) for s in seeds) for m in FEATURES]
        print(f"| {name} | " + " | ".join(_fmt(e) for e in errors) + " |")
    unit = statistics.mean(favor_error(2048, s, orthogonal=True, causal=False, std=1.0) for s in seeds)
    print(f"\nUnit-variance q, k, orthogonal, non-causal, m = 2048: {_fmt(unit)}\n")

    print("INT8 attention against float64, unit-variance inputs, K smoothed (B = 2, H = 4, Hkv = 2):\n")
    print("| D, L | max, full | max, causal | mean, full | mean, causal |")
    print("|---|---|---|---|---|")
    for D, L in INT8_SIZES:
        q, k, v = randn(2, 4, L, D, seed=0), randn(2, 2, L, D, seed=1), randn(2, 2, L, D, seed=2)
        err = {c: int8_error(q, k, v, causal=c, smooth=True) for c in (False, True)}
        cells = [f"{err[False].max():.3f}", f"{err[True].max():.3f}", _fmt(err[False].mean()), _fmt(err[True].mean())]
        print(f"| {D}, {L} | " + " | ".join(cells) + " |")
    q, k, v = randn(2, 4, 128, 64, seed=0), randn(2, 2, 128, 64, seed=1), randn(2, 2, 128, 64, seed=2)
    k = k + 10 * randn(64, seed=3)  # the same offset in every key: a per-channel mean of 10x the noise
    plain, smoothed = (float(int8_error(q, k, v, causal=False, smooth=s).mean()) for s in (False, True))
    print(f"\nKeys offset by 10x the noise per channel (D = 64, L = 128): mean error {_fmt(plain)} without smoothing, {_fmt(smoothed)} with it.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
