"""Cost of the scale census (attnscale.diagnostics.census): model types per second.

    python benchmarks/bench_census.py [--stride N] [--threads T] [--json PATH]
    python benchmarks/bench_census.py --markdown benchmarks/recorded/census.json   # the summary lines

Probes every ``--stride``-th model type of the installed transformers (1: all of them, as the lab's
full profile does; 8: the default profile's sample) in one process at ``--threads`` torch threads
(default 1, as in the lab report's workers), each type as the census does it (built small, probed
over its position ladder, classified). Records per type the seconds, the outcome (class, not probed,
no attention) and the process's peak resident memory after it, and prints types per second overall
and the slowest types. The census's own outcomes are the lab's (attnscale report); this measures
what they cost.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
import warnings
from pathlib import Path

import torch

from machine import describe


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def run(stride: int, threads: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from attnscale.diagnostics import census

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    types = census.model_types()[::stride]
    rows = []
    start = time.perf_counter()
    for i, model_type in enumerate(types):
        begin = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outcome = census.probe_type(model_type).cls
        except census.NoAttention:
            outcome = "no attention"
        except Exception:  # noqa: BLE001 - any failure of foreign code is an outcome here
            outcome = "not probed"
        rows.append({"model_type": model_type, "outcome": outcome, "seconds": round(time.perf_counter() - begin, 3), "peak_gib": round(_peak_gib(), 2)})
        print(f"[{i + 1}/{len(types)}] {model_type}: {outcome} ({rows[-1]['seconds']:.2f} s)", flush=True)
    total = time.perf_counter() - start
    return {
        "schema": "attnscale.bench_census/1",
        **describe(),
        "threads": threads,
        "transformers": transformers.__version__,
        "stride": stride,
        "types": len(types),
        "seconds": round(total, 1),
        "types_per_second": round(len(types) / total, 3),
        "median_seconds": round(statistics.median(r["seconds"] for r in rows), 3),
        "peak_gib": round(_peak_gib(), 2),
        "rows": rows,
    }


def markdown(result: dict) -> str:
    outcomes: dict[str, int] = {}
    for row in result["rows"]:
        outcomes[row["outcome"]] = outcomes.get(row["outcome"], 0) + 1
    slow = sorted(result["rows"], key=lambda r: -r["seconds"])[:5]
    return "\n".join(
        [
            f"{result['types']} model types (every {result['stride']}th of transformers {result['transformers']}) in "
            f"{result['seconds']:.0f} s at {result['threads']} thread(s): {result['types_per_second']:.2f} types/s, median "
            f"{result['median_seconds']:.2f} s a type, peak memory {result['peak_gib']:.1f} GiB; {result['cpu']}, torch "
            f"{result['torch']}, commit {result['commit']}.",
            "Outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])) + ".",
            "Slowest: " + ", ".join(f"{r['model_type']} {r['seconds']:.1f} s" for r in slow) + ".",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stride", type=int, default=1, help="every Nth model type (1: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the lab's workers use 1)")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--markdown", type=Path, help="print the summary of a recorded result and exit")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    if args.stride < 1 or args.threads < 1:
        parser.error(f"--stride and --threads must be >= 1, got {args.stride} and {args.threads}")
    result = run(args.stride, args.threads)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
