import json
import math
import warnings

import pytest
import torch

import attnscale
from attnscale import AttentionConfig, KVCache, MultiHeadAttention
from attnscale.config import (
    AttentionKernel,
    Int8Options,
    LengthScaleOptions,
    LinearOptions,
    PerformerOptions,
    PositionalScheme,
    QKNormMode,
    QKNormOptions,
    RopeOptions,
    ScaleMode,
    TemperatureOptions,
)
from attnscale.variants import DoubleShrinkWarning, FeatureMap, RopeLayout

# --- choices and defaults ------------------------------------------------------------------------


def test_default_is_standard_attention():
    cfg = AttentionConfig()
    assert (cfg.positional, cfg.qk_norm, cfg.scale, cfg.kernel) == ("none", "none", "inverse_sqrt", "softmax")
    assert cfg.softcap is None and cfg.window is None
    assert all(getattr(cfg, name) is None for name in ("rope", "qk_norm_options", "temperature", "length_scaled", "linear", "performer", "int8"))


def test_strings_become_enums_and_selected_options_get_defaults():
    cfg = AttentionConfig(positional="rope", qk_norm="rms", scale="learned", kernel="performer")
    assert cfg.positional is PositionalScheme.ROPE and cfg.qk_norm is QKNormMode.RMS
    assert cfg.scale is ScaleMode.LEARNED and cfg.kernel is AttentionKernel.PERFORMER
    assert cfg.rope == RopeOptions() and cfg.rope.layout is RopeLayout.HALF
    assert cfg.qk_norm_options == QKNormOptions() and cfg.temperature == TemperatureOptions()
    assert cfg.performer == PerformerOptions()
    assert cfg == AttentionConfig(positional="rope", rope=RopeOptions(), qk_norm="rms", scale="learned", kernel="performer")
    assert hash(cfg) == hash(AttentionConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}))
    assert LinearOptions(feature_map="relu").feature_map is FeatureMap.RELU
    assert AttentionConfig(window=[4, -1]).window == (4, None)  # -1 means unlimited, as in scaled_dot_product_attention


def test_config_is_frozen():
    cfg = AttentionConfig()
    with pytest.raises(AttributeError):
        cfg.softcap = 5.0  # type: ignore[misc]


# --- every invalid combination is named ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, arg, exc",
    [
        # choices
        ({"positional": "yarn"}, "positional", ValueError),
        ({"qk_norm": "batch"}, "qk_norm", ValueError),
        ({"scale": "sqrt"}, "scale", ValueError),
        ({"kernel": "flash"}, "kernel", ValueError),
        ({"kernel": 3}, "kernel", TypeError),
        # options only with their choice, and of their type
        ({"rope": RopeOptions()}, "rope", ValueError),
        ({"positional": "rope", "rope": {"base": 1e6}}, "rope", TypeError),
        ({"qk_norm_options": QKNormOptions()}, "qk_norm_options", ValueError),
        ({"qk_norm": "rms", "qk_norm_options": "learned"}, "qk_norm_options", TypeError),
        ({"temperature": TemperatureOptions()}, "temperature", ValueError),
        ({"scale": "learned", "length_scaled": LengthScaleOptions(n_train=64)}, "length_scaled", ValueError),
        ({"performer": PerformerOptions()}, "performer", ValueError),
        ({"kernel": "linear", "int8": Int8Options()}, "int8", ValueError),
        ({"linear": LinearOptions()}, "linear", ValueError),
        # the fixed scale
        ({"scale": "fixed"}, "fixed_scale", ValueError),
        ({"fixed_scale": 0.5}, "fixed_scale", ValueError),
        ({"scale": "fixed", "fixed_scale": 0.0}, "fixed_scale", ValueError),
        ({"scale": "fixed", "fixed_scale": math.inf}, "fixed_scale", ValueError),
        ({"scale": "fixed", "fixed_scale": "1/8"}, "fixed_scale", TypeError),
        # softcap and window values
        ({"softcap": -1.0}, "softcap", ValueError),
        ({"softcap": math.nan}, "softcap", ValueError),
        ({"window": (-2, 0)}, "window", ValueError),
        ({"window": (3, -5)}, "window", ValueError),
        ({"window": (1, 2, 3)}, "window", ValueError),
        ({"window": 4}, "window", ValueError),
        # softmax-only features with another kernel
        ({"kernel": "linear", "softcap": 30.0}, "softcap", ValueError),
        ({"kernel": "performer", "window": (8, 0)}, "window", ValueError),
        ({"kernel": "int8", "window": (8, 0)}, "window", ValueError),
        ({"kernel": "int8", "positional": "alibi"}, "positional", ValueError),
        ({"kernel": "linear", "positional": "alibi"}, "positional", ValueError),
        ({"kernel": "performer", "scale": "length_scaled", "length_scaled": LengthScaleOptions(n_train=64)}, "scale", ValueError),
        ({"kernel": "int8", "softcap": 5.0}, "softcap", ValueError),
        # QK-Norm's learned g against the scale mode
        ({"qk_norm": "rms", "qk_norm_options": QKNormOptions(learned_scale=True), "scale": "learned"}, "scale", ValueError),
        ({"qk_norm": "rms", "qk_norm_options": QKNormOptions(learned_scale=True)}, "scale", ValueError),
        ({"qk_norm": "layer", "qk_norm_options": QKNormOptions(learned_scale=True), "scale": "fixed", "fixed_scale": 0.5}, "scale", ValueError),
        ({"qk_norm": "l2", "qk_norm_options": QKNormOptions(learned_scale=True), "scale": "none"}, "qk_norm_options.seq_len", ValueError),
    ],
)
def test_invalid_configs_name_the_field(kwargs, arg, exc):
    with pytest.raises(exc, match=rf"^{arg}: expected .* got .*Fix: "):
        AttentionConfig(**kwargs)


