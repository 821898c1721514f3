r"""``AttentionConfig``: which variant of attention :class:`attnscale.MultiHeadAttention` runs.

One frozen, validated dataclass chooses, per axis (each a ``StrEnum``, strings accepted)::

    positional  none | rope | alibi                       options: rope=RopeOptions(...)
    qk_norm     none | l2 | rms | layer                   options: qk_norm_options=QKNormOptions(...)
    scale       inverse_sqrt | none | learned | length_scaled | fixed
                                                          options: temperature=, length_scaled=, fixed_scale=
    softcap     None or c > 0 (Gemma 2)
    window      None or (left, right), sides >= 0 or None (unlimited)
    sinks       False | True: a learned sink logit per query head (gpt-oss), initialised at 0
    kernel      softmax | linear | performer | int8       options: linear=, performer=, int8=

An options field belongs to one choice: it must be None unless that choice is selected, and is
filled with its defaults when the choice is selected without it, so equal configs compare equal.

Where the scale goes, per ``scale`` (the float handed to the kernel is ``MultiHeadAttention.scale``):

* ``inverse_sqrt`` (default): ``1/sqrt(D)``, D the per-head query/key dim.
* ``none``: 1.
* ``fixed``: ``fixed_scale``, any finite positive multiplier of ``q . k`` (for a divisor d pass
  ``fixed_scale=1/d``). ``MultiHeadAttention(scale=...)`` maps to this mode.
* ``learned``: a learned temperature ``exp(log_scale)`` folded into q (per head, or one scalar
  with ``TemperatureOptions(per_head=False)``), initialised at ``1/sqrt(D)`` or ``init``; the
  kernel then gets 1.
* ``length_scaled``: Scalable-Softmax, ``s * log(n_i)`` per query row folded into q on top of
  ``1/sqrt(D)`` (``n_i`` the keys row i sees; ``s`` learned from ``1/log(n_train)`` or fixed).

For ``kernel="linear"`` the same scale multiplies q before the feature map (``inverse_sqrt`` is
``linear_attention(..., scale_queries=True)``, ``none`` is ``scale_queries=False``); Performer and
INT8 take it as their ``scale``.

Rules checked at construction (each a ``ValueError`` naming the field, what was expected, what
arrived and a fix):

* ``softcap``, ``window``, ``sinks``, ``positional="alibi"`` and ``scale="length_scaled"`` act on
  softmax logits, on its denominator or on which keys softmax sees: they need ``kernel="softmax"``.
* ``qk_norm_options.learned_scale`` (Henry et al.'s learned ``g``, which replaces the scale)
  needs ``scale="none"``; with ``scale="learned"`` two learned scalars would multiply the same
  logits, which is ambiguous. With ``qk_norm="l2"`` it needs ``seq_len`` or ``scale_init``.
* ``fixed_scale`` is given exactly when ``scale="fixed"``.
* ``rope.rotary_dim`` is even; that it is at most the head dim is checked when the module is
  built, where the head dim is known.

``qk_norm="l2"`` with ``scale="inverse_sqrt"`` is allowed but emits
:class:`attnscale.variants.DoubleShrinkWarning`: unit-length q and k already give cosines in
``[-1, 1]``, and ``1/sqrt(D)`` shrinks them again, leaving softmax nearly uniform. With ``l2`` and
``scale="learned"``, prefer ``TemperatureOptions(init=...)`` well above ``1/sqrt(D)`` for the
same reason. Forward-time rules (need_weights, masks and caches with non-softmax kernels) are
listed in :meth:`attnscale.MultiHeadAttention.forward`.

``to_dict()`` gives the stable JSON form (``schema`` = "attnscale.attention_config/1", every
field present, enums as strings, options as objects or null); ``from_dict`` reads it back.

>>> from attnscale import AttentionConfig
>>> from attnscale.config import RopeOptions
>>> cfg = AttentionConfig(positional="rope", rope=RopeOptions(base=500000.0), qk_norm="rms")
>>> cfg.rope.layout, cfg.scale
(<RopeLayout.HALF: 'half'>, <ScaleMode.INVERSE_SQRT: 'inverse_sqrt'>)
>>> AttentionConfig.from_dict(cfg.to_dict()) == cfg
True
>>> AttentionConfig(kernel="linear", softcap=30.0)
Traceback (most recent call last):
...
ValueError: softcap: expected None with kernel='linear' (softcap bounds softmax logits), got 30.0. Fix: drop softcap, or use kernel='softmax'
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from enum import StrEnum
from typing import Any

from ._validate import check_bool, check_choice, check_positive_finite, check_window, fail
from .variants._checks import check_float, check_int
from .variants.linear import FeatureMap
from .variants.qknorm import DoubleShrinkWarning
from .variants.rope import RopeLayout

__all__ = [
    "AttentionConfig",
    "AttentionKernel",
    "Int8Options",
    "LengthScaleOptions",
    "LinearOptions",
    "PerformerOptions",
    "PositionalScheme",
    "QKNormMode",
    "QKNormOptions",
    "RopeOptions",
    "ScaleMode",
    "TemperatureOptions",
]

SCHEMA = "attnscale.attention_config/1"


class PositionalScheme(StrEnum):
    """How positions enter attention: not at all, by rotating q and k (RoPE), or by an ALiBi bias."""

    NONE = "none"
    ROPE = "rope"
    ALIBI = "alibi"


class QKNormMode(StrEnum):
    """Normalisation of q and k over the head dim (see :mod:`attnscale.variants.qknorm`)."""

    NONE = "none"
    L2 = "l2"
    RMS = "rms"
    LAYER = "layer"


class ScaleMode(StrEnum):
    """What multiplies ``q . k`` (see the module doc)."""

    INVERSE_SQRT = "inverse_sqrt"
    NONE = "none"
    LEARNED = "learned"
    LENGTH_SCALED = "length_scaled"
    FIXED = "fixed"


class AttentionKernel(StrEnum):
    """What turns q, k and v into the output: exact softmax or one of the approximations."""

    SOFTMAX = "softmax"
    LINEAR = "linear"
    PERFORMER = "performer"
    INT8 = "int8"


def _optional(check: Any, arg: str, value: object, **kwargs: Any) -> Any:
    return None if value is None else check(arg, value, **kwargs)


@dataclass(frozen=True)
class RopeOptions:
    """RoPE: pair layout, frequency base, and how many leading dims rotate (None: all D; even)."""

    layout: RopeLayout | str = RopeLayout.HALF
    base: float = 10000.0
    rotary_dim: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", check_choice("rope.layout", self.layout, RopeLayout))
        object.__setattr__(self, "base", check_float("rope.base", self.base))
        rotary_dim = _optional(check_int, "rope.rotary_dim", self.rotary_dim, minimum=2)
        if rotary_dim is not None and rotary_dim % 2:
            fail("rope.rotary_dim", "an even int (dims rotate in pairs)", repr(rotary_dim), f"pass rotary_dim={rotary_dim - 1}, or None for the whole head dim")
        object.__setattr__(self, "rotary_dim", rotary_dim)


@dataclass(frozen=True)
class QKNormOptions:
    """QK-Norm: ``learned_scale`` multiplies q by a learned scalar ``g`` after the norm (Henry et
    al. 2020), initialised at ``scale_init``, else ``log2(seq_len^2 - seq_len)`` for ``l2`` and
    ``1/sqrt(D)`` for ``rms`` / ``layer``."""

    learned_scale: bool = False
    seq_len: int | None = None
    scale_init: float | None = None

    def __post_init__(self) -> None:
        check_bool("qk_norm_options.learned_scale", self.learned_scale)
        object.__setattr__(self, "seq_len", _optional(check_int, "qk_norm_options.seq_len", self.seq_len, minimum=2))
        object.__setattr__(self, "scale_init", _optional(check_float, "qk_norm_options.scale_init", self.scale_init))
        if not self.learned_scale:
            for name in ("seq_len", "scale_init"):
                if getattr(self, name) is not None:
                    fail(f"qk_norm_options.{name}", "None unless learned_scale=True (it initialises g)", repr(getattr(self, name)), f"drop {name}, or pass learned_scale=True")


@dataclass(frozen=True)
class TemperatureOptions:
    """Learned temperature: one per query head or one scalar; ``init`` is the starting multiplier
    (None: ``1/sqrt(D)``, standard attention at step 0)."""

    per_head: bool = True
    init: float | None = None

    def __post_init__(self) -> None:
        check_bool("temperature.per_head", self.per_head)
        object.__setattr__(self, "init", _optional(check_float, "temperature.init", self.init))


@dataclass(frozen=True)
class LengthScaleOptions:
    """Scalable-Softmax: ``s`` per head starts at ``s_init``, else ``1/log(n_train)``; with
    ``learnable=False`` and no ``s_init`` it is the fixed ``log(n) / log(n_train)`` scaling."""

    n_train: int | None = None
    s_init: float | None = None
    learnable: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_train", _optional(check_int, "length_scaled.n_train", self.n_train, minimum=2))
        object.__setattr__(self, "s_init", _optional(check_float, "length_scaled.s_init", self.s_init))
        check_bool("length_scaled.learnable", self.learnable)
        if self.n_train is None and self.s_init is None:
            fail("length_scaled.n_train", "the training length (>= 2), or an explicit s_init", "None", "pass LengthScaleOptions(n_train=2048) or s_init=...")


@dataclass(frozen=True)
class LinearOptions:
    """Linear attention's feature map: ``elu`` (``elu(x) + 1``) or ``relu``."""

    feature_map: FeatureMap | str = FeatureMap.ELU

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_map", check_choice("linear.feature_map", self.feature_map, FeatureMap))


