"""attnscale's compiled CPU kernel: build, load, and say why when it cannot be had.

The kernel (``fused.cpp``) is C++ built against the installed torch with its extension machinery
(g++ and ninja, no network, no prebuilt binary). It is built once per environment, into
``$ATTNSCALE_KERNEL_DIR`` (default ``~/.cache/attnscale/kernels``) under a name that hashes the
source, the torch version and the flags, so a changed source or another torch builds anew.
:func:`build` does it ahead of time (``python -m attnscale.kernels``, which ``make`` runs at
install); otherwise the first call that needs it builds it and says so on stderr first.

Without a compiler, with ``ATTNSCALE_NO_KERNEL=1``, or on a build failure, :func:`load` returns
None, the reason is printed once, and attnscale runs its eager tiled kernel instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["available", "build", "kernel_dir", "load", "unavailable_reason"]

_SOURCE = Path(__file__).with_name("fused.cpp")
# AVX2 + FMA: the vectorised exp / tanh of ATen's Vectorized<float> (x86-64 from 2013 on).
_X86_FLAGS = ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
_FLAGS = ["-O3", "-fopenmp", "-std=c++17"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def kernel_dir() -> Path:
    """Where built kernels live: ``$ATTNSCALE_KERNEL_DIR``, else ``~/.cache/attnscale/kernels``."""
    root = os.environ.get("ATTNSCALE_KERNEL_DIR")
    return Path(root) if root else Path.home() / ".cache" / "attnscale" / "kernels"


def _cpu_flags() -> list[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    words = set(info.split())
    return _X86_FLAGS if {"avx2", "fma"} <= words else []


def _name(flags: list[str]) -> str:
    digest = hashlib.sha256()
    digest.update(_SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(flags).encode())
    return f"attnscale_fused_{digest.hexdigest()[:12]}"


def _why_not() -> str | None:
    if os.environ.get("ATTNSCALE_NO_KERNEL", "") not in ("", "0"):
        return "disabled by ATTNSCALE_NO_KERNEL"
    if not _cpu_flags():
        return "this CPU lacks AVX2 and FMA, which the kernel is built for"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found (install g++)"
    try:
        import ninja  # noqa: F401
    except ImportError:
        return "ninja is not installed (pip install ninja)"
    return None


def build(*, verbose: bool = False) -> ModuleType:
    """Build (or find already built) and import the kernel; raises RuntimeError if it cannot."""
    from torch.utils import cpp_extension

    reason = _why_not()
    if reason is not None:
        raise RuntimeError(f"attnscale's fused CPU kernel is unavailable: {reason}")
    flags = _FLAGS + _cpu_flags()
    name = _name(flags)
    directory = kernel_dir() / name
    if not any(directory.glob(f"{name}*.so")):
        print(f"attnscale: building the fused CPU kernel in {directory} (once per environment, about a minute) ...", file=sys.stderr, flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=name,
        sources=[str(_SOURCE)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=verbose,
    )


def load() -> ModuleType | None:
    """The kernel module, building it on first use; None (with the reason printed once) if it
    cannot be had."""
    if "module" in _state:  # loaded (or refused) already: no lock on every attention call
        return _state["module"]  # type: ignore[return-value]
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        try:
            module: ModuleType | None = build()
        except Exception as exc:  # a failed build must never break attention: fall back, say why once
            module = None
            _state["reason"] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"attnscale: {_state['reason']}; using the eager tiled kernel", file=sys.stderr, flush=True)
        _state["module"] = module
        return module


def available() -> bool:
    """Whether the compiled kernel can run here (builds it on first call)."""
    return load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`load` gave None, or None if the kernel loaded (or was not tried yet)."""
    return _state.get("reason")  # type: ignore[return-value]
