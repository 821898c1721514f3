"""attnscale under torch.compile against the same code run eagerly, at the default thread count
and at one thread.

    python benchmarks/bench_compile.py [--repeats 7] [--json out.json] [--quick]
    python benchmarks/bench_compile.py --markdown benchmarks/recorded/compile.json   # the docs' table

Two workloads, each timed eagerly and compiled (``torch.compile(fullgraph=True)``, inductor) in
one process, interleaved (repeat 1 of each, then repeat 2, ...); the ratio is the median of the
per-repeat ratios compiled / eager:

* ``block``: qkv projection -> attnscale (causal + softcap 30, the compiled kernel) -> output
  projection, B = 4, L = 1024, 8 heads of D = 64; the forward alone, and a training step
  (forward, backward, AdamW);
* ``gemma2``: a training step of a random 2-layer Gemma 2 (hidden 256, 4 heads of 64, sliding
  window 256, attention softcap 50, batch 4 x 512 tokens) with ``attn_implementation="attnscale"``.

Target: compiled at most 1.0x eager. Before timing, each compiled workload's output is checked
against the eager one. The CPU is printed with the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import attnscale
from machine import describe

TARGET = 1.0
WORKLOADS = {  # name -> how the docs' table names it
    "block forward": "block: qkv -> attnscale (causal + softcap) -> out, B = 4, L = 1024, forward",
    "block training step": "block, training step (forward, backward, AdamW)",
    "gemma2 training step": "random 2-layer Gemma 2, 4 x 512 tokens, training step",
}
H, D = 8, 64


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(H * D, 3 * H * D), torch.nn.Linear(H * D, H * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D) each
        out = attnscale.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=30.0)
        return self.out(out.transpose(1, 2).reshape(B, L, H * D))


def gemma2() -> torch.nn.Module:
    import transformers

    config = transformers.Gemma2Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=64, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnscale")


def training_step(model: torch.nn.Module, loss: Callable[[torch.nn.Module], torch.Tensor]) -> Callable[[], torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        value = loss(model)
        value.backward()
        optimizer.step()
        return value.detach()

    return step


def workloads() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name (as in WORKLOADS) -> (eager, compiled) callables, each checked once against the other."""
    torch.manual_seed(0)
    x = torch.randn(4, 1024, H * D)
    block = Block()
    compiled_block = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        want, got = block(x), compiled_block(x)
    assert (got - want).abs().max().item() < 1e-4, "compiled block forward differs from eager"

    def forward(model: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return model(x)

        return run

    target = torch.randn(4, 1024, H * D)
    block_twin = copy.deepcopy(block)
    block_loss = lambda m: (m(x) - target).square().mean()  # noqa: E731
    compiled_twin = torch.compile(block_twin, fullgraph=True)
    ids = torch.randint(0, 1024, (4, 512), generator=torch.Generator().manual_seed(1))
    lm = gemma2()
    lm_twin = copy.deepcopy(lm)
    lm_loss = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    compiled_lm = torch.compile(lm_twin, fullgraph=True)
    want, got = lm_loss(lm).item(), lm_loss(compiled_lm).item()
    assert abs(got - want) < 1e-4 * max(1.0, abs(want)), f"compiled gemma2 loss {got} differs from eager {want}"
    return {
        "block forward": (forward(block), forward(compiled_block)),
        "block training step": (training_step(block, block_loss), training_step(compiled_twin, block_loss)),
        "gemma2 training step": (training_step(lm, lm_loss), training_step(compiled_lm, lm_loss)),
    }


def measure(threads: int, repeats: int, cases: dict[str, tuple[Callable[[], object], Callable[[], object]]]) -> list[dict]:
    torch.set_num_threads(threads)
    rows = []
    for name, (eager, compiled) in cases.items():
        eager(), compiled()  # warm-up (the compiled one is compiled already)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(repeats):
            for kind, fn in (("eager", eager), ("compiled", compiled)):
                start = time.perf_counter()
                fn()
                times[kind].append(time.perf_counter() - start)
        ratio = statistics.median(c / e for c, e in zip(times["compiled"], times["eager"]))
        rows.append(
            {
                "case": name,
                "threads": threads,
                "eager_ms": 1e3 * statistics.median(times["eager"]),
                "compiled_ms": 1e3 * statistics.median(times["compiled"]),
                "ratio": ratio,
                "meets": ratio <= TARGET,
            }
        )
        r = rows[-1]
        print(f"threads={threads} {name}: eager {r['eager_ms']:.1f} ms, compiled {r['compiled_ms']:.1f} ms, {ratio:.2f}x "
              f"({'meets' if r['meets'] else 'misses'} {TARGET}x)", flush=True)  # fmt: skip
    return rows


def markdown(result: dict) -> str:
    """The docs' text and table from a --json file: what ran, where, and each ratio."""
    threads = sorted({r["threads"] for r in result["rows"]}, reverse=True)
    names = {t: "one thread" if t == 1 else f"{t} threads" for t in threads}
    lines = [
        f"`python benchmarks/bench_compile.py --json benchmarks/recorded/compile.json` (one run at commit {result['commit']}, "
        f"{result['cpu']}, {result['cores']} threads by default; medians of {result['repeats']} interleaved per-repeat ratios, "
        "compiled with inductor and `fullgraph=True`, each compiled output checked against eager first):",
        "",
        "| workload | " + " | ".join(names[t] for t in threads) + " | target |",
        "|---|" + "---|" * len(threads) + "---|",
    ]
    for case, label in WORKLOADS.items():
        cells = {r["threads"]: f"{r['ratio']:.2f}x" for r in result["rows"] if r["case"] == case}
        lines.append(f"| {label} | " + " | ".join(cells.get(t, "-") for t in threads) + f" | {result['target']}x |")
    met = sum(r["meets"] for r in result["rows"])
    lines += ["", f"Cells at or below the target (unrounded): {met} of {len(result['rows'])}."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts (default: torch's default and 1)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", metavar="JSON", help="print the docs' table from a --json file and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if not attnscale.kernels.available():
        print(f"bench_compile: the compiled kernel is unavailable ({attnscale.kernels.unavailable_reason()})", file=sys.stderr)
        return 1
    default_threads = torch.get_num_threads()
    threads = args.threads or sorted({default_threads, 1}, reverse=True)
    repeats = 3 if args.quick else args.repeats
    run = describe()
    print(f"CPU: {run['cpu']}, torch {run['torch']}, default threads {default_threads}, commit {run['commit']}", flush=True)
    cases = workloads()
    rows = [row for t in threads for row in measure(t, repeats, cases)]
    result = {"schema": "attnscale.bench_compile/1", **run, "repeats": repeats, "target": TARGET, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    met = sum(r["meets"] for r in rows)
    print(f"{met} of {len(rows)} cells meet the {TARGET}x target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