def test_learned_qk_norm_scale_with_learned_temperature_is_called_ambiguous():
    with pytest.raises(ValueError, match=r"^scale: .*ambiguous"):
        AttentionConfig(qk_norm="rms", qk_norm_options=QKNormOptions(learned_scale=True), scale="learned")


@pytest.mark.parametrize(
    "make, arg, exc",
    [
        (lambda: RopeOptions(rotary_dim=5), "rope.rotary_dim", ValueError),
        (lambda: RopeOptions(rotary_dim=0), "rope.rotary_dim", ValueError),
        (lambda: RopeOptions(base=0.0), "rope.base", ValueError),
        (lambda: RopeOptions(layout="spiral"), "rope.layout", ValueError),
        (lambda: QKNormOptions(seq_len=128), "qk_norm_options.seq_len", ValueError),
        (lambda: QKNormOptions(scale_init=2.0), "qk_norm_options.scale_init", ValueError),
        (lambda: QKNormOptions(learned_scale=1), "qk_norm_options.learned_scale", TypeError),
        (lambda: TemperatureOptions(init=-0.1), "temperature.init", ValueError),
        (lambda: TemperatureOptions(per_head="yes"), "temperature.per_head", TypeError),
        (lambda: LengthScaleOptions(), "length_scaled.n_train", ValueError),
        (lambda: LengthScaleOptions(n_train=1), "length_scaled.n_train", ValueError),
        (lambda: LengthScaleOptions(s_init=0.0), "length_scaled.s_init", ValueError),
        (lambda: LinearOptions(feature_map="tanh"), "linear.feature_map", ValueError),
        (lambda: PerformerOptions(num_features=0), "performer.num_features", ValueError),
        (lambda: PerformerOptions(seed=-1), "performer.seed", ValueError),
        (lambda: Int8Options(block_q=0), "int8.block_q", ValueError),
        (lambda: Int8Options(block_k=2.0), "int8.block_k", TypeError),
        (lambda: Int8Options(smooth_k=None), "int8.smooth_k", TypeError),
    ],
)
def test_invalid_options_name_the_field(make, arg, exc):
    with pytest.raises(exc, match=rf"^{arg}: expected .* got .*Fix: "):
        make()


# --- the double-shrink warning -------------------------------------------------------------------


def test_l2_with_inverse_sqrt_warns_double_shrink_at_construction():
    with pytest.warns(DoubleShrinkWarning, match=r"qk_norm='l2'.*\[-1/sqrt\(D\), 1/sqrt\(D\)\]") as record:
        cfg = AttentionConfig(qk_norm="l2")
    assert record[0].filename == __file__  # points at the caller's line
    with pytest.warns(DoubleShrinkWarning):
        MultiHeadAttention(16, 2, config=AttentionConfig(qk_norm="l2"))
    assert cfg.qk_norm is QKNormMode.L2  # allowed: a warning, not an error


