"""The backends as data (attnscale.backends): auto's walk and the forced backends ask each
implementation the same question, so what auto takes, forcing takes too, to the same result, and
what an implementation says it cannot compute, forcing it refuses."""

import dataclasses
import math

import pytest
import torch

import attnscale
from attnscale import backends
from attnscale._validate import check_attention_call

from .features import FEATURES, feature_id

sdpa = attnscale.scaled_dot_product_attention


def _options(case, L=5, S=7, H=2):
    softcap, alibi, window, causal, mask = FEATURES[case]
    gen = torch.Generator().manual_seed(case)
    options = dict(softcap=softcap, window=window)
    if alibi:
        options["alibi_slopes"] = attnscale.alibi_slopes(H)
    if causal is not None:
        options.update(is_causal=True, causal_alignment=causal)
    if mask == "bool":
        options["attn_mask"] = torch.rand(L, S, generator=gen) > 0.3
    elif mask == "float":
        options["attn_mask"] = torch.randn(L, S, generator=gen)
    return options


def _call(q, k, v, **options):
    spec = check_attention_call(
        q, k, v, attn_mask=options.get("attn_mask"), dropout_p=options.get("dropout_p", 0.0), is_causal=options.get("is_causal", False),
        scale=None, enable_gqa=False, causal_alignment=options.get("causal_alignment", "top_left"), backend=options.get("backend", "auto"),
        softcap=options.get("softcap"), alibi_slopes=options.get("alibi_slopes"), window=options.get("window"),
        return_stats=options.get("return_stats", False), sinks=None,
    )  # fmt: skip
    return backends.Call(spec, q, k, v, options.get("attn_mask"), options.get("alibi_slopes"), None)


@pytest.mark.parametrize("return_stats", [False, True], ids=["out", "stats"])
@pytest.mark.parametrize("case", range(len(FEATURES)), ids=feature_id)
def test_what_auto_takes_forcing_takes_to_the_same_bits(case, return_stats):
    gen = torch.Generator().manual_seed(100 + case)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (5, 7, 7))
    options = {**_options(case), "return_stats": return_stats}
    implementation, why = backends.choose(_call(q, k, v, **options))
    assert str(why).startswith("auto")
    assert implementation.cannot(_call(q, k, v, **options)) is None
    auto = sdpa(q, k, v, **options)
    assert attnscale.last_backend() == implementation.backend.value
    forced = sdpa(q, k, v, **options, backend=implementation.backend.value)
    if return_stats:
        (auto, auto_stats), (forced, forced_stats) = auto, forced
        for field in dataclasses.fields(auto_stats):
            a, b = getattr(auto_stats, field.name), getattr(forced_stats, field.name)
            assert (a is None and b is None) or torch.equal(a, b), field.name
    assert torch.equal(auto, forced)


@pytest.mark.parametrize("name", ["torch", "math", "tiled", "fused", "flex"])
def test_forcing_what_an_implementation_cannot_compute_raises_its_refusal(name):
    """For each implementation, a call it says it cannot compute, forced: the ValueError is the
    refusal's text, argument first."""
    q, k, v = (torch.randn(1, 2, n, 8) for n in (5, 7, 7))
    refusing = {
        "torch": dict(softcap=5.0),
        "math": None,  # computes every call
        "tiled": dict(dropout_p=0.1),
        "fused": dict(dropout_p=0.1),
        "flex": dict(dropout_p=0.1),
    }[name]
    implementation = backends.IMPLEMENTATIONS[attnscale.Backend(name)]
    if refusing is None:
        for case in range(len(FEATURES)):
            assert implementation.cannot(_call(q, k, v, **_options(case), dropout_p=0.1)) is None
        return
    refusal = implementation.cannot(_call(q, k, v, **refusing))
    assert refusal is not None
    with pytest.raises(ValueError) as raised:
        sdpa(q, k, v, **refusing, backend=name)
    assert str(raised.value) == f"{refusal.argument}: expected {refusal.expected}, got {refusal.got}. Fix: {refusal.fix}"


def test_auto_logs_what_it_passed_over_and_why():
    q = torch.randn(1, 2, 5, 8)
    _, why = backends.choose(_call(q, q, q, softcap=5.0))
    passed = str(why).removeprefix("auto, passed over ").split("; ")
    assert [p.split(":")[0] for p in passed] == ["torch", "flex", "math"]
    assert passed[0] == "torch: softcap" and passed[1] == "flex: not a CUDA tensor"
    _, why = backends.choose(_call(q, q, q))
    assert str(why) == "auto"


