"""MultiHeadAttention's packed q, k, v projection: one matrix product over the three projections'
weights, laid out as consecutive rows of one tensor, for self-attention that needs no gradient of
them; every other call (gradients, hooks, a replaced projection or weight, cross-attention,
tracing) projects with each ``Linear`` itself. Both routes must give the same output, and a route
must never read weights the module no longer holds."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from attnscale import KVCache, MultiHeadAttention

F64 = torch.float64
# The two routes sum the same products over d_model in a GEMM each (measured equal, bit for bit,
# in float32, bfloat16 and float16 on the CPUs tried); float64 rounding of another blocking order
# stays far below this.
ATOL = 1e-12


class LinearCalls(TorchFunctionMode):
    """Counts torch.nn.functional.linear calls: 2 on the packed route (q, k, v; out_proj), 4 on
    the other (q; k; v; out_proj)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.count += 1
        return func(*args, **(kwargs or {}))


def linear_calls(m: MultiHeadAttention, *args, **kwargs) -> tuple[torch.Tensor, int]:
    with LinearCalls() as calls:
        out = m(*args, **kwargs)
    return out, calls.count


def module(seed: int = 0, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(kwargs.pop("d_model", 48), kwargs.pop("num_heads", 6), dtype=kwargs.pop("dtype", F64), **kwargs).eval()


def x_of(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def by_hand(m: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The module's output from its parameters as they are now, without the module's forward."""
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    q = nn.functional.linear(x, m.q_proj.weight, m.q_proj.bias).unflatten(-1, (H, D)).transpose(1, 2)
    k = nn.functional.linear(x, m.k_proj.weight, m.k_proj.bias).unflatten(-1, (Hkv, D)).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = nn.functional.linear(x, m.v_proj.weight, m.v_proj.bias).unflatten(-1, (Hkv, D)).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    weights = torch.softmax(q @ k.transpose(-1, -2) * m.scale, dim=-1)
    return nn.functional.linear((weights @ v).transpose(1, 2).flatten(-2), m.out_proj.weight, m.out_proj.bias)


def consecutive(m: MultiHeadAttention) -> bool:
    weights = (m.q_proj.weight, m.k_proj.weight, m.v_proj.weight)
    step = weights[0].element_size()
    return all(b.data_ptr() == a.data_ptr() + a.numel() * step for a, b in zip(weights, weights[1:]))


@pytest.mark.parametrize("kwargs", [{}, {"num_kv_heads": 2}, {"bias": False}, {"batch_first": False}], ids=["mha", "gqa", "no-bias", "seq-first"])
def test_packed_route_equals_each_projections_own(kwargs):
    m = module(**kwargs)
    x = x_of(2, 5, 48) if m.batch_first else x_of(5, 2, 48)
    assert consecutive(m)
    with torch.no_grad():
        packed, packed_calls = linear_calls(m, x)
    unpacked, unpacked_calls = linear_calls(m, x)  # grad enabled: each Linear itself
    assert (packed_calls, unpacked_calls) == (2, 4)
    torch.testing.assert_close(packed, unpacked.detach(), rtol=0, atol=ATOL)
    want = by_hand(m, x) if m.batch_first else by_hand(m, x.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(packed, want.detach(), rtol=0, atol=1e-10)


def test_state_dict_keys_and_gradients_are_the_three_projections():
    m = module()
    assert [name for name, _ in m.named_parameters()][:6] == ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"]
    m(x_of(2, 5, 48)).sum().backward()
    for p in (m.q_proj.weight, m.k_proj.weight, m.v_proj.weight, m.q_proj.bias):
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.abs().sum() > 0


def test_in_place_updates_reach_the_packed_route():
    m, x = module(), x_of(2, 5, 48)
    with torch.no_grad():
        before = m(x)
        m.k_proj.weight.mul_(3.0)  # as an optimizer step or QK-Clip writes
        m.v_proj.bias.add_(1.0)
        after, calls = linear_calls(m, x)
    assert calls == 2
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, by_hand(m, x), rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "replace",
    [
        lambda m: setattr(m.k_proj, "weight", nn.Parameter(torch.randn_like(m.k_proj.weight))),
        lambda m: setattr(m.k_proj.weight, "data", torch.randn_like(m.k_proj.weight)),
        lambda m: setattr(m.v_proj.bias, "data", torch.randn_like(m.v_proj.bias)),
        lambda m: m.load_state_dict({name: torch.randn_like(t) for name, t in m.state_dict().items()}, assign=True),
        lambda m: setattr(m.q_proj, "bias", None),  # k and v keep theirs
    ],
    ids=["new-parameter", "weight-data", "bias-data", "load-assign", "one-bias-dropped"],
)
def test_a_replaced_weight_is_read_never_the_one_it_replaced(replace):
    m, x = module(), x_of(2, 5, 48)
    with torch.no_grad():
        m(x)  # the packed route taken once and remembered
        replace(m)
        out, calls = linear_calls(m, x)
    assert calls == 4  # the replaced weights lie apart: each projection itself
    torch.testing.assert_close(out, by_hand(m, x), rtol=0, atol=1e-10)


def test_load_state_dict_copies_in_place_and_keeps_the_packed_route():
    m, source, x = module(), module(seed=5), x_of(2, 5, 48)
    m.load_state_dict(source.state_dict())
    with torch.no_grad():
        out, calls = linear_calls(m, x)
    assert calls == 2 and consecutive(m)
    torch.testing.assert_close(out, by_hand(source, x), rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "convert",
    [lambda m: m.to(torch.float32), lambda m: m.float().double(), copy.deepcopy],
    ids=["to-float32", "float-double", "deepcopy"],
)
def test_conversions_and_copies_keep_the_packed_route(convert):
    m, x = module(), x_of(2, 5, 48)
    with torch.no_grad():
        m(x)
    converted = convert(m)
    assert consecutive(converted)
    xc = x.to(converted.q_proj.weight.dtype)
    with torch.no_grad():
        out, calls = linear_calls(converted, xc)
    assert calls == 2
    torch.testing.assert_close(out, by_hand(converted, xc), rtol=0, atol=1e-5 if xc.dtype == torch.float32 else 1e-10)


def test_saved_and_loaded_through_torch_save_and_safetensors():
    safetensors = pytest.importorskip("safetensors.torch")
    m, x = module(), x_of(2, 5, 48)
    buffer = io.BytesIO()
    torch.save(m.state_dict(), buffer)
    buffer.seek(0)
    fresh = module(seed=9)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    again = module(seed=10)
    again.load_state_dict(safetensors.load(safetensors.save(m.state_dict())))  # tensors that share memory without overlapping are saved
    with torch.no_grad():
        for loaded in (fresh, again):
            torch.testing.assert_close(loaded(x), m(x), rtol=0, atol=0)


def test_hooks_and_replaced_projections_run():
    m, x = module(), x_of(2, 5, 48)
    seen = []
    handle = m.k_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        out, calls = linear_calls(m, x)
    handle.remove()
    assert seen == [torch.Size([2, 5, 48])] and calls == 4

    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    doubled = Doubled(48, 48, dtype=F64)
    with torch.no_grad():
        plain = m(x)
        doubled.weight.copy_(m.q_proj.weight)
        doubled.bias.copy_(m.q_proj.bias)
        m.q_proj = doubled  # its forward must run: the packed route would read its weights alone
        out = m(x)
        doubled.weight.mul_(0.5)
        doubled.bias.mul_(0.5)  # 2 (W / 2 x + b / 2) = W x + b
        halved = m(x)
    assert (out - plain).abs().max() > 1e-3
    torch.testing.assert_close(halved, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("projection", ["k_proj", "out_proj"], ids=["k_proj", "out_proj"])
def test_an_instance_forward_runs_and_a_backward_hook_fires(projection):
    # accelerate's hooks set `forward` on the instance; a full backward hook needs nn.Module.__call__
    m, x = module(), x_of(2, 5, 48)
    linear = getattr(m, projection)
    calls = []
    plain_forward = linear.forward
    linear.forward = lambda t: calls.append(t.shape) or plain_forward(t)
    with torch.no_grad():
        m(x)
    assert calls == [torch.Size([2, 5, 48])]
    del linear.forward
    grads = []
    linear.register_full_backward_hook(lambda module, grad_in, grad_out: grads.append(grad_out[0].shape))
    m(x.requires_grad_()).sum().backward()  # (an input that needs grad: the hook sees its module's own)
    assert grads == [torch.Size([2, 5, 48])]


def test_cross_attention_and_caches_project_each_input():
    m = module(kdim=32, vdim=40)
    assert not consecutive(m)
    q, kv = x_of(2, 3, 48), (x_of(2, 7, 32, seed=2), x_of(2, 7, 40, seed=3))
    with torch.no_grad():
        _, calls = linear_calls(m, q, *kv)
    assert calls == 4
    same = module()  # d_model wide key and value that are not the query: each projection its own input
    k = x_of(2, 7, 48, seed=4)
    with torch.no_grad():
        _, calls = linear_calls(same, q, k, k)
        cache = KVCache()
        first, first_calls = linear_calls(same, q, cache=cache)
        second, second_calls = linear_calls(same, q[:, :1], cache=cache)
    assert (calls, first_calls, second_calls) == (4, 2, 2)
    full = same(torch.cat([q, q[:, :1]], dim=1), is_causal=True).detach()  # its last row sees all four keys, as the decoded step
    torch.testing.assert_close(second[:, -1], full[:, -1], rtol=0, atol=1e-10)


def test_compiled_and_exported_forward_equals_eager():
    m, x = module(dtype=torch.float32), x_of(2, 5, 48).float()
    with torch.no_grad():
        eager = m(x)
        compiled = torch.compile(m, fullgraph=True, backend="eager")(x)  # traced: each projection itself (no addresses read)
        exported = torch.export.export(m, (x,)).module()(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)
    torch.testing.assert_close(exported, eager, rtol=0, atol=1e-6)