@dataclass(frozen=True)
class PerformerOptions:
    """FAVOR+: number of random features, the seed of the projection, orthogonal or i.i.d. rows."""

    num_features: int = 256
    seed: int = 0
    orthogonal: bool = True

    def __post_init__(self) -> None:
        check_int("performer.num_features", self.num_features, minimum=1)
        check_int("performer.seed", self.seed, minimum=0)
        check_bool("performer.orthogonal", self.orthogonal)


@dataclass(frozen=True)
class Int8Options:
    """INT8 attention: query and key block sizes of the quantisation, and key smoothing."""

    block_q: int = 128
    block_k: int = 64
    smooth_k: bool = True

    def __post_init__(self) -> None:
        check_int("int8.block_q", self.block_q, minimum=1)
        check_int("int8.block_k", self.block_k, minimum=1)
        check_bool("int8.smooth_k", self.smooth_k)


# Each options field: its class, the axis that selects it, and the choice it belongs to.
_OPTIONS: dict[str, tuple[type, str, StrEnum]] = {
    "rope": (RopeOptions, "positional", PositionalScheme.ROPE),
    "temperature": (TemperatureOptions, "scale", ScaleMode.LEARNED),
    "length_scaled": (LengthScaleOptions, "scale", ScaleMode.LENGTH_SCALED),
    "linear": (LinearOptions, "kernel", AttentionKernel.LINEAR),
    "performer": (PerformerOptions, "kernel", AttentionKernel.PERFORMER),
    "int8": (Int8Options, "kernel", AttentionKernel.INT8),
}