@pytest.mark.parametrize(
    "kwargs",
    [
        {"qk_norm": "l2", "scale": "none"},
        {"qk_norm": "l2", "qk_norm_options": QKNormOptions(learned_scale=True, seq_len=512), "scale": "none"},
        {"qk_norm": "l2", "scale": "learned", "temperature": TemperatureOptions(init=10.0)},
        {"qk_norm": "rms"},
    ],
)
def test_no_warning_without_double_shrink(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiHeadAttention(16, 2, config=AttentionConfig(**kwargs))


# --- JSON --------------------------------------------------------------------------------------------

ROUND_TRIP = [
    AttentionConfig(),
    AttentionConfig(positional="rope", rope=RopeOptions(layout="interleaved", base=5e5, rotary_dim=4), qk_norm="rms", window=(16, 0), softcap=50.0),
    AttentionConfig(positional="alibi", qk_norm="l2", qk_norm_options=QKNormOptions(learned_scale=True, seq_len=1024), scale="none"),
    AttentionConfig(qk_norm="layer", scale="learned", temperature=TemperatureOptions(per_head=False, init=0.25)),
    AttentionConfig(scale="length_scaled", length_scaled=LengthScaleOptions(n_train=2048, learnable=False)),
    AttentionConfig(scale="fixed", fixed_scale=1 / 32),
    AttentionConfig(kernel="linear", linear=LinearOptions(feature_map="relu"), scale="none"),
    AttentionConfig(kernel="performer", performer=PerformerOptions(num_features=64, seed=3, orthogonal=False), positional="rope"),
    AttentionConfig(kernel="int8", int8=Int8Options(block_q=32, block_k=16, smooth_k=False)),
]


@pytest.mark.parametrize("cfg", ROUND_TRIP, ids=[f"cfg{i}" for i in range(len(ROUND_TRIP))])
def test_json_round_trip(cfg):
    data = cfg.to_dict()
    assert data["schema"] == "attnscale.attention_config/1"
    assert set(data) == {"schema", *cfg.__dataclass_fields__}
    text = json.dumps(data)  # plain JSON types only
    back = AttentionConfig.from_dict(json.loads(text))
    assert back == cfg and back.to_dict() == data
    assert AttentionConfig.from_json(cfg.to_json()) == cfg


def test_json_form_is_stable():
    cfg = AttentionConfig(positional="rope", rope=RopeOptions(rotary_dim=4), window=(8, 0))
    assert cfg.to_dict() == {
        "schema": "attnscale.attention_config/1",
        "positional": "rope",
        "rope": {"layout": "half", "base": 10000.0, "rotary_dim": 4},
        "qk_norm": "none",
        "qk_norm_options": None,
        "scale": "inverse_sqrt",
        "fixed_scale": None,
        "temperature": None,
        "length_scaled": None,
        "softcap": None,
        "window": [8, 0],
        "sinks": False,
        "kernel": "softmax",
        "linear": None,
        "performer": None,
        "int8": None,
    }
    assert AttentionConfig.from_dict({"positional": "rope", "rope": {"rotary_dim": 4}, "window": [8, 0]}) == cfg


@pytest.mark.parametrize(
    "data, arg, exc",
    [
        ({"schema": "attnscale.monitor/1"}, "data", ValueError),
        ({"rotary": True}, "data", ValueError),
        ({"positional": "rope", "rope": {"theta": 1e4}}, "rope", ValueError),
        ({"kernel": "linear", "softcap": 30.0}, "softcap", ValueError),
        ([("kernel", "linear")], "data", TypeError),
    ],
)
def test_from_dict_errors_name_the_field(data, arg, exc):
    with pytest.raises(exc, match=rf"^{arg}: expected .* got .*Fix: "):
        AttentionConfig.from_dict(data)


# --- checks that need the module ----------------------------------------------------------------


@pytest.mark.parametrize(
    "make, arg, exc",
    [
        (lambda: MultiHeadAttention(32, 4, config=AttentionConfig(positional="rope", rope=RopeOptions(rotary_dim=10))), "config.rope.rotary_dim", ValueError),
        (lambda: MultiHeadAttention(32, 4, scale=0.5, config=AttentionConfig(scale="none")), "scale", ValueError),
        (lambda: MultiHeadAttention(32, 4, scale=0.5, config=AttentionConfig(kernel="linear", scale="none")), "scale", ValueError),
        (lambda: MultiHeadAttention(32, 4, config={"kernel": "linear"}), "config", TypeError),
        (lambda: MultiHeadAttention(32, 4, dropout=0.1, config=AttentionConfig(kernel="performer")), "dropout", ValueError),
        (lambda: MultiHeadAttention(32, 4, dropout=0.1, config=AttentionConfig(kernel="int8")), "dropout", ValueError),
    ],
)
def test_module_construction_errors_name_the_argument(make, arg, exc):
    with pytest.raises(exc, match=rf"^{arg}: expected .* got .*Fix: "):
        make()


def test_scale_argument_maps_to_the_fixed_mode():
    m = MultiHeadAttention(32, 4, scale=0.25)
    assert m.config == AttentionConfig(scale="fixed", fixed_scale=0.25) and m.scale == 0.25
    assert MultiHeadAttention(32, 4, scale=0.25, config=AttentionConfig(positional="rope")).config.scale is ScaleMode.FIXED
    assert MultiHeadAttention(32, 4).config == AttentionConfig()


@pytest.mark.parametrize(
    "kwargs, scale",
    [({}, 8**-0.5), ({"scale": "none"}, 1.0), ({"scale": "fixed", "fixed_scale": 0.3}, 0.3), ({"scale": "learned"}, 1.0),
     ({"scale": "length_scaled", "length_scaled": LengthScaleOptions(n_train=64)}, 8**-0.5)],
)
def test_module_scale_is_the_float_the_kernel_receives(kwargs, scale):
    assert math.isclose(MultiHeadAttention(32, 4, config=AttentionConfig(**kwargs)).scale, scale, rel_tol=1e-15)


@pytest.mark.parametrize("kernel", ["linear", "performer", "int8"])
@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda m, x: m(x, need_weights=True), "need_weights"),
        (lambda m, x: m(x, return_stats=True), "return_stats"),
        (lambda m, x: m(x, key_mask=torch.ones(2, 5, dtype=torch.bool)), "attn_mask"),
        (lambda m, x: m(x, attn_mask=torch.ones(5, 5, dtype=torch.bool)), "attn_mask"),
    ],
)
def test_non_softmax_kernels_reject_softmax_only_forward_options(kernel, call, arg):
    m = MultiHeadAttention(16, 4, config=AttentionConfig(kernel=kernel))
    with pytest.raises(ValueError, match=rf"^{arg}: expected .*kernel='{kernel}'.* got .*Fix: "):
        call(m, torch.randn(2, 5, 16))


