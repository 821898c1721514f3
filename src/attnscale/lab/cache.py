"""Finished experiments, kept in ``OUT/cache`` so that an interrupted report resumes where it stopped.

An entry is ``OUT/cache/<claim id>-<key>.json``: the claim's record in results.json form. The key
hashes everything that decides the measurement: the config, the seed, the attnscale version, the
experiment module's source, and the source of the library it measures (every module of the
package except the report machinery and the other experiment modules; private helpers such as
``experiments/_common.py`` count). Entries are written atomically
(a temporary file, then ``os.replace``) as soon as an experiment finishes, so a crash leaves either
a whole entry or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from . import schema

__all__ = ["cache_key", "cache_path", "last_seconds", "library_source_hash", "load", "store"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# The report machinery and the CLI do not change what an experiment measures.
_NOT_MEASUREMENT = {
    "cli.py",
    "lab/cache.py",
    "lab/executors.py",
    "lab/published.py",
    "lab/registry.py",
    "lab/render_html.py",
    "lab/report.py",
    "lab/runner.py",
    "lab/schema.py",
}


def library_source_hash(root: Path = _PACKAGE_ROOT) -> str:
    """SHA-256 of the attnscale sources an experiment's result can depend on, other experiments aside."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        other_experiment = rel.startswith("lab/experiments/") and not path.name.startswith("_")
        if rel in _NOT_MEASUREMENT or other_experiment:  # private helpers of the experiments count
            continue
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(*, config: Any, seed: int, version: str, module_source: bytes, library_hash: str) -> str:
    """A short hex key for one experiment run; equal keys mean equal measurements."""
    payload = json.dumps(
        {"config": schema.to_jsonable(config), "seed": seed, "version": version, "library": library_hash},
        sort_keys=True,
    )
    digest = hashlib.sha256(payload.encode() + b"\0" + module_source)
    return digest.hexdigest()[:16]


def cache_path(outdir: Path, claim_id: str, key: str) -> Path:
    return outdir / "cache" / f"{claim_id}-{key}.json"


def store(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(schema.dumps(record))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path) -> dict[str, Any] | None:
    """The cached record at ``path``, or ``None`` if there is none or it cannot be read."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or schema.validate(record, schema.SCHEMA["properties"]["claims"]["items"]):
        return None
    return record


def last_seconds(outdir: Path, claim_id: str, part: str | None = None) -> float | None:
    """How long the claim's most recent cached run took (or, with ``part``, that part of it), under
    any key; ``None`` if it never finished (or had no such part)."""
    name = re.compile(rf"{re.escape(claim_id)}-[0-9a-f]{{16}}\.json")
    entries = [p for p in (outdir / "cache").glob(f"{claim_id}-*.json") if name.fullmatch(p.name)]
    for path in sorted(entries, key=lambda p: p.stat().st_mtime, reverse=True):
        record = load(path)
        if record is not None:
            if part is None:
                return float(record["seconds"])
            return next((float(p["seconds"]) for p in record.get("parts", []) if p["name"] == part), None)
    return None
