"""Several models of one architecture trained as one: parameters stacked along a group dimension.

The lab trains many tiny models (seeds of one configuration) whose every layer is a handful of
microseconds of arithmetic behind a fixed cost per torch call. :func:`stack` turns ``G`` such
models into one module with the same structure and the same ``forward``, whose parameterised
layers hold a leading group dimension and compute all members in one call (a batched matrix
product per linear layer). Inputs carry the members along the batch dimension, group-major:
rows ``g * B .. (g + 1) * B - 1`` belong to member ``g``. Layers without parameters (attention
itself, activations) need no change, since they act on each row of the batch alone.

Member ``g`` of the stack computes what model ``g`` computes, and with the loss a *sum* over
members of each member's own loss, its gradient is model ``g``'s; an optimizer whose update is
elementwise (SGD, Adam, AdamW) then moves it as it would move model ``g`` alone. Only the rounding
differs (one batched product instead of ``G`` products), which ``tests/lab/test_grouped.py``
measures in float64. :func:`member` copies one member back into a plain model and :func:`keep`
drops members (with their optimizer state) once they are done.

Supported layers: ``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``, :class:`attnscale.variants.QKNorm`
and any registered with :func:`register`; a model with other parameterised layers is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..variants.qknorm import QKNorm, QKNormKind, normalize_qk

__all__ = ["GroupedEmbedding", "GroupedLayerNorm", "GroupedLinear", "GroupedModule", "GroupedQKNorm", "groups", "keep", "member", "register", "stack"]


class GroupedModule(nn.Module):
    """A layer holding ``groups`` members' parameters, each (groups, *the plain layer's shape)."""

    groups: int

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.groups = len(layers)
        for name, _ in layers[0].named_parameters(recurse=False):
            setattr(self, name, nn.Parameter(torch.stack([getattr(layer, name).detach() for layer in layers])))

    def split(self, x: Tensor) -> Tensor:
        """(G * B, *rest) -> (G, B * prod(rest[:-1]), rest[-1]): each member's rows as one matrix."""
        return x.reshape(self.groups, -1, x.shape[-1])


class GroupedLinear(GroupedModule):
    """``nn.Linear`` for ``groups`` members: weight (G, out, in), bias (G, out) or None."""

    weight: Tensor
    bias: Tensor | None

    def __init__(self, layers: Sequence[nn.Linear]) -> None:
        super().__init__(layers)
        if layers[0].bias is None:
            self.bias = None

    def forward(self, x: Tensor) -> Tensor:
        rows = self.split(x)  # (G, B * ..., in)
        if self.bias is None:
            out = torch.bmm(rows, self.weight.transpose(1, 2))
        else:
            out = torch.baddbmm(self.bias[:, None, :], rows, self.weight.transpose(1, 2))  # (G, B * ..., out)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class GroupedLayerNorm(GroupedModule):
    """``nn.LayerNorm`` over the last dimension for ``groups`` members (elementwise affine or none)."""

    def __init__(self, layers: Sequence[nn.LayerNorm]) -> None:
        first = layers[0]
        if len(first.normalized_shape) != 1:
            raise TypeError(f"only a LayerNorm over the last dimension can be grouped; got normalized_shape={first.normalized_shape}.")
        super().__init__(layers)
        self.normalized_shape, self.eps = tuple(first.normalized_shape), first.eps
        if first.weight is None:
            self.weight = None
        if first.bias is None:
            self.bias = None

    def forward(self, x: Tensor) -> Tensor:
        y = self.split(F.layer_norm(x, self.normalized_shape, eps=self.eps))  # (G, rows, d)
        if self.weight is not None:
            y = y * self.weight[:, None, :]
        if self.bias is not None:
            y = y + self.bias[:, None, :]
        return y.reshape(x.shape)


class GroupedEmbedding(GroupedModule):
    """``nn.Embedding`` (no padding index, no max norm) for ``groups`` members: weight (G, V, d)."""

    weight: Tensor

    def __init__(self, layers: Sequence[nn.Embedding]) -> None:
        first = layers[0]
        if first.padding_idx is not None or first.max_norm is not None or first.sparse:
            raise TypeError("only an nn.Embedding without padding_idx, max_norm or sparse gradients can be grouped.")
        super().__init__(layers)

    def forward(self, ids: Tensor) -> Tensor:
        G, V, d = self.weight.shape
        offsets = torch.arange(G, device=ids.device)[:, None] * V  # (G, 1): member g's rows of the flat table
        flat = ids.reshape(G, -1) + offsets  # (G, B * T)
        return F.embedding(flat, self.weight.reshape(G * V, d)).reshape(*ids.shape, d)


