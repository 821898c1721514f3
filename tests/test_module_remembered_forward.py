"""MultiHeadAttention's remembered forward: a plain self-attention call (every argument but the
query at its default) whose attention the pipeline has answered for the same signature is the
packed projection, that remembered call and the output projection, in one compiled call
(``remembered_module_call``). It must return what the module's full forward returns, bit for bit,
leave every other call to it, and never compute a projection for a signature it does not hold."""

import math

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import attnscale
from attnscale import AttentionConfig, MultiHeadAttention, kernels
from attnscale import _remembered as memory

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no compiled kernel (no compiler)")


class FullForward(TorchFunctionMode):
    """Runs every torch function as it is; under it no call takes a remembered answer (a
    torch-function mode is outside the remembered calls' gate), so the module's full forward runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Hits:
    """Counts the remembered module calls that answered (not None) while it is entered."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answered = self.asked = 0
        self._monkeypatch = monkeypatch

    def __enter__(self) -> "Hits":
        real = memory.module_call
        assert real is not None, "no call remembered yet"

        def counted(*args):
            hit = real(*args)
            self.asked += 1
            self.answered += hit is not None
            return hit

        self._monkeypatch.setattr(memory, "module_call", counted)
        return self

    def __exit__(self, *exc) -> None:
        self._monkeypatch.undo()


def module(dtype=torch.float32, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(kwargs.pop("d_model", 48), kwargs.pop("num_heads", 6), dtype=dtype, **kwargs).eval()


def x_of(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=dtype)


def remembered_and_full(m: MultiHeadAttention, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor, Hits, str | None]:
    """The module's output by its full forward (which leaves the attention's signature
    remembered) and then by a plain call, which the remembered forward answers."""
    with torch.no_grad():
        m(x)  # (remembers the attention's signature, if it is one the pipeline remembers)
        with FullForward():
            full = m(x)
        full_backend = attnscale.last_backend()
        with Hits(monkeypatch) as hits:
            out = m(x)
    assert attnscale.last_backend() == full_backend
    return out, full, hits, full_backend


CASES = {
    "mha": ({}, torch.float32),
    "gqa": ({"num_kv_heads": 2}, torch.float32),
    "no bias": ({"bias": False}, torch.float32),
    "seq-first": ({"batch_first": False}, torch.float32),
    "float64": ({}, torch.float64),
    "softcap (the compiled kernel's plan)": ({"config": AttentionConfig(softcap=20.0)}, torch.float32),
    "window": ({"config": AttentionConfig(window=(2, 0))}, torch.float32),
    "sinks": ({"config": AttentionConfig(sinks=True)}, torch.float32),
}


@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_a_plain_call_takes_the_remembered_forward_and_returns_the_full_forwards_output(case, monkeypatch):
    kwargs, dtype = CASES[case]
    m = module(dtype, **kwargs)
    x = x_of(2, 5, 48, dtype=dtype) if m.batch_first else x_of(5, 2, 48, dtype=dtype)
    out, full, hits, _ = remembered_and_full(m, x, monkeypatch)
    assert (hits.asked, hits.answered) == (1, 1)
    assert torch.equal(out, full)  # the same ops on the same tensors
    assert out.shape == x.shape


def test_values_its_checks_refuse_get_the_full_forwards_answer(monkeypatch):
    """An inf in one token's features makes keys that are not finite: the remembered call's
    check of k refuses them, and the full forward gives the NaN rule's rows."""
    m, x = module(), x_of(2, 5, 48)
    with torch.no_grad():
        m(x)
        bad = x.clone()
        bad[1, 3, 7] = math.inf
        with FullForward():
            full = m(bad)
        with Hits(monkeypatch) as hits:
            out = m(bad)
    assert (hits.asked, hits.answered) == (1, 0)
    torch.testing.assert_close(out, full, rtol=0, atol=0, equal_nan=True)
    assert out[1].isnan().all() and out[0].isfinite().all()  # (every query of the batch row sees the bad key)


def _hook(calls: list) -> object:
    return lambda module, args, output: calls.append(type(module).__name__)


OTHER_CALLS = {
    "gradient enabled": lambda m, x: m(x),
    "is_causal": lambda m, x: m(x, is_causal=True),
    "return_stats": lambda m, x: m(x, return_stats=True).output,
    "need_weights": lambda m, x: m(x, need_weights=True).output,
    "cross-attention": lambda m, x: m(x, x[:, :3], x[:, :3]),
    "a key mask": lambda m, x: m(x, key_mask=torch.ones(2, 5, dtype=torch.bool)),
}


@pytest.mark.parametrize("call", list(OTHER_CALLS), ids=str)
def test_every_other_call_takes_the_full_forward(call, monkeypatch):
    m, x = module(), x_of(2, 5, 48)
    with torch.no_grad():
        m(x)
    grad = call == "gradient enabled"
    with torch.set_grad_enabled(grad), Hits(monkeypatch) as hits:
        out = OTHER_CALLS[call](m, x)
        with FullForward():
            full = OTHER_CALLS[call](m, x)
    assert hits.answered == 0 and hits.asked == 0
    assert torch.equal(out, full)


@pytest.mark.parametrize("where", ["out_proj", "q_proj"], ids=str)
def test_hooks_training_and_variants_take_the_full_forward(where, monkeypatch):
    """A hook on a projection runs (the remembered forward calls no Linear), dropout in training
    and a variant step (RoPE) take the full forward."""
    m, x = module(), x_of(2, 5, 48)
    with torch.no_grad():
        m(x)
        calls: list = []
        handle = getattr(m, where).register_forward_hook(_hook(calls))
        with Hits(monkeypatch) as hits:
            m(x)
        handle.remove()
        assert calls == ["Linear"] and hits.answered == 0
        dropping = module(dropout=0.5).train()
        dropping(x)
        rope = module(config=AttentionConfig(positional="rope"))
        rope(x)
        with Hits(monkeypatch) as hits:
            dropping(x), rope(x)
        assert hits.asked == 0


class Marked(nn.Parameter):
    """A Parameter subclass (its memory is not read by the compiled call: a subclass may mean more)."""


def _apart_in_adjacent_memory(m: MultiHeadAttention) -> None:
    """q, k and v weights consecutive in memory but each in a storage of its own (three
    frombuffer tensors over one bytearray): no view may span them."""
    weights = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]).detach()
    m._memory = bytearray(weights.numpy().tobytes())  # (kept alive with the module)
    n = m.q_proj.weight.numel()
    for i, projection in enumerate((m.q_proj, m.k_proj, m.v_proj)):
        part = torch.frombuffer(m._memory, dtype=weights.dtype, count=n, offset=i * n * weights.element_size())
        projection.weight = nn.Parameter(part.view_as(projection.weight))


