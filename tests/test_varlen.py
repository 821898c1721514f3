"""varlen_attention on packed sequences against the fp64 NumPy oracle, per sequence, and the padded batch.

Shape letters as everywhere in attnscale: B sequences, H query heads, Hkv key/value heads, G = H // Hkv,
L_b / S_b the query / key length of sequence b, D query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attnscale
from attnscale import kernels
from attnscale import reference

# Awkward lengths: 1, 17 (L < S), 113, empty queries, empty keys, both empty, L > S under causality.
LQ = [1, 17, 0, 113, 5, 0, 9]
LK = [1, 30, 4, 113, 0, 0, 3]
HEADS = {"mha": (4, 4, 16, 16), "gqa-dv-differs": (4, 2, 19, 7), "mqa": (3, 1, 8, 5)}  # (H, Hkv, D, Dv)
FEATURES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "scale": dict(scale=0.3),
    "softcap": dict(softcap=1.5, scale=0.9),
    "alibi": dict(alibi="per_head"),
    "alibi-per-sequence": dict(alibi="per_sequence"),
    "window": dict(window=(3, 2)),
    "causal-window": dict(is_causal=True, window=(8, 0)),
    "sinks": dict(sinks=True),
    "all": dict(is_causal=True, scale=0.2, softcap=2.0, alibi="per_head", window=(20, 0), sinks=True),
}
BACKENDS = ["auto", "torch", "math", "tiled", "fused"]


def cumulative(lengths: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=dtype)


def packed_case(heads: str, feature: str, dtype: torch.dtype = torch.float64, lq=LQ, lk=LK, seed: int = 0):
    """Packed q, k, v, cumulative lengths and the options of ``feature``, all deterministic."""
    H, Hkv, D, Dv = HEADS[heads]
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype)

    q, k, v = randn(sum(lq), H, D, std=1.5), randn(sum(lk), Hkv, D, std=1.5), randn(sum(lk), Hkv, Dv)
    options = {n: val for n, val in FEATURES[feature].items() if n not in ("alibi", "sinks")}
    alibi = FEATURES[feature].get("alibi")
    if alibi == "per_head":
        options["alibi_slopes"] = attnscale.alibi_slopes(H)
    if alibi == "per_sequence":
        options["alibi_slopes"] = torch.rand(len(lq), H, generator=gen) * 0.5
    if FEATURES[feature].get("sinks"):
        options["sinks"] = torch.randn(H, generator=gen, dtype=torch.float64) * 2
    return (q, k, v, cumulative(lq), cumulative(lk)), options


def sequences(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """(b, query rows, key rows) of every sequence."""
    for b in range(len(cu_q) - 1):
        yield b, slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))


def seq_option(options: dict, b: int, name: str):
    value = options.get(name)
    return value[b] if value is not None and value.ndim == 2 else value


def oracle_loop(q, k, v, cu_q, cu_k, *, return_stats=False, **options):
    """attnscale.reference.attention (fp64 NumPy) per sequence: out (total_q, H, Dv), stats (H, total_q)."""
    outs, stats = [], []
    for b, rows, keys in sequences(cu_q, cu_k):
        kwargs = dict(options, causal_alignment="bottom_right", return_stats=return_stats)
        for name in ("alibi_slopes", "sinks"):
            if kwargs.get(name) is not None:
                kwargs[name] = seq_option(options, b, name).double().numpy()
        arrays = [t[r].transpose(0, 1).double().numpy() for t, r in ((q, rows), (k, keys), (v, keys))]  # (heads, len, dim)
        result = reference.attention(*arrays, **kwargs)
        out, st = result if return_stats else (result, None)
        outs.append(torch.from_numpy(np.ascontiguousarray(out.transpose(1, 0, 2))))  # (L_b, H, Dv)
        stats.append(st)
    out = torch.cat(outs)
    if not return_stats:
        return out
    return out, {name: torch.from_numpy(np.concatenate([s[name] for s in stats], axis=-1)) for name in stats[0]}


def visibility(L: int, S: int, options: dict) -> torch.Tensor:
    """Bool (L, S), True = attend, from first principles: query i sits at key position i + S - L."""
    i = torch.arange(L)[:, None] + S - L
    j = torch.arange(S)[None, :]
    keep = torch.ones(L, S, dtype=torch.bool)
    if options.get("is_causal"):
        keep &= j <= i
    left, right = options.get("window") or (None, None)
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    return keep


def plain_loop(q, k, v, cu_q, cu_k, **options):
    """The formula per sequence entirely in the inputs' dtype (flash-attention's attention_pt)."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    outs = []
    for b, rows, keys in sequences(cu_q, cu_k):
        qb = q[rows].transpose(0, 1)  # (H, L_b, D)
        kb = k[keys].transpose(0, 1).repeat_interleave(H // Hkv, dim=0)  # (H, S_b, D)
        vb = v[keys].transpose(0, 1).repeat_interleave(H // Hkv, dim=0)  # (H, S_b, Dv)
        L, S = qb.shape[1], kb.shape[1]
        s = qb @ kb.transpose(-1, -2) * (options.get("scale") or D**-0.5)  # (H, L_b, S_b)
        if options.get("softcap"):
            s = torch.tanh(s / options["softcap"]) * options["softcap"]
        slopes = seq_option(options, b, "alibi_slopes")
        if slopes is not None:
            distance = (torch.arange(L)[:, None] + S - L - torch.arange(S)[None, :]).abs()
            s = s - slopes.to(s.dtype)[:, None, None] * distance.to(s.dtype)
        s = s.masked_fill(~visibility(L, S, options), -math.inf)
        sinks = options.get("sinks")
        if sinks is not None:
            s = torch.cat([s, sinks.to(s.dtype)[:, None, None].expand(H, L, 1)], dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key -> 0
        outs.append((p[..., :S] @ vb).transpose(0, 1))  # (L_b, H, Dv)
    return torch.cat(outs)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


NO_KERNEL = kernels.build_precondition()  # None: the kernel must build here (a failed build fails)


def skip_unless_runnable(backend: str, options: dict) -> None:
    if backend == "fused" and NO_KERNEL is not None:
        pytest.skip(f"the compiled kernel cannot be had here: {NO_KERNEL}")
    if backend == "torch" and options.get("softcap"):
        pytest.skip("torch's SDPA has no softcap")


# --------------------------------------------------------------------------------------------
# 1. Against the fp64 oracle, per sequence, on every feature and backend
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_float64_matches_the_oracle_per_sequence(feature, heads, backend):
    (q, k, v, cu_q, cu_k), options = packed_case(heads, feature)
    skip_unless_runnable(backend, options)
    out = attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend=backend, **options)
    assert out.shape == (sum(LQ), HEADS[heads][0], HEADS[heads][3]) and out.dtype == torch.float64
    assert max_err(out, oracle_loop(q, k, v, cu_q, cu_k, **options)) < 1e-12
    if backend != "auto":
        assert attnscale.last_backend() == backend


@pytest.mark.skipif(NO_KERNEL is not None, reason=f"the compiled kernel cannot be had here: {NO_KERNEL}")
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_packed_kernel_with_small_tiles_matches_the_oracle(feature, heads, monkeypatch):
    """16 x 32 tiles: every sequence spans several query blocks and key tiles, statistics too."""
    monkeypatch.setattr(attnscale.kernels.ops, "BLOCK_Q", 16)
    monkeypatch.setattr(attnscale.kernels.ops, "BLOCK_K", 32)
    (q, k, v, cu_q, cu_k), options = packed_case(heads, feature)
    out, stats = attnscale.varlen_attention(q, k, v, cu_q, cu_k, return_stats=True, backend="fused", **options)
    ref_out, ref = oracle_loop(q, k, v, cu_q, cu_k, return_stats=True, **options)
    assert max_err(out, ref_out) < 1e-12
    for name, expected in ref.items():
        got = getattr(stats, name).to(expected.dtype)
        finite = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(got), finite) and max_err(got[finite], expected[finite]) < 1e-12, name


@pytest.mark.parametrize("backend", ["auto", "math", "tiled"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_statistics_match_the_oracle_in_the_rows_order_of_the_output(feature, heads, backend):
    (q, k, v, cu_q, cu_k), options = packed_case(heads, feature)
    out, stats = attnscale.varlen_attention(q, k, v, cu_q, cu_k, return_stats=True, backend=backend, **options)
    ref_out, ref = oracle_loop(q, k, v, cu_q, cu_k, return_stats=True, **options)
    assert max_err(out, ref_out) < 1e-12
    H = HEADS[heads][0]
    for name, expected in ref.items():
        got = getattr(stats, name)
        assert got.shape == (H, sum(LQ)), name
        finite = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(got), finite), name
        assert torch.equal(got[~finite], expected[~finite].to(got.dtype)), name  # -inf where the oracle has it
        assert max_err(got[finite], expected[finite]) < 1e-10, name
    if options.get("sinks") is None:
        assert stats.sink_share is None


# Measured ratio err(varlen) / err(plain float32 loop), max-abs error against fp64, over FEATURES x
# HEADS and backends auto and tiled (torch 2.13 CPU): median 1.04, range 0.60-2.04, the largest on a
# window with MQA (8.6e-7 against 4.2e-7). A max-abs error over a few thousand entries is noisy;
# flash-attention's tests use 2, and test_functional adds one eps to it as here.
K_FORWARD = 2.0


@pytest.mark.parametrize("backend", ["auto", "tiled"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_float32_error_is_at_most_twice_a_plain_float32_loop(feature, heads, backend):
    (q, k, v, cu_q, cu_k), options = packed_case(heads, feature, dtype=torch.float32, seed=1)
    out = attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend=backend, **options)
    exact = oracle_loop(q, k, v, cu_q, cu_k, **options)
    plain = plain_loop(q, k, v, cu_q, cu_k, **options)
    ours, theirs = max_err(out, exact), max_err(plain, exact)
    assert out.dtype == torch.float32
    assert ours <= K_FORWARD * theirs + torch.finfo(torch.float32).eps, f"error {ours:.3g} > {K_FORWARD} x plain {theirs:.3g}"


def test_cu_seqlens_may_be_int32_or_int64():
    (q, k, v, cu_q, cu_k), options = packed_case("gqa-dv-differs", "all")
    a = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **options)
    b = attnscale.varlen_attention(q, k, v, cu_q.long(), cu_k.long(), **options)
    assert torch.equal(a, b)


def test_bottom_right_alignment_matches_the_docstring_drawing():
    # One sequence with L = 2, S = 5 next to one with L = 3, S = 1; v = eye(S) makes out the weights.
    q = torch.zeros(5, 1, 4)
    k = torch.randn(6, 1, 4, generator=torch.Generator().manual_seed(3))
    v = torch.eye(6)[:, None, :]  # (total_k, 1, 6): key row t has value e_t
    out = attnscale.varlen_attention(q, k, v, cumulative([2, 3]), cumulative([5, 1]), is_causal=True)[:, 0]
    seen = (out > 0).int()
    assert seen.tolist() == [
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0],  # L > S: the first L - S rows of the second sequence see no key
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 1],
    ]


