"""Where a flex call's time goes on a CUDA GPU: one case of bench_flex.py (bf16, B 1, H 16,
default L 8192, D 64, causal + softcap 30, forward), attnscale's backend="flex" against
FlexAttention with the same mods, each timed per call (host clock around a synchronized call,
median of 20) and profiled over 5 calls: the host operations that took the most time and the
kernels each call launched.

    python benchmarks/profile_flex.py [--length 8192] [--rows 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flex  # noqa: E402

import attnscale  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=25, help="rows of each profile table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_flex: needs a CUDA GPU", file=sys.stderr)
        return 2
    case = "causal+softcap"
    q, k, v = bench_flex._inputs(args.length, 64, case, grad=False)
    opts = bench_flex._options(case, q.shape[-3])
    calls = {
        "attnscale flex": lambda: attnscale.scaled_dot_product_attention(q, k, v, backend="flex", **opts),
        "plain flex": lambda f=bench_flex._plain_flex(q, k, opts): f(q, k, v),
    }
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - start))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"\n== {name}: {statistics.median(times):.3f} ms a call (host clock, synchronized, median of 20)")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
