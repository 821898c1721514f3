"""Finished experiments, kept in ``OUT/cache`` so that an interrupted report resumes where it stopped.

An entry is ``OUT/cache/<claim id>-<key>.json``: the claim's record in results.json form. The key
hashes everything that decides the measurement: the config, the seed, the attnscale version, the
experiment module's source, and the source of the library it measures (every module of the
package except the report machinery and the other experiment modules; private helpers such as
``experiments/_common.py`` count). An entry holds its key and its claim id beside the record
(``{"key": ..., "claim": ..., "record": {...}}``) and is used only where both are the ones it is
read for: a file copied or renamed over another's (another claim, profile, seed or rule) is
recomputed, and :func:`read` says why. Entries are written atomically
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

__all__ = ["cache_key", "cache_path", "last_seconds", "library_source_hash", "load", "read", "store"]

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
    "lab/timings.py",
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


def _key_of(path: Path) -> str:
    """The key an entry's file name says it holds (its last 16 hex digits)."""
    return path.stem[-16:]


def store(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` atomically, with the key and claim id the path names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"key": _key_of(path), "claim": record.get("id"), "record": record}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(schema.dumps(entry))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(path: Path, claim_id: str) -> tuple[dict[str, Any] | None, str]:
    """(the cached record at ``path`` for ``claim_id``, "") where it is the record of that claim under
    the key the path names; else (None, why): "" where there is no entry, a reason where an entry is
    there and is not used (unreadable, not a record, or another claim's or key's)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror})"
    try:
        entry = json.loads(text)
    except ValueError:
        return None, "is not JSON"
    if not isinstance(entry, dict) or not isinstance(entry.get("record"), dict):
        return None, "is not a cache entry"
    record = entry["record"]
    if entry.get("key") != _key_of(path) or entry.get("claim") != claim_id or record.get("id") != claim_id:
        held = f"{entry.get('claim')!r} under key {entry.get('key')!r}"
        return None, f"holds {held}, not {claim_id!r} under key {_key_of(path)!r} (copied or renamed from another claim, profile, seed or rule)"
    if schema.validate(record, schema.SCHEMA["properties"]["claims"]["items"]):
        return None, "is not a valid claim record"
    return record, ""


def load(path: Path, claim_id: str) -> dict[str, Any] | None:
    """The cached record at ``path`` for ``claim_id`` (:func:`read`), or ``None``."""
    return read(path, claim_id)[0]


def last_seconds(outdir: Path, claim_id: str, part: str | None = None) -> float | None:
    """How long the claim's most recent cached run took (or, with ``part``, that part of it), under
    any key; ``None`` if it never finished (or had no such part)."""
    name = re.compile(rf"{re.escape(claim_id)}-[0-9a-f]{{16}}\.json")
    entries = [p for p in (outdir / "cache").glob(f"{claim_id}-*.json") if name.fullmatch(p.name)]
    for path in sorted(entries, key=lambda p: p.stat().st_mtime, reverse=True):
        record = load(path, claim_id)
        if record is not None:
            if part is None:
                return float(record["seconds"])
            return next((float(p["seconds"]) for p in record.get("parts", []) if p["name"] == part), None)
    return None