# --------------------------------------------------------------------------------------------
# 2. Gradients: against the math backend on the padded batch, with per-sequence masks built here
# --------------------------------------------------------------------------------------------


def padded(q, k, v, cu_q, cu_k, options):
    """The padded equivalent: (B, heads, max len, dim) tensors and a float mask (B, H, Lmax, Smax)
    holding each sequence's ALiBi bias at its own bottom-right positions and -inf where hidden."""
    B, H = len(cu_q) - 1, q.shape[1]
    Lmax = max(int(n) for n in cu_q.diff()) if B else 0
    Smax = max(int(n) for n in cu_k.diff()) if B else 0
    Q = q.new_zeros(B, H, Lmax, q.shape[2])
    K, V = k.new_zeros(B, k.shape[1], Smax, k.shape[2]), v.new_zeros(B, v.shape[1], Smax, v.shape[2])
    mask = torch.full((B, H, Lmax, Smax), -math.inf, dtype=torch.float64)
    for b, rows, keys in sequences(cu_q, cu_k):
        L, S = rows.stop - rows.start, keys.stop - keys.start
        Q[b, :, :L], K[b, :, :S], V[b, :, :S] = q[rows].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1)
        bias = torch.zeros(H, L, S, dtype=torch.float64)
        slopes = seq_option(options, b, "alibi_slopes")
        if slopes is not None:
            distance = (torch.arange(L)[:, None] + S - L - torch.arange(S)[None, :]).abs()
            bias = -slopes.double()[:, None, None] * distance
        mask[b, :, :L, :S] = bias.masked_fill(~visibility(L, S, options), -math.inf)

    def unpad(X: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:  # (B, heads, len, dim) -> (total, heads, dim)
        return torch.cat([X[b, :, : int(cu[b + 1] - cu[b])].transpose(0, 1) for b in range(B)])

    return (Q, K, V), mask, unpad


@pytest.mark.parametrize("backend", ["auto", "tiled"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_gradients_match_the_math_backend_on_the_padded_batch(feature, heads, backend):
    (q, k, v, cu_q, cu_k), options = packed_case(heads, feature)
    if options.get("sinks") is not None:
        options["sinks"] = options["sinks"].requires_grad_()
    dout = torch.randn(sum(LQ), HEADS[heads][0], HEADS[heads][3], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = attnscale.varlen_attention(*leaves, cu_q, cu_k, backend=backend, **options)
    out.backward(dout)
    ours = [out.detach()] + [t.grad for t in leaves]
    sink_grad = None if options.get("sinks") is None else options["sinks"].grad.clone()

    (Q, K, V), mask, unpad = padded(*(t.detach() for t in (q, k, v)), cu_q, cu_k, options)
    pad_leaves = [t.requires_grad_() for t in (Q, K, V)]
    if sink_grad is not None:
        options["sinks"].grad = None
    kwargs = {n: options[n] for n in ("scale", "softcap", "sinks") if n in options}
    ref = attnscale.scaled_dot_product_attention(*pad_leaves, attn_mask=mask, enable_gqa=True, backend="math", **kwargs)
    ref.backward(padded(dout, k, v, cu_q, cu_k, options)[0][0])  # dout padded like q, zeros in the padding
    expected = [unpad(ref.detach(), cu_q), unpad(Q.grad, cu_q), unpad(K.grad, cu_k), unpad(V.grad, cu_k)]
    for what, a, b in zip(("out", "dq", "dk", "dv"), ours, expected):
        assert a.shape == b.shape and max_err(a, b) < 1e-10, what
        assert torch.isfinite(a).all(), what
    if sink_grad is not None:
        assert max_err(sink_grad, options["sinks"].grad) < 1e-10


# --------------------------------------------------------------------------------------------
# 3. Sequences stay apart; empty sequences; statistics' layout; hints
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", ["plain", "causal-window", "all"])
@pytest.mark.parametrize("poisoned", ["k", "v"])
def test_nan_in_one_sequence_reaches_no_other_sequence(poisoned, feature, backend):
    (q, k, v, cu_q, cu_k), options = packed_case("gqa-dv-differs", feature)
    skip_unless_runnable(backend, options)
    dout = torch.randn(sum(LQ), 4, 7, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def run(q, k, v):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attnscale.varlen_attention(*leaves, cu_q, cu_k, backend=backend, **options)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    clean = run(q, k, v)
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if poisoned == "k" else bad_v)[int(cu_k[1]) : int(cu_k[2])] = math.nan  # every key row of sequence 1
    dirty = run(q, bad_k, bad_v)
    rows, keys = slice(int(cu_q[1]), int(cu_q[2])), slice(int(cu_k[1]), int(cu_k[2]))
    assert torch.isnan(dirty[0][rows]).all()  # the poison did reach its own sequence
    for what, a, b, own in zip(("out", "dq", "dk", "dv"), dirty, clean, (rows, rows, keys, keys)):
        keep = torch.ones(a.shape[0], dtype=torch.bool)
        keep[own] = False
        assert torch.equal(a[keep], b[keep]), what  # bit for bit: nothing else was computed with it


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequences_and_rows_without_keys_give_zeros_and_zero_gradients(backend):
    lq, lk = [0, 3, 2, 0, 4], [5, 0, 0, 0, 1]  # no queries; no keys; neither; causal L > S
    (q, k, v, cu_q, cu_k), _ = packed_case("gqa-dv-differs", "plain", lq=lq, lk=lk)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = attnscale.varlen_attention(*leaves, cu_q, cu_k, is_causal=True, backend=backend)
    assert out.shape == (9, 4, 7)
    assert torch.equal(out[:8], torch.zeros(8, 4, 7, dtype=torch.float64))  # rows of sequences 1, 2 and the first three of 4
    assert (out[8] != 0).all()
    out.sum().backward()
    assert torch.equal(q.grad[:8], torch.zeros(8, 4, 19, dtype=torch.float64))
    assert torch.equal(k.grad[:5], torch.zeros(5, 2, 19, dtype=torch.float64))  # keys nobody queries
    assert all(torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0]])
def test_no_sequence_or_only_empty_ones_give_empty_results(lengths):
    cu = cumulative(lengths)
    q, k, v = torch.zeros(0, 4, 8), torch.zeros(0, 2, 8), torch.zeros(0, 2, 3)
    out, stats = attnscale.varlen_attention(q, k, v, cu, cu, return_stats=True)
    assert out.shape == (0, 4, 3) and out.dtype == torch.float32
    assert stats.lse.shape == (4, 0) and stats.visible_keys.shape == (4, 0)


def test_statistics_reduce_per_head_with_attnscale_summarize():
    (q, k, v, cu_q, cu_k), options = packed_case("mqa", "causal")
    _, stats = attnscale.varlen_attention(q, k, v, cu_q, cu_k, return_stats=True, **options)
    non_empty = sum(L - max(0, L - S) for L, S in zip(LQ, LK))  # causal L > S leaves L - S rows empty
    summary = attnscale.summarize(stats, "max_prob")
    assert summary.rows == (non_empty,) * 3  # one entry per head, the packed rows as the row axis
    for h in range(3):
        values = stats.max_prob[h][stats.visible_keys[h] > 0]
        assert summary.max[h] == pytest.approx(values.max().item())


def test_max_seqlen_hints_are_optional_and_may_exceed_the_longest():
    (q, k, v, cu_q, cu_k), options = packed_case("mha", "causal")
    plain = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **options)
    hinted = attnscale.varlen_attention(q, k, v, cu_q, cu_k, max(LQ), max(LK), **options)
    generous = attnscale.varlen_attention(q, k, v, cu_q, cu_k, 4096, 4096, **options)
    assert torch.equal(plain, hinted) and torch.equal(plain, generous)


def test_each_sequence_runs_on_views_of_the_packed_tensors(monkeypatch):
    """Off the compiled kernel (here backend="tiled"): one call per sequence on views, no copy."""
    (q, k, v, cu_q, cu_k), _ = packed_case("gqa-dv-differs", "plain")
    seen = []
    real = attnscale.varlen.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append((query.untyped_storage().data_ptr(), key.untyped_storage().data_ptr(), value.untyped_storage().data_ptr()))
        assert kwargs["causal_alignment"] == "bottom_right" and kwargs["enable_gqa"]
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(attnscale.varlen, "scaled_dot_product_attention", spy)
    attnscale.varlen_attention(q, k, v, cu_q, cu_k, backend="tiled")
    storages = (q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())
    assert seen == [storages] * len(LQ)  # one call per sequence, no copy of q, k or v


@pytest.mark.parametrize("per_sequence", [False, True], ids=["slopes-H", "slopes-per-sequence"])
def test_auto_learns_alibi_slopes_as_the_math_backend_does_sequence_by_sequence(per_sequence, monkeypatch):
    """Learned slopes take the one kernel call where it runs (its backward returns their gradient
    per sequence and head), else one call per sequence; either way, the math backend's gradient
    (float64: measured within 1.6e-14 of its largest entry)."""
    (q, k, v, cu_q, cu_k), _ = packed_case("gqa-dv-differs", "plain")
    gen = torch.Generator().manual_seed(3)
    base = torch.rand((len(LQ), 4) if per_sequence else (4,), generator=gen, dtype=torch.float64) * 0.3
    weights = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=gen, dtype=torch.float64)
    calls = []
    real = attnscale.varlen.fused_varlen_attention
    monkeypatch.setattr(attnscale.varlen, "fused_varlen_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    grads = []
    for backend in ("math", "auto"):
        slopes = base.clone().requires_grad_()
        out = attnscale.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, alibi_slopes=slopes, backend=backend)
        (out * weights).sum().backward()
        grads.append(slopes.grad)
    assert calls == ([] if NO_KERNEL is not None else [1])
    assert (grads[1] - grads[0]).abs().max() <= 4e-14 * grads[0].abs().max()


