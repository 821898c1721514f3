"""``attn_implementation="attnscale"`` after ``import attnscale`` alone.

transformers keeps its attention functions in a registry (``AttentionInterface``, defined in
``transformers.modeling_utils``) that a model consults when it is built. :func:`install` registers
attnscale there (:func:`attnscale.diagnostics.hf.register`) right after that module is first
imported, or at once if it is imported already; importing attnscale never imports transformers.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["install"]

_TARGET = "transformers.modeling_utils"


def _register() -> None:
    try:
        from ..diagnostics.hf import register

        register()
    except Exception as exc:  # an incompatible transformers must not break its own import
        warnings.warn(f"attnscale could not register attn_implementation='attnscale' with transformers: {exc}", RuntimeWarning, stacklevel=2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``transformers.modeling_utils`` is being imported, it lets the
    other finders find it and wraps its loader so that attnscale registers once it has run."""

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None):  # type: ignore[override]
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # once; and the search below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Register now if transformers' modeling code is loaded, else once it is (idempotent)."""
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
