"""Whether a call is being traced rather than run: then attnscale makes no host synchronisation,
no Python logging and no branch on tensor values, so that torch.compile (fullgraph), torch.export,
FakeTensor and meta tensors and torch.func see one graph of torch ops. torch.jit.trace, which
would freeze a backend chosen from the example's shapes into its trace, is refused.

The checks that need values (finite ALiBi slopes, sinks and float-mask values, the NaN-row rule,
the float64 recompute of products that overflow float32, the tiled kernel's static offset) run in
eager mode only; shape, dtype and option checks are static and run always.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["refuse_jit_trace", "tracing", "under_vmap"]

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_transforms_active = torch._C._are_functorch_transforms_active


def _functorch_wrapped(t: Tensor) -> bool:
    """Whether ``t`` is wrapped by a torch.func transform (vmap, grad, jvp, functionalize), asked
    of the tensor only while a transform is active: a live wrapper exists only inside one, and
    whether one is costs a fifth of asking a tensor."""
    return _transforms_active() and _is_wrapped(t)


def constant_result(fn: Callable[P, R]) -> Callable[P, R]:
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo (about a
    second at ``import attnscale``): the mark dynamo reads, set as that function sets it
    (tests/test_compile.py checks that the two agree)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def tracing(*tensors: object) -> bool:
    """True under torch.compile / torch.export, or when a tensor has no data to look at: fake,
    meta, or wrapped by a torch.func transform (vmap, grad, jvp). Non-tensors (bad input, which
    validation then refuses) count for nothing."""
    if torch.compiler.is_compiling():
        return True
    transformed = _transforms_active()
    for t in tensors:
        if t is None:
            continue
        # is_meta, not device.type: every call asks, and making a torch.device costs several times more
        if type(t) is Tensor:  # the common case: a plain tensor is no FakeTensor
            if t.is_meta or (transformed and _is_wrapped(t)):
                return True
        elif isinstance(t, Tensor) and (t.is_meta or isinstance(t, FakeTensor) or (transformed and _is_wrapped(t))):
            return True
    return False


def under_vmap() -> bool:
    """True inside a torch.func.vmap (at any level of nested transforms), where an autograd
    Function without a batching rule, such as the eager tiled kernel's, cannot run. False while
    torch.compile traces: dynamo cannot trace the interpreter stack's query (a graph break), and
    the traced graph carries no vmap of its own."""
    if torch.compiler.is_compiling():
        return False
    stack = torch._C._functorch.get_interpreter_stack()
    return stack is not None and any(level.key() == torch._C._functorch.TransformType.Vmap for level in stack)


def refuse_jit_trace(entry: str) -> None:
    """A clear error under torch.jit.trace, which would freeze attnscale's shape-dependent choice
    of backend (and its checks) into the trace as constants and warn on every shape it reads."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"attnscale.{entry}: torch.jit.trace is not supported (deprecated since torch 2.13; a trace would "
            "freeze the backend chosen for the example's shapes and values). Fix: torch.compile or "
            "torch.export, which attnscale supports, or call attnscale outside the traced function"
        )