@pytest.mark.skipif(NO_KERNEL is not None, reason=f"the compiled kernel cannot be had here: {NO_KERNEL}")
def test_auto_runs_every_finite_sequence_in_one_kernel_call(monkeypatch):
    """On CPU, auto hands all sequences to the compiled kernel at once; a sequence with a NaN
    takes the per-sequence path (its NaN rule), the others stay in the one kernel call. Where
    gradients are wanted the guard finds it before the kernel runs (its rows must not reach the
    kernel's backward); without, the kernel's own verdict on its rows finds it after (no pass over
    the inputs), and only that sequence runs again."""
    (q, k, v, cu_q, cu_k), _ = packed_case("gqa-dv-differs", "causal-window")
    calls, per_sequence = [], []
    real_kernel, real_sdpa = attnscale.varlen.fused_varlen_attention, attnscale.varlen.scaled_dot_product_attention
    monkeypatch.setattr(attnscale.varlen, "fused_varlen_attention", lambda *a, **kw: calls.append(a[3].tolist()) or real_kernel(*a, **kw))
    monkeypatch.setattr(attnscale.varlen, "scaled_dot_product_attention", lambda *a, **kw: per_sequence.append(1) or real_sdpa(*a, **kw))
    attnscale.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    spans = [[int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])] for b in range(len(LQ))]  # (q0, q1, k0, k1)
    assert calls == [spans] and per_sequence == []
    bad = k.clone()
    bad[int(cu_k[1])] = math.nan  # a key row of sequence 1
    rows = slice(int(cu_q[1]), int(cu_q[2]))
    for wants_grad, table in ((True, spans[:1] + spans[2:]), (False, spans)):
        calls.clear(), per_sequence.clear()
        out = attnscale.varlen_attention(q.clone().requires_grad_(wants_grad), bad, v, cu_q, cu_k, is_causal=True)
        assert calls == [table] and per_sequence == [1]
        assert torch.isnan(out[rows]).any()
        assert torch.equal(out.detach()[:rows.start], attnscale.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)[:rows.start])


