"""Backward passes without a derivative of their own: first-order gradients everywhere, and a
clear refusal where a double backward (``create_graph=True``: gradient penalties, Hessian-vector
products, ``torch.func.grad`` of ``torch.func.grad``) would need one."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["first_order"]


def first_order(backend: str, inputs: tuple[Tensor | None, ...], *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    """``grads`` of ``inputs``, computed by a backward pass that has no derivative (without a
    graph): as they are outside a graph-building backward; inside one (grad mode on, as
    ``create_graph=True`` and torch.func run backward passes) behind a node that depends on the
    inputs and whose own backward raises, naming the backend that computes the derivative."""
    anchors = [t for t in inputs if t is not None and t.requires_grad]
    if not torch.is_grad_enabled() or not anchors:
        return grads
    present = [g for g in grads if g is not None]
    refused = iter(_Refuse.apply(backend, len(present), *present, *anchors))
    return tuple(None if g is None else next(refused) for g in grads)


class _Refuse(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(backend: str, n: int, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        return tuple(g.clone() for g in tensors[:n])  # the rest: inputs, so that the node is in the graph

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.backend = inputs[0]

    @staticmethod
    def backward(ctx, *unused):  # type: ignore[override]
        raise RuntimeError(
            f"attnscale's {ctx.backend} backend has no double backward (the derivative of its backward pass, "
            "which create_graph=True, gradient penalties and nested torch.func.grad need). "
            "Fix: backend='math', which computes it"
        )
