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


_done = False
_busy = False


def _register_once() -> None:
    global _done, _busy
    if _done or _busy:
        return
    _busy = True  # register() imports transformers' modules: its own import events come back here
    try:
        _register()
        _done = True
    finally:
        _busy = False


def _loaded() -> bool:
    """Whether transformers.modeling_utils has finished executing (not merely entered sys.modules)."""
    module = sys.modules.get(_TARGET)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``transformers.modeling_utils`` is being imported, it lets the
    other finders find it and wraps its loader so that attnscale registers once it has run. It
    stays on ``sys.meta_path`` until then: a ``find_spec`` that no import follows (a probe of
    whether transformers is installed) does not use it up."""

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None):  # type: ignore[override]
        if fullname != _TARGET or _done:
            return None
        others = [finder for finder in sys.meta_path if finder is not self]
        spec = None
        for finder in others:  # the search the import system makes next, without this finder
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register_once()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _on_import(event: str, args: tuple[object, ...]) -> None:
    """An audit hook, the fallback where another finder ahead of :class:`_AfterImport` (an import
    hook of typeguard or jaxtyping, say) loads transformers' modeling code: the first import after
    it has run registers. Every import statement raises this event; after registering, a check of
    one flag."""
    if not _done and event == "import" and _loaded():
        _register_once()


_hooked = False


def install() -> None:
    """Register now if transformers' modeling code is loaded, else once it is (idempotent)."""
    global _hooked
    if _loaded():
        _register_once()
        return
    if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    if not _hooked:
        sys.addaudithook(_on_import)  # audit hooks cannot be removed: it goes quiet once registered
        _hooked = True