# --------------------------------------------------------------------------------------------
# 4. Bad input: a clear error naming the argument, before any compute
# --------------------------------------------------------------------------------------------


def good_call() -> dict:
    (q, k, v, cu_q, cu_k), _ = packed_case("gqa-dv-differs", "plain", dtype=torch.float32)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


META = torch.device("meta")
BAD_INPUT = {
    "q-not-tensor": (dict(q=[[1.0]]), TypeError, "q: expected a torch.Tensor, got list"),
    "q-int": (dict(q=lambda c: c["q"].long()), TypeError, "q: expected a floating dtype"),
    "q-4d": (dict(q=lambda c: c["q"][None]), ValueError, "q: expected 3 dims (total_q, H, D)"),
    "k-dtype": (dict(k=lambda c: c["k"].double()), TypeError, "k: expected q's dtype torch.float32"),
    "v-device": (dict(v=lambda c: c["v"].to(META)), ValueError, "v: expected q's device cpu, got device meta"),
    "k-head-dim": (dict(k=lambda c: c["k"][..., :5]), ValueError, "k: expected head dim D = 19"),
    "v-rows": (dict(v=lambda c: c["v"][1:]), ValueError, "v: expected total_k = 151 rows"),
    "v-heads": (dict(v=lambda c: c["v"][:, :1]), ValueError, "v: expected 2 heads (dim 1) like k's"),
    "heads-do-not-divide": (dict(q=lambda c: c["q"][:, :3]), ValueError, "k: expected a number of heads (dim 1) that divides q's H = 3"),
    "cu-list": (dict(cu_seqlens_q=[0, 145]), TypeError, "cu_seqlens_q: expected a 1-d int32 or int64 torch.Tensor, got list"),
    "cu-float": (dict(cu_seqlens_q=lambda c: c["cu_seqlens_q"].float()), TypeError, "cu_seqlens_q: expected dtype int32 or int64"),
    "cu-2d": (dict(cu_seqlens_k=lambda c: c["cu_seqlens_k"][None]), ValueError, "cu_seqlens_k: expected a 1-d tensor of B + 1"),
    "cu-empty": (dict(cu_seqlens_k=torch.zeros(0, dtype=torch.int32)), ValueError, "cu_seqlens_k: expected a 1-d tensor"),
    "cu-device": (dict(cu_seqlens_q=lambda c: c["cu_seqlens_q"].to(META)), ValueError, "cu_seqlens_q: expected q's device cpu"),
    "cu-start": (dict(cu_seqlens_q=lambda c: c["cu_seqlens_q"] + 1), ValueError, "cu_seqlens_q: expected a first entry of 0, got 1"),
    "cu-decreasing": (dict(cu_seqlens_k=torch.tensor([0, 40, 30, 151], dtype=torch.int32)), ValueError, "got 40 then 30 at index 1"),
    "cu-short-of-total": (dict(cu_seqlens_q=lambda c: c["cu_seqlens_q"].clamp_max(140)), ValueError, "cu_seqlens_q: expected a last entry equal to total_q = q.shape[0] = 145, got 140"),
    "cu-lengths-differ": (dict(cu_seqlens_k=torch.tensor([0, 151], dtype=torch.int32)), ValueError, "cu_seqlens_k: expected B + 1 = 8 entries"),
    "max-seqlen-small": (dict(max_seqlen_q=100), ValueError, "max_seqlen_q: expected at least the longest sequence in cu_seqlens_q, 113, got 100"),
    "max-seqlen-type": (dict(max_seqlen_k=113.0), TypeError, "max_seqlen_k: expected None or an int, got 113.0"),
    "is-causal": (dict(is_causal=1), TypeError, "is_causal: expected a bool"),
    "scale": (dict(scale=float("inf")), ValueError, "scale: expected a finite float"),  # (a negative one is a formula, as in torch)
    "softcap": (dict(softcap=math.inf), ValueError, "softcap: expected a finite positive float"),
    "window": (dict(window=(1, -2)), ValueError, "window: expected None or a pair"),
    "backend": (dict(backend="flash"), ValueError, "backend: expected one of 'auto'"),
    "return-stats": (dict(return_stats="yes"), TypeError, "return_stats: expected a bool"),
    "alibi-shape": (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes: expected shape (H,) = (4,) or (B, H) = (7, 4)"),
    "alibi-int": (dict(alibi_slopes=torch.ones(4, dtype=torch.int64)), TypeError, "alibi_slopes: expected a float tensor"),
    "sinks-shape": (dict(sinks=torch.zeros(7, 4)), ValueError, "sinks: expected shape (H,) = (4,), one logit per query head, got shape (7, 4)"),
    "sinks-device": (dict(sinks=torch.zeros(4, device=META)), ValueError, "sinks: expected the query's device cpu"),
    "sinks-nan": (dict(sinks=torch.tensor([0.0, math.nan, 0.0, 0.0])), ValueError, "sinks: expected finite logits"),
    # as scaled_dot_product_attention refuses them (varlen once returned NaN rows for these)
    "alibi-nan": (dict(alibi_slopes=torch.tensor([0.5, math.nan, 0.1, 0.1])), ValueError, "alibi_slopes: expected finite slopes in torch.float32"),
    "alibi-inf": (dict(alibi_slopes=torch.tensor([0.5, math.inf, 0.1, 0.1])), ValueError, "alibi_slopes: expected finite slopes in torch.float32"),
}


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_raises_a_clear_error_before_any_compute(name, monkeypatch):
    change, exc, message = BAD_INPUT[name]
    call = good_call()
    call.update({arg: value(call) if callable(value) else value for arg, value in change.items()})

    def no_compute(*args, **kwargs):
        raise AssertionError("attention ran before the inputs were checked")

    monkeypatch.setattr(attnscale.varlen, "scaled_dot_product_attention", no_compute)
    with pytest.raises(exc) as info:
        attnscale.varlen_attention(**call)
    assert message in str(info.value)
    assert ", got " in str(info.value) and ". Fix: " in str(info.value)


def test_options_no_backend_computes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^backend: expected a backend that implements return_stats"):
        attnscale.varlen_attention(**good_call(), return_stats=True, backend="torch")


def test_a_negative_or_zero_scale_is_computed_as_scaled_dot_product_attention_computes_it():
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(7, 2, 8, generator=gen), torch.randn(9, 2, 8, generator=gen), torch.randn(9, 2, 8, generator=gen)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    for scale in (-0.7, 0.0):
        out = attnscale.varlen_attention(q, k, v, cu_q, cu_k, scale=scale, is_causal=True)
        for (a, b), (c, d) in zip(((0, 3), (3, 7)), ((0, 4), (4, 9))):
            want = attnscale.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1), scale=scale, is_causal=True, causal_alignment="bottom_right"
            ).transpose(0, 1)
            torch.testing.assert_close(out[a:b], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("options", [dict(is_causal=True), dict(softcap=20.0), dict(alibi_slopes=torch.tensor([1e37, 1e37, 0.5, 0.5]))], ids=["causal", "softcap", "huge-alibi"])
def test_a_sequence_whose_logits_overflow_float32_gets_the_per_sequence_answer(options, grad):
    """Products of one sequence overflow float32 (|q|, |k| ~ 1e19) and, with huge slopes, the
    ALiBi biases too: the packed call's answer is the per-sequence one (its float64 recompute),
    whether the guard finds them before the kernel runs (gradients) or from its rows after."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 4, 8, generator=gen), torch.randn(11, 2, 8, generator=gen), torch.randn(11, 2, 3, generator=gen)
    cu_q, cu_k = torch.tensor([0, 2, 2, 9]), torch.tensor([0, 5, 6, 11])
    q[2:9] *= 1e19
    k[6:11] *= 1e19
    out = attnscale.varlen_attention(q.clone().requires_grad_(grad), k, v, cu_q, cu_k, **options)
    want = []
    for b in range(3):
        qb, kb, vb = (t[int(cu[b]) : int(cu[b + 1])].transpose(0, 1)[None] for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
        want.append(attnscale.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True, causal_alignment="bottom_right", **options)[0].transpose(0, 1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.detach(), torch.cat(want), rtol=0, atol=1e-6)


def test_a_head_whose_alibi_biases_all_overflow_to_minus_inf_is_recomputed_not_zeroed():
    """Sequence 1 has 9 queries and 3 keys: its first rows sit 4 or more positions before every
    key, and head 0's slope 1e38 takes all their biases to -inf in float32 (a row of zeros, as if
    it saw no key), while the other heads' rows are fine. That head's row must not be trusted as
    zeros: the answer is the per-sequence one (whose guard recomputes it in float64: weight on the
    nearest key)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(11, 4, 8, generator=gen), torch.randn(8, 2, 8, generator=gen), torch.randn(8, 2, 3, generator=gen)
    cu_q, cu_k = torch.tensor([0, 2, 11]), torch.tensor([0, 5, 8])
    slopes = torch.tensor([1e38, 0.5, 0.25, 0.125])
    out = attnscale.varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes)
    want = []
    for b in range(2):
        qb, kb, vb = (t[int(cu[b]) : int(cu[b + 1])].transpose(0, 1)[None] for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
        want.append(attnscale.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True, causal_alignment="bottom_right", alibi_slopes=slopes)[0].transpose(0, 1))
    want = torch.cat(want)
    assert (want[2:8, 0].abs().amax(-1) > 0).all()  # the nearest key's value, not zeros
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