@dataclass(frozen=True)
class AttentionConfig:
    """The attention variant of :class:`attnscale.MultiHeadAttention`; the default is standard
    multi-head attention (softmax, ``1/sqrt(D)``, no positional scheme). See the module doc."""

    positional: PositionalScheme | str = PositionalScheme.NONE
    rope: RopeOptions | None = None
    qk_norm: QKNormMode | str = QKNormMode.NONE
    qk_norm_options: QKNormOptions | None = None
    scale: ScaleMode | str = ScaleMode.INVERSE_SQRT
    fixed_scale: float | None = None
    temperature: TemperatureOptions | None = None
    length_scaled: LengthScaleOptions | None = None
    softcap: float | None = None
    window: tuple[int | None, int | None] | None = None
    sinks: bool = False
    kernel: AttentionKernel | str = AttentionKernel.SOFTMAX
    linear: LinearOptions | None = None
    performer: PerformerOptions | None = None
    int8: Int8Options | None = None

    def __post_init__(self) -> None:
        for name, enum in (("positional", PositionalScheme), ("qk_norm", QKNormMode), ("scale", ScaleMode), ("kernel", AttentionKernel)):
            object.__setattr__(self, name, check_choice(name, getattr(self, name), enum))
        self._check_options()
        self._check_scale()
        object.__setattr__(self, "softcap", check_positive_finite("softcap", self.softcap))
        object.__setattr__(self, "window", check_window(self.window))
        check_bool("sinks", self.sinks)
        self._check_kernel()
        if self.qk_norm is QKNormMode.L2 and self.scale is ScaleMode.INVERSE_SQRT:
            warnings.warn(
                DoubleShrinkWarning(
                    "qk_norm='l2' makes q and k unit vectors, so q.k is already a cosine in [-1, 1]; "
                    "scale='inverse_sqrt' shrinks it again to [-1/sqrt(D), 1/sqrt(D)] and softmax stays nearly "
                    "uniform. Use scale='none', a learned scale (QKNormOptions(learned_scale=True, seq_len=L), "
                    "Henry et al. 2020) or qk_norm='rms'."
                ),
                stacklevel=3,  # the caller's line, past the dataclass __init__
            )

    def _check_options(self) -> None:
        for name, (cls, axis, choice) in _OPTIONS.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                fail(name, f"None or a {cls.__name__}", type(value).__name__, f"pass {name}={cls.__name__}(...)", exc=TypeError)
            selected = getattr(self, axis) is choice
            if value is not None and not selected:
                fail(name, f"None unless {axis}={choice.value!r}", repr(value), f"drop {name}, or pass {axis}={choice.value!r}")
            if value is None and selected:
                object.__setattr__(self, name, cls())
        options = self.qk_norm_options
        if options is not None and not isinstance(options, QKNormOptions):
            fail("qk_norm_options", "None or a QKNormOptions", type(options).__name__, "pass qk_norm_options=QKNormOptions(...)", exc=TypeError)
        if options is not None and self.qk_norm is QKNormMode.NONE:
            fail("qk_norm_options", "None unless qk_norm is 'l2', 'rms' or 'layer'", repr(options), "drop qk_norm_options, or choose a qk_norm")
        if options is None and self.qk_norm is not QKNormMode.NONE:
            object.__setattr__(self, "qk_norm_options", QKNormOptions())

    def _check_scale(self) -> None:
        fixed = self.scale is ScaleMode.FIXED
        if fixed and self.fixed_scale is None:
            fail("fixed_scale", "a finite positive float with scale='fixed'", "None", "pass e.g. fixed_scale=0.125 (for a divisor d: 1/d)")
        if not fixed and self.fixed_scale is not None:
            fail("fixed_scale", f"None unless scale='fixed' (scale is {self.scale.value!r})", repr(self.fixed_scale), "drop fixed_scale, or pass scale='fixed'")
        object.__setattr__(self, "fixed_scale", check_positive_finite("fixed_scale", self.fixed_scale))
        options = self.qk_norm_options
        if options is None or not options.learned_scale:
            return
        if self.scale is ScaleMode.LEARNED:
            fail(
                "scale",
                "not 'learned' with qk_norm_options.learned_scale=True (QK-Norm's g and a learned temperature "
                "would both multiply the same logits: which one learns the scale is ambiguous)",
                repr(self.scale.value),
                "keep one: scale='none' with the learned g, or learned_scale=False with scale='learned'",
            )
        if self.scale is not ScaleMode.NONE:
            fail("scale", "'none' with qk_norm_options.learned_scale=True (the learned g replaces the scale)", repr(self.scale.value), "pass scale='none', or learned_scale=False")
        if self.qk_norm is QKNormMode.L2 and options.seq_len is None and options.scale_init is None:
            fail("qk_norm_options.seq_len", "the training length L for g's init log2(L^2 - L) with qk_norm='l2'", "None", "pass QKNormOptions(learned_scale=True, seq_len=L) or scale_init=...")

    def _check_kernel(self) -> None:
        kernel = self.kernel
        if kernel is AttentionKernel.SOFTMAX:
            return
        on = f"with kernel={kernel.value!r}"
        if self.softcap is not None:
            fail("softcap", f"None {on} (softcap bounds softmax logits)", repr(self.softcap), "drop softcap, or use kernel='softmax'")
        if self.window is not None:
            fail("window", f"None {on} (windows hide keys from a softmax)", repr(self.window), "drop window, or use kernel='softmax'")
        if self.sinks:
            fail("sinks", f"False {on} (a sink joins a softmax denominator)", "True", "drop sinks, or use kernel='softmax'")
        if self.positional is PositionalScheme.ALIBI:
            fail("positional", f"'none' or 'rope' {on} (ALiBi is a bias on softmax logits)", "'alibi'", "use positional='rope', or kernel='softmax'")
        if self.scale is ScaleMode.LENGTH_SCALED:
            fail("scale", f"not 'length_scaled' {on} (Scalable-Softmax counts the keys each softmax row sees)", "'length_scaled'", "use another scale mode, or kernel='softmax'")

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form: every field, enums as strings, options as dicts or None."""
        out: dict[str, Any] = {"schema": SCHEMA}
        for f in fields(self):
            value = getattr(self, f.name)
            if is_dataclass(value):
                value = {g.name: _plain(getattr(value, g.name)) for g in fields(value)}
            out[f.name] = _plain(value)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AttentionConfig:
        """Read :meth:`to_dict`'s form back (fields left out take their defaults); validates like the constructor."""
        if not isinstance(data, Mapping):
            fail("data", "a mapping from AttentionConfig.to_dict()", type(data).__name__, "pass the dict (json.loads the text first)", exc=TypeError)
        if data.get("schema", SCHEMA) != SCHEMA:
            fail("data", f"schema {SCHEMA!r}", repr(data.get("schema")), "pass the output of AttentionConfig.to_dict()")
        kwargs = {k: v for k, v in data.items() if k != "schema"}
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            fail("data", f"keys among {sorted(names)}", f"unknown keys {unknown}", "remove them; check the spelling")
        option_classes = {name: spec[0] for name, spec in _OPTIONS.items()} | {"qk_norm_options": QKNormOptions}
        for name, option_cls in option_classes.items():
            value = kwargs.get(name)
            if isinstance(value, Mapping):
                known = {f.name for f in fields(option_cls)}
                if set(value) - known:
                    fail(name, f"keys among {sorted(known)}", f"unknown keys {sorted(set(value) - known)}", "remove them; check the spelling")
                kwargs[name] = option_cls(**value)
        if isinstance(kwargs.get("window"), list):
            kwargs["window"] = tuple(kwargs["window"])
        return cls(**kwargs)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    @classmethod
    def from_json(cls, text: str) -> AttentionConfig:
        """Read :meth:`to_json`'s text back; validates like :meth:`from_dict`.

        Text that is not JSON, or JSON that is not an object, raises ``ValueError`` saying where
        and what it found; anything but ``str`` / ``bytes`` raises ``TypeError``.
        """
        if not isinstance(text, (str, bytes, bytearray)):
            fail("text", "a JSON string (AttentionConfig.to_json())", type(text).__name__, "pass the text itself, e.g. Path(p).read_text()", exc=TypeError)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            fail("text", "valid JSON (AttentionConfig.to_json())", f"{e.msg} at line {e.lineno}, column {e.colno}", "correct the text there (keys and strings in double quotes, no trailing commas)")
        except UnicodeDecodeError as e:
            fail("text", "UTF-8 encoded JSON", f"undecodable byte at position {e.start}", "decode the bytes with their encoding first")
        if not isinstance(data, dict):
            kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
            fail("text", "a JSON object {...} (AttentionConfig.to_json())", f"a JSON {kind}", "pass the object that to_json() wrote, not a list or a value")
        return cls.from_dict(data)

    def with_fixed_scale(self, scale: float) -> AttentionConfig:
        """This config with ``scale="fixed"`` at ``scale`` (what ``MultiHeadAttention(scale=...)`` does)."""
        return replace(self, scale=ScaleMode.FIXED, fixed_scale=scale)


def _plain(value: object) -> object:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value