def test_auto_remembers_its_kernel_for_a_validated_call_and_asks_again_where_grad_may_change_it(monkeypatch):
    """A decoding loop asks auto's walk once per signature: the spec validation hands back for it
    is remembered when auto gives it torch's kernel or the compiled one (those steps read the spec,
    what its signature fixes, and whether a mask or slopes require grad); a forced backend, another
    backend, or a call whose slopes require grad is never answered from that memory, but where the
    compiled kernel was the answer (it takes learned slopes too)."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
    plain = _call(q, k, v)
    assert _call(q, k, v).spec is plain.spec  # the signature's cached spec
    first = backends.choose(plain)
    assert first[0] is backends.TORCH and backends._CHOSEN[id(plain.spec)][0] is plain.spec
    again = backends.choose(plain)
    assert again[0] is backends.TORCH and str(again[1]) == str(first[1]) == "auto"
    for options in ({"backend": "math"}, {"backend": "math", "softcap": 5.0}):
        other = _call(q, k, v, **options)
        assert backends.choose(other)[0] is not backends.TORCH
        assert id(other.spec) not in backends._CHOSEN
    capped = _call(q, k, v, softcap=5.0)
    kernel = backends.FUSED if attnscale.kernels.available() else backends.TILED
    assert backends.choose(capped)[0] is kernel
    assert (id(capped.spec) in backends._CHOSEN) == (kernel is backends.FUSED)
    learned = attnscale.alibi_slopes(2).requires_grad_()
    with_slopes = _call(q, k, v, alibi_slopes=learned.detach())
    assert backends.choose(with_slopes)[0] is kernel
    same_signature = with_slopes._replace(alibi_slopes=learned)  # the signature does not say requires_grad
    # learned slopes: the compiled kernel differentiates them, the tiled kernel does not (math does)
    learns = backends.FUSED if kernel is backends.FUSED else backends.MATH
    walked = []
    real = backends._fused_cannot
    monkeypatch.setattr(backends, "_fused_cannot", lambda c: walked.append(1) or real(c))  # asked by auto's walk (_math_first) only
    assert same_signature.spec is with_slopes.spec and backends.choose(same_signature)[0] is learns
    assert (walked == []) == (kernel is backends.FUSED), "the compiled kernel's answer holds for learned slopes: not walked again"


def test_a_call_grown_along_s_takes_its_familys_torch_kernel_only_where_the_offset_cannot_matter(monkeypatch):
    """Keys grown along S (a decoding step over a growing cache) take the choice of torch's kernel,
    and torch's arguments, remembered for the call they were grown from, where that choice cannot
    turn on S: no causal mask, or top-left alignment. Bottom-right causal at S = L is torch's
    (offset 0) but at S = 5 > L it is not, and is not taken so."""
    from attnscale import _validate

    monkeypatch.setattr(_validate, "_SIGNATURES", {})
    monkeypatch.setattr(_validate, "_FAMILIES", {})
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 3, 8, generator=gen)
    walked = []
    real = backends.torch_lacks
    monkeypatch.setattr(backends, "torch_lacks", lambda spec: walked.append(spec.S) or real(spec))
    for options in ({"is_causal": True}, {}, {"is_causal": True, "causal_alignment": "bottom_right"}):
        walked.clear()
        for S in (3, 5, 7):
            k, v = torch.randn(1, 2, S, 8, generator=gen), torch.randn(1, 2, S, 8, generator=gen)
            out = sdpa(q, k, v, **options)
            ran = attnscale.last_backend()
            torch.testing.assert_close(out, sdpa(q, k, v, backend="math", **options), rtol=0, atol=1e-6)
            bottom_right_grown = options.get("causal_alignment") == "bottom_right" and S != 3
            assert ran == ("torch" if not bottom_right_grown else ("fused" if attnscale.kernels.available() else "tiled"))
        grown_asked = [S for S in walked if S != 3]
        assert grown_asked == ([] if "causal_alignment" not in options else [5, 7])  # the walk asked again only where it must


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=["float32", "float64", "bfloat16", "float16"])
def test_a_repeated_torch_call_leaves_out_only_what_torch_defaults_to_the_same_bits(dtype):
    """A signature's repeated call to torch's kernel leaves its default scale and enable_gqa=False
    out of the call: torch's default 1/sqrt(D) is the scale attnscale computes, to the bit, so the
    output is the one passing it gives, for head dims that are and are not powers of 4; an explicit
    other scale and GQA are passed."""
    F = torch.nn.functional.scaled_dot_product_attention
    for D in (1, 3, 7, 24, 80, 96, 128):
        gen = torch.Generator().manual_seed(D)
        q, k, v = (torch.randn(1, 4, 9, D, generator=gen).to(dtype) for _ in range(3))
        for _ in range(2):  # the second call is the memo's
            assert torch.equal(sdpa(q, k, v, is_causal=True), F(q, k, v, is_causal=True, scale=1.0 / math.sqrt(D)))
            assert attnscale.last_backend() == "torch"
            assert torch.equal(sdpa(q, k, v, scale=0.3), F(q, k, v, scale=0.3))
            assert torch.equal(sdpa(q, k[:, :2], v[:, :2], enable_gqa=True), F(q, k[:, :2], v[:, :2], enable_gqa=True))
