"""A griffe extension for the API reference: the reStructuredText habits of attnscale's docstrings,
rendered as Markdown.

The docstrings are Google style, read by ``help()`` and doctested, and keep three reST habits that
Markdown would show raw: literal blocks introduced by ``::`` (drawings, legends, formulas),
doctest lines (``>>>``, which Markdown reads as nested block quotes) and cross-reference roles
(``:func:`name```). Before griffe parses a docstring, this turns the first two into fenced code
blocks and each role into inline code; the source is not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")
SECTION = re.compile(r"^[A-Z][a-z]+(?: [a-z]+)?:\s*$")  # "Args:", "Returns:", "Attributes:"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fence(lines: list[str], at: int, info: str) -> list[str]:
    """``lines`` as a fenced block whose fences sit at column ``at``, relative indents kept."""
    body = [line for line in lines if line.strip()]
    cut = min(_indent(line) for line in body)
    pad = " " * at
    return [f"{pad}```{info}", *(pad + line[cut:] if line.strip() else "" for line in lines), f"{pad}```"]


def _content_indent(lines: list[str], i: int) -> int:
    """Where the text of line ``i``'s paragraph sits once griffe has read the docstring's sections:
    an item of a section ("name: text") has its text at twice the item's indent."""
    indent = _indent(lines[i])
    if indent == 0:
        return 0
    for line in reversed(lines[:i]):
        if line.strip() and _indent(line) == 0:
            if SECTION.match(line) and indent <= 4:  # the item's own line: its continuation is at 2x
                return 2 * indent
            break
    return indent


def _literal_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        k = j
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > base):
            k += 1
        while k > j and not lines[k - 1].strip():
            k -= 1
        if k == j:  # "::" with no indented block after it: not a literal block
            out.append(line)
            i += 1
            continue
        text = line.rstrip()[:-2].rstrip()
        at = _content_indent(lines, i)
        if text.strip():
            out.append(text + ":" if not line.rstrip()[:-2].endswith(" ") else text)
        out += ["", *_fence(lines[j:k], at, "text")]
        i = k
    return out


def _doctests(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    fenced = False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        k = i + 1
        while k < len(lines) and lines[k].strip() and _indent(lines[k]) >= base:
            k += 1
        if out and out[-1].strip():
            out.append("")
        out += _fence(lines[i:k], base, "pycon")
        i = k
    return out


def readable(docstring: str) -> str:
    lines = ROLE.sub(r"`\1`", docstring).splitlines()
    return "\n".join(_doctests(_literal_blocks(lines)))


class ReadableDocstrings(griffe.Extension):
    """Rewrite each docstring once, when griffe loads its object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = readable(obj.docstring.value)
