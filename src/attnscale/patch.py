"""attnscale as torch's SDPA for a whole program: :func:`patch_torch`.

``torch.nn.functional.scaled_dot_product_attention`` is looked up when it is called, by
``nn.MultiheadAttention``, ``nn.TransformerEncoder`` and decoder layers, HuggingFace's ``"sdpa"``
attention and any model that calls ``F.scaled_dot_product_attention``: replacing it sends every
such call through attnscale (same arguments and results; attnscale's checks, NaN-row rule and
backends). attnscale's own ``"torch"`` backend calls torch's kernel bound at import
(:data:`attnscale.backends.TORCH_SDPA`), never the replaced name, so nothing recurses.

PyTorch's modules have a fast path that never calls Python's SDPA (``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` in eval mode without gradients); while patched it is off
(``torch.backends.mha.set_fastpath_enabled(False)``), so that they too run through attnscale.
Nested tensors, a layout attnscale does not take, go to torch's kernel as they came.

(No ``from __future__ import annotations`` here: TorchScript reads :func:`patched_sdpa`'s
annotations as types when it compiles a scripted module's call to torch's function.)
"""

import threading
from types import TracebackType

import torch
import torch.nn.functional as F

from torch import Tensor

from .backends import TORCH_SDPA
from .functional import scaled_dot_product_attention

__all__ = ["TorchPatch", "patch_torch", "patched_sdpa"]

_lock = threading.Lock()


@torch.jit.ignore  # TorchScript calls back into Python here
def _attnscale_sdpa(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool, scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    if query.is_nested:
        return TORCH_SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)  # type: ignore[return-value]  # no return_stats: a tensor


def patched_sdpa(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False,
) -> Tensor:
    """torch's function while patched, with torch's signature: :func:`attnscale.scaled_dot_product_attention`,
    but for nested tensors, which torch's own kernel computes (attnscale's own keywords, such as
    ``softcap``, are passed to attnscale's function itself).

    TorchScript compiles it where a scripted module calls torch's function (``torch.jit.script``
    of ``nn.MultiheadAttention`` or ``nn.TransformerEncoder`` while patched): the scripted module
    calls back into attnscale, so it computes what the eager one does, and, like any scripted code
    that calls Python, cannot be saved with ``torch.jit.save`` (script it unpatched to save it)."""
    return _attnscale_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class TorchPatch:
    """One replacement of torch's SDPA by attnscale's, undone by :meth:`undo` or on leaving a
    ``with`` block: torch's function and the modules' fast-path setting are put back as they were
    when it was made."""

    def __init__(self) -> None:
        with _lock:
            self._previous = F.scaled_dot_product_attention
            self._fastpath = torch.backends.mha.get_fastpath_enabled()
            F.scaled_dot_product_attention = patched_sdpa
            torch.backends.mha.set_fastpath_enabled(False)
        self.active = True

    def undo(self) -> None:
        """Put torch's function and the fast-path setting back (a second call does nothing)."""
        with _lock:
            if not self.active:
                return
            F.scaled_dot_product_attention = self._previous
            torch.backends.mha.set_fastpath_enabled(self._fastpath)
            self.active = False

    def __enter__(self) -> "TorchPatch":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.undo()


def patch_torch() -> "TorchPatch":
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` with
    :func:`attnscale.scaled_dot_product_attention` (:func:`patched_sdpa`) for the whole program,
    until undone::

        with attnscale.patch_torch():          # for a block
            model(x)
        patch = attnscale.patch_torch()        # or from here on
        ...
        patch.undo()

    >>> import torch, attnscale
    >>> layer = torch.nn.TransformerEncoderLayer(64, 4, batch_first=True).eval()
    >>> with attnscale.patch_torch(), torch.no_grad():
    ...     _ = layer(torch.randn(2, 10, 64))
    ...     attnscale.last_backend() is not None    # the layer's attention ran through attnscale
    True
    >>> torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    True
    """
    return TorchPatch()