CHANGED = {  # how the projections change after a remembered call, and whether they stay packed
    "in-place update": (lambda m: (m.k_proj.weight.mul_(3.0), m.v_proj.bias.add_(1.0)), True),
    "new parameter": (lambda m: setattr(m.k_proj, "weight", nn.Parameter(torch.randn_like(m.k_proj.weight))), False),
    "weight data": (lambda m: setattr(m.k_proj.weight, "data", torch.randn_like(m.k_proj.weight)), False),
    "bias data": (lambda m: setattr(m.v_proj.bias, "data", torch.randn_like(m.v_proj.bias)), False),
    "one bias dropped": (lambda m: setattr(m.q_proj, "bias", None), False),
    "a Parameter subclass over the same memory": (lambda m: setattr(m.v_proj, "weight", Marked(m.v_proj.weight.detach())), False),
    "out_proj's weight a Parameter subclass": (lambda m: setattr(m.out_proj, "weight", Marked(m.out_proj.weight.detach())), False),
    "adjacent memory of separate storages": (_apart_in_adjacent_memory, False),
}


def _weights_of_47_and_49_rows(m: MultiHeadAttention) -> None:
    rows = m.q_proj.weight.detach().as_strided((3 * 48, 48), (48, 1))  # the packed rows, q's k's and v's
    m.q_proj.weight, m.k_proj.weight = nn.Parameter(rows[:47]), nn.Parameter(rows[47:96])


def _biases_of_one_column(m: MultiHeadAttention) -> None:
    column = m.q_proj.bias.detach().as_strided((3 * 48, 1), (1, 1))  # the packed biases, as (144, 1)
    for i, projection in enumerate((m.q_proj, m.k_proj, m.v_proj)):
        projection.bias = nn.Parameter(column[i * 48 : (i + 1) * 48])


MISSHAPEN = {
    "weights of 47 and 49 rows (as many in all)": _weights_of_47_and_49_rows,  # split wrongly by the heads' sizes
    "biases of shape (48, 1)": _biases_of_one_column,  # broadcast otherwise packed (144, 1) than apart (48, 1)
}


@pytest.mark.parametrize("misshapen", list(MISSHAPEN), ids=str)
def test_packed_parts_of_other_shapes_are_never_taken_as_the_heads_would(misshapen, monkeypatch):
    """Parts re-pointed at the same packed memory, consecutive there, but not of the shapes the
    heads take: neither packed route takes them (each part's shape is checked), so the full
    forward's projections run and torch refuses them, where a packed route would have answered
    silently."""
    m, x = module(torch.float64), x_of(2, 5, 48, dtype=torch.float64)
    with torch.no_grad():
        m(x)  # (remembered)
        MISSHAPEN[misshapen](m)
        assert m._packed_projection() is None
        with Hits(monkeypatch) as hits, pytest.raises(RuntimeError):
            m(x)
    assert (hits.asked, hits.answered) == (1, 0)