@pytest.mark.parametrize("kernel", ["linear", "performer"])
def test_linear_kernels_reject_a_cache_and_unequal_causal_lengths(kernel):
    m = MultiHeadAttention(16, 4, config=AttentionConfig(kernel=kernel))
    cache = KVCache()
    with pytest.raises(ValueError, match=rf"^cache: expected None with kernel='{kernel}'"):
        m(torch.randn(2, 5, 16), cache=cache, is_causal=True)
    assert len(cache) == 0
    with pytest.raises(ValueError, match=rf"^is_causal: expected False when L != S with kernel='{kernel}'"):
        m(torch.randn(2, 3, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16), is_causal=True)
    assert m(torch.randn(2, 3, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16)).shape == (2, 3, 16)


def test_exported():
    assert attnscale.AttentionConfig is AttentionConfig and "AttentionConfig" in attnscale.__all__


# --- from_json on text that is not a config ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, exc, match",
    [
        ('{"kernel": "linear",}', ValueError, r"text: expected valid JSON .* at line 1, column 21"),
        ('{\n  "kernel": \'linear\'\n}', ValueError, r"text: .* at line 2, column 13"),
        ("", ValueError, r"text: .* line 1, column 1"),
        ("[1, 2]", ValueError, r"text: expected a JSON object .*, got a JSON array"),
        ("3", ValueError, r"got a JSON number"),
        ('"softmax"', ValueError, r"got a JSON string"),
        ("null", ValueError, r"got a JSON null"),
        (b"\xff{}", ValueError, r"text: expected UTF-8"),
        (None, TypeError, r"text: expected a JSON string .*, got NoneType"),
    ],
)
def test_from_json_names_bad_text(text, exc, match):
    with pytest.raises(exc, match=match) as info:
        AttentionConfig.from_json(text)
    assert type(info.value) is exc and "Fix:" in str(info.value)


def test_from_json_accepts_bytes():
    cfg = AttentionConfig(kernel="int8")
    assert AttentionConfig.from_json(cfg.to_json().encode()) == cfg