def test_a_packed_signature_that_passed_is_not_checked_again_but_values_and_lengths_are(monkeypatch):
    """A packed call whose tensors' shapes, dtypes and devices, cumulative lengths and options all
    passed before is not checked again; the slopes' and sinks' values are checked on every call, and
    other lengths (same shapes) are a new signature, checked in full."""
    from attnscale import _validate

    full = []
    original = _validate.check_packed_tensors  # the first of the full checks
    monkeypatch.setattr(_validate, "check_packed_tensors", lambda *a, **kw: full.append(1) or original(*a, **kw))
    monkeypatch.setattr(_validate, "_PACKED", {})
    (q, k, v, cu_q, cu_k), _ = packed_case("gqa-dv-differs", "plain")
    slopes, sinks = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    call = dict(is_causal=True, alibi_slopes=slopes, sinks=sinks, window=(7, 0))
    first = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **call)
    again = attnscale.varlen_attention(q, k, v, cu_q, cu_k, **call)
    assert len(full) == 1 and torch.equal(first, again)
    for tensor, name in ((slopes, "alibi_slopes"), (sinks, "sinks")):
        tensor[1] = math.nan
        with pytest.raises(ValueError, match=name):
            attnscale.varlen_attention(q, k, v, cu_q, cu_k, **call)
        tensor[1] = 0.25
    moved = cu_q.clone()
    moved[1] += 1  # sequence 0 one query longer, sequence 1 one shorter: the same shapes
    attnscale.varlen_attention(q, k, v, moved, cu_k, **call)
    assert len(full) == 2
    moved[1] = moved[2] + 1  # decreasing: refused by the full checks, never served from memory
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing entries"):
        attnscale.varlen_attention(q, k, v, moved, cu_k, **call)
    attnscale.varlen_attention(q, k, v, cu_q, cu_k, **{**call, "window": [7, 0]})  # unhashable: checked every time
    attnscale.varlen_attention(q, k, v, cu_q, cu_k, **{**call, "window": [7, 0]})
    assert len(full) == 5