def _by_hand(m: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The module's output from its parameters as they are now, without the module's forward."""
    H, D = m.num_heads, m.head_dim
    q, k, v = (nn.functional.linear(x, p.weight, p.bias).unflatten(-1, (H, D)).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    weights = torch.softmax(q @ k.transpose(-1, -2) * m.scale, dim=-1)
    return nn.functional.linear((weights @ v).transpose(1, 2).flatten(-2), m.out_proj.weight, m.out_proj.bias)


@pytest.mark.parametrize("change", list(CHANGED), ids=str)
def test_projections_it_cannot_view_as_one_take_the_full_forward(change, monkeypatch):
    """The compiled call finds the packed projection itself (q, k and v weights, and biases,
    consecutive in one storage, plain tensors): after a change that leaves them so it answers
    with the weights as they are now; after any other, the full forward runs."""
    changed, packed = CHANGED[change]
    m, x = module(torch.float64), x_of(2, 5, 48, dtype=torch.float64)
    with torch.no_grad():
        m(x)  # (remembered)
        changed(m)
        with Hits(monkeypatch) as hits:
            out = m(x)
        with FullForward():
            full = m(x)
    assert (hits.asked, hits.answered) == (1, int(packed))
    assert torch.equal(out, full)
    torch.testing.assert_close(out, _by_hand(m, x), rtol=0, atol=1e-12)  # (float64: the routes' sums differ in rounding only)


def test_rows_of_one_row_parts_are_read_at_their_own_addresses(monkeypatch):
    """Parts of one row each (d_model 1) may carry any stride in their first dim; the packed view
    over them steps by one row, not by the first part's stride (which would read memory past
    them), on the full forward's packing and on the compiled call's."""
    m, x = module(torch.float64, d_model=1, num_heads=1), x_of(2, 5, 1, dtype=torch.float64)
    memory_ = torch.randn(64, dtype=torch.float64)
    for i, projection in enumerate((m.q_proj, m.k_proj, m.v_proj)):
        projection.weight = nn.Parameter(memory_.as_strided((1, 1), (17, 1), i))  # consecutive entries 0, 1, 2; first stride 17
    m.q_proj.bias.data, m.k_proj.bias.data, m.v_proj.bias.data = (memory_[40:43].as_strided((1,), (1,), 40 + i) for i in range(3))
    with torch.no_grad():
        m(x)  # (remembered)
        with Hits(monkeypatch) as hits:
            out = m(x)
        with FullForward():
            full = m(x)
    assert (hits.asked, hits.answered) == (1, 1)
    torch.testing.assert_close(out, _by_hand(m, x), rtol=0, atol=1e-12)
    torch.testing.assert_close(full, _by_hand(m, x), rtol=0, atol=1e-12)


def test_bad_queries_are_refused_as_by_the_full_forward():
    m, x = module(), x_of(2, 5, 48)
    with torch.no_grad():
        m(x)
        with pytest.raises(TypeError, match="the module's dtype torch.float32"):
            m(x.double())
        with pytest.raises(ValueError, match=r"shape \(B, L, E\) with E = d_model = 48"):
            m(x[..., :40])
        with pytest.raises(TypeError, match="a torch.Tensor"):
            m(x.tolist())


def test_a_signature_it_does_not_hold_computes_nothing():
    """The signature is looked up from the projection's sizes before anything is computed: with
    none remembered for it, the call answers None before reading its weights (an output weight of
    the wrong size, which the output projection would refuse, is never used)."""
    kernel, m = kernels.load(), module()
    kernel.forget_calls()
    x, weight = x_of(2, 5, 48), torch.randn(3 * 48, 48)  # (consecutive parts of one tensor, as packed)
    args = dict(
        q_weight=weight[:48], q_bias=None, k_weight=weight[48:96], k_bias=None, v_weight=weight[96:], v_bias=None,
        out_weight=torch.randn(48, 7), out_bias=None, heads=6, kv_heads=6, head_dim=8, scale=m.scale,
        enable_gqa=False, alignment=attnscale.CausalAlignment.TOP_LEFT, softcap=None, window=None, sinks=None, limit=1 << 62,
    )  # fmt: skip
    assert kernel.remembered_module_call(x, **args) is None
    with torch.no_grad():
        m(x)  # the module's signature, remembered
    with pytest.raises(RuntimeError):  # now the projections run, and torch refuses the output weight
        kernel.remembered_module_call(x, **args)


def test_a_monitored_module_is_recorded_at_every_call():
    """attnscale.monitor hooks the model's modules and replaces the module's attention function:
    a module whose plain call was remembered before is recorded at every call under it."""
    m, x = module(d_model=32, num_heads=4), x_of(2, 5, 32)
    with torch.no_grad():
        m(x), m(x)
        with attnscale.monitor(m) as mon:
            for _ in range(3):
                m(x)
    assert [h.calls for h in mon.report().heads] == [3, 3, 3, 3]


def test_a_replaced_attention_function_is_called(monkeypatch):
    """The forward calls attnscale.modules.scaled_dot_product_attention by its global name; where
    that is replaced (as attnscale.monitor replaces it), the replacement runs, without hooks too."""
    import attnscale.modules as modules

    m, x = module(), x_of(2, 5, 48)
    calls = []
    real = modules.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with torch.no_grad():
        want = m(x)
        monkeypatch.setattr(modules, "scaled_dot_product_attention", counted)
        with Hits(monkeypatch) as hits:
            out = m(x)
    assert calls == [1] and hits.asked == 0 and torch.equal(out, want)
