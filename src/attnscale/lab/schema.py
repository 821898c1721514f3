"""The stable form of ``results.json``, a validator for it, and the conversion of results to JSON.

``results.json`` (every key below is always present, except a figure's ``caption``; ``null`` where noted)::

    {
      "schema_version": 1,
      "attnscale_version": "0.1.0",
      "created": "2026-01-31T12:00:00+00:00",      ISO 8601, UTC
      "profile": "tiny" | "quick" | "default" | "full",
      "seed": 0,
      "seconds": 41.2,                             wall time of the whole report
      "environment": {
        "python": "3.11.2", "torch": "2.13.0", "numpy": "2.1.0", "platform": "Linux-...",
        "cpu": "model name", "cpu_count": 2,
        "jobs": 2,                                 experiments run at once (one process each)
        "threads": 1,                              torch threads inside each experiment process
        "executor": "local" | "ray",               where the experiments ran (attnscale report --executor)
        "commit": "0123abc..." | "0123abc...+changes" | null   git commit of the sources that ran
      },
      "not_measured": [{"id": "...", "statement": "..."}],   claims with no experiment yet
      "claims": [                                  in the order of CLAIMS.md
        {
          "id": "variance-law", "statement": "...", "sources": ["..."],
          "method": "...", "rule": "...",          the verdict rule in words
          "rule_history": [{"version": 1, "date": "2026-11-29", "why": "...", "fingerprint": "..."}],
          "rule_version": 1 | null,                the version whose fingerprint the code matches
          "rule_fingerprint": "0123456789abcdef",   attnscale.lab.base.rule_fingerprint of the code that judged
          "verdict": "holds" | "holds-approximately" | "does-not-hold" | "inconclusive",
          "reason": "...",
          "arms": [{"name": "AdamW", "verdict": "...", "reason": "..."}],   each arm's own verdict, or []
          "headline": {"key": "var_over_dk.64", "value": 1.01,
                       "label": "Var(q.k) / d_k at d_k = 64", "unit": ""} | null,
          "measured": {...},                       the experiment's own JSON (named numbers, tables)
          "figures": [{"name": "variance", "svg": "figures/variance-law/variance.svg",
                       "png": "figures/variance-law/variance.png",
                       "caption": "what it shows and what to look at"}],   caption: absent in older files
          "config": {...},                         the experiment's Config, as a dict
          "seconds": 3.1,                          run + judge + plot, wall time, when it was computed
          "cpu_seconds": 2.9,                      the same, CPU time of its process (load-independent)
          "cached": false,                         true: taken from OUT/cache, not recomputed
          "parts": [{"name": "adamw default/64", "seconds": 20.3, "cpu_seconds": 19.8}],
                                                   only for an experiment run in parts, side by side:
                                                   each part's time (the claim's seconds add them up)
          "error": null | "traceback text"         set when the experiment (or its figures) failed
        }
      ]
    }

JSON has no NaN or infinity: :func:`to_jsonable` writes them as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` everywhere (keeping the distinction that ``null`` would lose).
Tuples become lists, NumPy and torch scalars and arrays become numbers and lists, dict keys strings.

>>> to_jsonable({"x": float("inf"), "y": (1, float("nan")), 2: 0.5})
{'x': 'Infinity', 'y': [1, 'NaN'], '2': 0.5}
>>> validate({"claims": [{"verdict": "maybe"}]})[:2]
['$: missing key schema_version', '$: missing key attnscale_version']
>>> [e for e in validate({"claims": [{"verdict": "maybe"}]}) if "verdict" in e]
["$.claims[0].verdict: 'maybe' is not one of ['holds', 'holds-approximately', 'does-not-hold', 'inconclusive']"]
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["SCHEMA", "SCHEMA_VERSION", "VERDICTS", "check", "dumps", "to_jsonable", "validate"]

SCHEMA_VERSION = 2
VERDICTS = ("holds", "holds-approximately", "does-not-hold", "inconclusive")

_NUMBER = {"type": "number"}
_STRING = {"type": "string"}
_FIGURE = {
    "type": "object",
    "required": ["name", "svg", "png"],
    "properties": {"name": _STRING, "svg": _STRING, "png": _STRING, "caption": _STRING},
}
_RULE_VERSION = {
    "type": "object",
    "required": ["version", "date", "why", "fingerprint"],
    "properties": {"version": {"type": "integer"}, "date": _STRING, "why": _STRING, "fingerprint": _STRING},
}
_ARM = {
    "type": "object",
    "required": ["name", "verdict", "reason"],
    "properties": {"name": _STRING, "verdict": {"type": "string", "enum": list(VERDICTS)}, "reason": _STRING},
}
_CLAIM = {
    "type": "object",
    "required": [
        "id", "statement", "sources", "method", "rule", "rule_history", "rule_version", "rule_fingerprint",
        "verdict", "reason", "arms", "headline",
        "measured", "figures", "config", "seconds", "cpu_seconds", "cached", "error",
    ],
    "properties": {
        "id": _STRING,
        "statement": _STRING,
        "sources": {"type": "array", "items": _STRING},
        "method": _STRING,
        "rule": _STRING,
        "rule_history": {"type": "array", "items": _RULE_VERSION},
        "rule_version": {"type": ["integer", "null"]},
        "rule_fingerprint": _STRING,
        "verdict": {"type": "string", "enum": list(VERDICTS)},
        "reason": _STRING,
        "arms": {"type": "array", "items": _ARM},
        "headline": {
            "type": ["object", "null"],
            "required": ["key", "value", "label", "unit"],
            "properties": {"key": _STRING, "label": _STRING, "unit": _STRING, "spread": {"type": ["number", "null"]}},
        },
        "measured": {"type": "object"},
        "figures": {"type": "array", "items": _FIGURE},
        "config": {"type": "object"},
        "seconds": _NUMBER,
        "cpu_seconds": _NUMBER,
        "cached": {"type": "boolean"},
        "error": {"type": ["string", "null"]},
        "parts": {
            "type": "array",
            "items": {"type": "object", "required": ["name", "seconds", "cpu_seconds"], "properties": {"name": _STRING, "seconds": _NUMBER, "cpu_seconds": _NUMBER}},
        },
    },
}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema_version", "attnscale_version", "created", "profile", "seed", "seconds",
        "environment", "not_measured", "claims",
    ],
    "properties": {
        "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
        "attnscale_version": _STRING,
        "created": {"type": "string", "format": "date-time"},
        "profile": {"type": "string", "enum": ["tiny", "quick", "default", "full"]},
        "seed": {"type": "integer"},
        "seconds": _NUMBER,
        "environment": {
            "type": "object",
            "required": ["python", "torch", "threads", "cpu"],
            "properties": {"python": _STRING, "torch": _STRING, "threads": {"type": "integer"}, "cpu": _STRING},
        },
        "not_measured": {
            "type": "array",
            "items": {"type": "object", "required": ["id", "statement"], "properties": {"id": _STRING, "statement": _STRING}},
        },
        "claims": {"type": "array", "items": _CLAIM},
    },
}
"""A JSON-Schema subset: type (name or list), required, properties, items, enum, format date-time."""

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _TYPES[name])


def _is_datetime(text: str) -> bool:
    from datetime import datetime

    try:
        datetime.fromisoformat(text)
    except ValueError:
        return False
    return "T" in text


def validate(doc: Any, schema: Mapping[str, Any] = SCHEMA, path: str = "$") -> list[str]:
    """Every way ``doc`` departs from ``schema``, as ``"json.path: problem"`` lines; ``[]`` if none."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(doc, n) for n in names):
            return [f"{path}: expected {' or '.join(names)}, got {type(doc).__name__}"]
    errors: list[str] = []
    if "enum" in schema and doc not in schema["enum"]:
        errors.append(f"{path}: {doc!r} is not one of {schema['enum']}")
    if schema.get("format") == "date-time" and isinstance(doc, str) and not _is_datetime(doc):
        errors.append(f"{path}: {doc!r} is not an ISO 8601 date-time")
    if isinstance(doc, dict):
        errors += [f"{path}: missing key {key}" for key in schema.get("required", ()) if key not in doc]
        for key, sub in schema.get("properties", {}).items():
            if key in doc:
                errors += validate(doc[key], sub, f"{path}.{key}")
    if isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors


def _has_nonfinite(obj: Any) -> bool:
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, dict):
        return any(_has_nonfinite(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_nonfinite(v) for v in obj)
    return False


def check(doc: Any) -> None:
    """Raise ``ValueError`` listing every schema violation, or a float JSON cannot hold."""
    errors = validate(doc)
    if _has_nonfinite(doc):
        errors.append("$: contains NaN or infinity; pass it through to_jsonable first")
    if errors:
        raise ValueError("results.json does not follow attnscale.lab.schema:\n  " + "\n  ".join(errors))


def _float(x: float) -> float | str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def to_jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON types, with non-finite floats as strings (see the module docstring)."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return _float(float(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    tolist = getattr(obj, "tolist", None)  # NumPy and torch scalars and arrays
    if callable(tolist):
        return to_jsonable(tolist())
    raise TypeError(f"cannot store a {type(obj).__name__} in results.json: {obj!r:.80}")


def dumps(doc: Any) -> str:
    """``doc`` as indented JSON; refuses NaN and infinity (call :func:`to_jsonable` first)."""
    return json.dumps(doc, indent=2, allow_nan=False, ensure_ascii=False) + "\n"