class GroupedQKNorm(GroupedModule):
    """:class:`attnscale.variants.QKNorm` for ``groups`` members: gains (G, D), logit scale (G,)."""

    def __init__(self, layers: Sequence[QKNorm]) -> None:
        first = layers[0]
        super().__init__(layers)
        self.kind, self.eps, self.head_dim = first.kind, first.eps, first.head_dim
        for name in ("q_weight", "k_weight", "q_bias", "k_bias", "logit_scale"):
            if getattr(first, name) is None:
                setattr(self, name, None)

    def _member(self, x: Tensor, p: Tensor | None, add: bool) -> Tensor:
        """x (G * B, ..., D) plus or times member g's p (G, D) or (G,) on its rows."""
        if p is None:
            return x
        trailing = p.shape[1:]  # (D,) for a gain or bias, () for the logit scale
        shaped = p.reshape(self.groups, *([1] * (x.ndim - len(trailing))), *trailing)  # (G, 1, ..., 1, D or 1)
        y = x.unflatten(0, (self.groups, -1))  # (G, B, H, L, D)
        return (y + shaped if add else y * shaped).flatten(0, 1)

    def forward(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """query (G * B, H, L, D), key (G * B, Hkv, S, D) -> normalised, times each member's gains."""
        q, k = normalize_qk(query, key, kind=self.kind, eps=self.eps)
        if self.kind is not QKNormKind.L2:
            q, k = self._member(q, self.q_weight, False), self._member(k, self.k_weight, False)
            q, k = self._member(q, self.q_bias, True), self._member(k, self.k_bias, True)
        return self._member(q, self.logit_scale, False), k


_GROUPED: dict[type[nn.Module], Callable[[Sequence[nn.Module]], GroupedModule]] = {
    nn.Linear: GroupedLinear,
    nn.LayerNorm: GroupedLayerNorm,
    nn.Embedding: GroupedEmbedding,
    QKNorm: GroupedQKNorm,
}


def register(layer: type[nn.Module], grouped: Callable[[Sequence[nn.Module]], GroupedModule]) -> None:
    """Let :func:`stack` group layers of exactly type ``layer`` with ``grouped(layers)``."""
    _GROUPED[layer] = grouped


def stack(models: Sequence[nn.Module]) -> nn.Module:
    """One module computing ``models`` (same architecture) as members 0 .. G-1 of each batch.

    The models are not changed. Raises ``TypeError`` for a parameterised layer type that cannot be
    grouped and ``ValueError`` for models whose structure or parameter shapes differ.

    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    >>> both = stack([a, b])
    >>> x = torch.randn(2 * 4, 3)  # member 0's 4 rows, then member 1's
    >>> torch.allclose(both(x), torch.cat([a(x[:4]), b(x[4:])]), atol=1e-6)
    True
    """
    if not models:
        raise ValueError("models must hold at least one model; got an empty sequence.")
    shapes = [[(n, tuple(p.shape)) for n, p in m.named_parameters()] for m in models]
    if any(s != shapes[0] for s in shapes):
        raise ValueError("every model must have the same parameters (names and shapes); build them from one configuration.")
    out = copy.deepcopy(models[0])

    def replace(parent: nn.Module, path: str, layers: Sequence[nn.Module]) -> nn.Module:
        if next(layers[0].parameters(recurse=False), None) is not None:
            maker = _GROUPED.get(type(layers[0]))
            if maker is None:
                raise TypeError(f"cannot group {path or 'the model'} ({type(layers[0]).__name__}): register a grouped version with attnscale.lab.grouped.register.")
            return maker(layers)
        for name, child in list(parent.named_children()):
            setattr(parent, name, replace(child, f"{path}.{name}" if path else name, [getattr(_walk(m, path), name) for m in models]))
        return parent

    return replace(out, "", models)


def _walk(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def groups(model: nn.Module) -> int:
    """How many members ``model`` computes: 1 for a plain model."""
    return next((m.groups for m in model.modules() if isinstance(m, GroupedModule)), 1)


def member(stacked: nn.Module, template: nn.Module, g: int) -> nn.Module:
    """A copy of ``template`` (a plain model of the stacked architecture) holding member ``g``'s parameters."""
    out = copy.deepcopy(template)
    with torch.no_grad():
        out.load_state_dict({name: p[g] for name, p in stacked.named_parameters()})
    return out


def keep(stacked: nn.Module, members: Sequence[int], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Keep only ``members`` (indices into the current members, in order) of ``stacked``, in place,
    with their slices of the optimizer's state (moments; a shared step count stays).

    Each parameter is replaced by a new one (autograd records a parameter's shape), also in the
    optimizer's parameter groups."""
    index = torch.as_tensor(list(members), dtype=torch.long)
    old = groups(stacked)
    swapped: dict[nn.Parameter, nn.Parameter] = {}
    with torch.no_grad():
        for module in stacked.modules():
            if not isinstance(module, GroupedModule):
                continue
            module.groups = len(members)
            for name, p in list(module.named_parameters(recurse=False)):
                new = nn.Parameter(p.detach()[index].clone(), requires_grad=p.requires_grad)
                setattr(module, name, new)
                swapped[p] = new
        if optimizer is None:
            return
        for group in optimizer.param_groups:
            group["params"] = [swapped.get(p, p) for p in group["params"]]
        for p, new in swapped.items():
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[new] = {
                    key: value[index].clone() if isinstance(value, Tensor) and value.ndim == p.ndim and value.shape[0] == old else value
                    for key, value in state.items()
                }
