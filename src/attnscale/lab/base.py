"""What every experiment provides, and the types the runner and the report share.

An experiment is one module under ``attnscale.lab.experiments`` that defines:

* ``CLAIM: Claim`` - id (the key in results.json), statement, sources, method, the verdict
  rule in words (the rule itself is ``judge``, written before looking at numbers) and the rule's
  history: one :class:`RuleVersion` per version of what is measured and judged (``run``, ``judge``,
  the lab code they reach and every profile's ``Config``), the last one current (a test compares
  its fingerprint with :func:`rule_fingerprint` of the module);
* ``Config`` - a frozen dataclass of sizes, with ``Config.for_profile(profile) -> Config``;
* ``run(config, seed, progress) -> dict`` - the measurement, JSON-able (named numbers and small
  tables), deterministic for a given config and seed, using attnscale's own attention;
* ``judge(measured) -> Judgement`` - the verdict rule; it can return every verdict;
* ``plot(measured, outdir) -> list[str]`` - writes figures (``name.svg`` and ``name.png``) into
  ``outdir`` and returns their file names without extension;
* ``captions(measured) -> dict[str, str]`` - for each name ``plot`` returns, the caption the report
  shows under that figure: what it shows and what to look at. A number in a caption is formatted from
  ``measured``, never typed in.

An experiment made of independent measurements (conditions trained separately) may also define

* ``parts(config) -> list[str]`` - the names of its parts;
* ``run_part(config, seed, part, progress) -> dict`` - one part's results (picklable);
* ``combine(config, seed, results) -> dict`` - what ``run`` returns, from ``{part: run_part(...)}``
  in ``parts`` order; ``run`` must be ``combine`` of every part, so the numbers do not depend on
  where the parts ran. The local runner then runs the parts as separate tasks side by side in its
  job slots (a long experiment does not keep one slot busy while the others idle) and combines,
  judges and plots them when the last one is in.

and may define ``HEADLINE: Headline``: the key of ``measured`` (dotted for nested dicts, e.g.
``"headline.centre"``) whose value the report shows as the claim's key number, with what that
number is in words and its unit (a bare key string is shown under its own name).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Profile = Literal["tiny", "quick", "default", "full"]
"""``tiny`` is for unit tests (seconds), ``quick`` for CI, ``default`` for users (the published
run; ``results/*.json`` record each run's wall time), ``full`` for tight confidence intervals."""

PROFILES: tuple[Profile, ...] = ("tiny", "quick", "default", "full")

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called by ``run`` as work completes."""


def no_progress(done: int, total: int) -> None:
    """A ``Progress`` that shows nothing."""


class Verdict(StrEnum):
    HOLDS = "holds"
    HOLDS_APPROXIMATELY = "holds-approximately"
    DOES_NOT_HOLD = "does-not-hold"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Headline:
    """The claim's key number: where it is in ``measured``, what it is in words, and its unit."""

    key: str
    label: str
    unit: str = ""
    """Appended to the value: ``"x"`` for a ratio of two like quantities, ``"eps"``, ``""`` for none."""
    spread: str | None = None
    """The key (dotted, as ``key``) of the number's standard error over seeds, shown beside it; None
    where the number has none (an exact computation)."""


@dataclass(frozen=True)
class RuleVersion:
    """One version of a verdict rule: when it took effect, why, and the fingerprint of its code."""

    version: int
    date: str
    """ISO date (``YYYY-MM-DD``) of the commit that introduced this version."""
    why: str
    fingerprint: str
    """:func:`rule_fingerprint` of the experiment module as of this version (measurement and rule)."""


@dataclass(frozen=True)
class Claim:
    id: str
    statement: str
    sources: tuple[str, ...]
    """Where the claim is stated: entries of docs/claims.md (papers with sections, documentation pages)."""
    method: str
    rule: str
    rule_history: tuple[RuleVersion, ...] = ()
    """Every version of the verdict rule, oldest first; the last one is the rule ``judge`` applies."""


@dataclass(frozen=True)
class Arm:
    """The verdict of one arm of an experiment (one optimizer, one model) under the same rule."""

    name: str
    verdict: Verdict
    reason: str


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str
    arms: tuple[Arm, ...] = ()
    """Each arm's own verdict, where the experiment judges several; the report shows every one."""


def rule_fingerprint(module: types.ModuleType) -> str:
    """SHA-256 (16 hex digits) of what an experiment measures and how it judges: the code of
    ``module.run`` and ``module.judge`` and everything of the lab they reach, and the ``Config`` of
    every profile.

    Covers ``run`` and ``judge`` and, transitively, the functions, classes (their whole source,
    methods included) and plain constants (numbers, strings and containers of them) they name, from
    ``module`` itself or any ``attnscale.lab`` module, and ``repr(Config.for_profile(p))`` for every
    profile. Code counts by its syntax tree without docstrings, so comments, docstrings and layout do
    not change the fingerprint; any change to what is measured (a model, a training loop, a seed
    count, a sweep) or to what the rule computes does. attnscale's attention itself, which the
    experiments measure with, is checked against its fp64 oracle by the test suite instead.
    """
    parts: list[str] = []
    seen: set[int] = set()

    def ours(obj: Any) -> bool:
        name = getattr(obj, "__module__", None) or ""
        return name == module.__name__ or name.startswith("attnscale.lab")

    def syntax(obj: Any) -> str:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and body:
                first = body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                    node.body = body[1:] or [ast.Pass()]
        return ast.dump(tree)

    def visit_code(code: types.CodeType, scope: dict[str, Any]) -> None:
        for name in code.co_names:
            if name in scope:
                visit(name, scope[name])
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                visit_code(const, scope)

    def visit(name: str, obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType) and ours(obj):
            parts.append(f"{obj.__qualname__}\0{syntax(obj)}")  # by name alone, so that a copy of the module compares equal
            visit_code(obj.__code__, obj.__globals__)
        elif isinstance(obj, type) and ours(obj):
            parts.append(f"{obj.__qualname__}\0{syntax(obj)}")
            for member in vars(obj).values():
                function = getattr(member, "__func__", member)  # classmethod, staticmethod
                if isinstance(function, types.FunctionType):
                    visit_code(function.__code__, function.__globals__)
                elif isinstance(member, property):
                    for accessor in (member.fget, member.fset):
                        if accessor is not None:
                            visit_code(accessor.__code__, accessor.__globals__)
        elif _plain(obj):
            parts.append(f"{name}\0{obj!r}")

    visit("run", module.run)
    visit("judge", module.judge)
    config = getattr(module, "Config", None)
    if config is not None:
        visit("Config", config)
        for profile in PROFILES:
            parts.append(f"Config.{profile}\0{config.for_profile(profile)!r}")
    return hashlib.sha256("\0\0".join(parts).encode()).hexdigest()[:16]


def _plain(obj: Any) -> bool:
    if isinstance(obj, bool | int | float | str | None):
        return True
    if isinstance(obj, tuple | list | frozenset | set):
        return all(_plain(v) for v in obj)
    if isinstance(obj, dict):
        return all(_plain(k) and _plain(v) for k, v in obj.items())
    return False


def save_figure(fig: Figure, outdir: Path, name: str) -> str:
    """Write ``fig`` as ``outdir/name.svg`` and ``outdir/name.png``; return ``name``.

    Build figures with ``matplotlib.figure.Figure()`` (not pyplot): no global state, safe in
    worker processes and without a display.
    """
    outdir.mkdir(parents=True, exist_ok=True)
    fig.savefig(outdir / f"{name}.svg", bbox_inches="tight")
    fig.savefig(outdir / f"{name}.png", dpi=110, bbox_inches="tight")
    return name
