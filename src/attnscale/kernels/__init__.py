"""attnscale's compiled CPU kernel: build, load, and say why when it cannot be had.

The kernel (``fused.cpp`` and the headers it includes from ``csrc/``) is C++ built against the
installed torch with its extension machinery (g++ and ninja, no network, no prebuilt binary). It is
built once per (source, torch, Python, flags) into ``$ATTNSCALE_KERNEL_DIR`` (default
``~/.cache/attnscale/kernels``), under a name that hashes those and nothing else: environments
that share the folder share the build, whatever their paths, and a built kernel loads without a
compiler. :func:`build` does it ahead of time
(``python -m attnscale.kernels``, which ``make`` runs at install); otherwise the first call that
needs it builds it and says so on stderr first.

Each build runs in a folder of its own (``build-<pid>-*``) and moves the finished library into
place in one atomic rename: builds never wait on each other, an interrupted one leaves no lock
for others to wait on, and the folders of builders that died are removed by the next build.

Without a compiler, with ``ATTNSCALE_NO_KERNEL=1``, or on a build failure, :func:`load` returns
None, the reason is printed once, and attnscale runs its eager tiled kernel instead.
:func:`build_precondition` tells the first kinds (the kernel cannot be had here) from a build
that failed (a bug: ``python -m attnscale.kernels`` then exits 1, and so does ``make``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import torch

from .. import constants

__all__ = ["CHECKS_MAX", "available", "build", "build_precondition", "checks", "isa", "kernel_dir", "library_path", "load", "unavailable_reason"]

_SOURCE = Path(__file__).with_name("fused.cpp")  # the binding; it includes csrc/*.h, one file per concern
_HEADERS = Path(__file__).with_name("csrc")
# The widest vectors the CPU has, as ATen's own CPU_CAPABILITY builds: AVX-512 (F, BW, VL, DQ;
# 16 floats a vector), with AVX512-BF16 and AVX512-VNNI where present (BF16's one-instruction
# conversion of the softmax weights to bfloat16; VNNI's vpdpwssd for int8 decoding's integer
# products, every CPU with AVX512-BF16 has it), else AVX2 + FMA + F16C (8; x86-64 from 2013 on; F16C converts
# float16, which ATen's AVX2 vectors use). ATTNSCALE_KERNEL_ISA=avx512 or avx2 builds a narrower
# kernel on a wider CPU (the tests run them too).
_ISA_FLAGS = {
    "avx512_bf16": (("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "avx512_bf16", "avx512_vnni"), ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx512bf16", "-mavx512vnni", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-DATTNSCALE_AVX512_BF16", "-DATTNSCALE_AVX512_VNNI"]),
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"), ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
}
# -ffp-contract=off: the kernel's arithmetic is its source's, every FMA written as one. Left to the
# compiler, a * b + c was fused or not by where it was inlined, so moving code changed bits (one
# unit in the last place of a row's sum). attnscale.constants: the numbers both kernels share.
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17", *constants.cpp_defines()]

_lock = threading.Lock()
_state: dict[str, object] = {}


def kernel_dir() -> Path:
    """Where built kernels live: ``$ATTNSCALE_KERNEL_DIR``, else ``~/.cache/attnscale/kernels``."""
    root = os.environ.get("ATTNSCALE_KERNEL_DIR")
    return Path(root) if root else Path.home() / ".cache" / "attnscale" / "kernels"


def isa() -> str | None:
    """The vector ISA the kernel is built for here: "avx512_bf16", "avx512", "avx2", or None (none of them)."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    wanted = os.environ.get("ATTNSCALE_KERNEL_ISA", "").lower() or None
    for name, (features, _) in _ISA_FLAGS.items():
        if (wanted is None or wanted == name) and set(features) <= words:
            return name
    return None


def _cpu_flags() -> list[str]:
    name = isa()
    return [] if name is None else _ISA_FLAGS[name][1]


def _name(flags: list[str]) -> str:
    """The build's name: a hash of what the library depends on (never of a path)."""
    digest = hashlib.sha256()
    for source in (_SOURCE, *sorted(_HEADERS.glob("*.h"))):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(sys.implementation.cache_tag.encode())
    digest.update(" ".join(flags).encode())
    return f"attnscale_fused_{digest.hexdigest()[:12]}"


_YES, _NO = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _disabled() -> str | None:
    value = os.environ.get("ATTNSCALE_NO_KERNEL", "")
    if value.strip().lower() in _YES:
        return "disabled by ATTNSCALE_NO_KERNEL"
    if value.strip().lower() not in _NO:  # the eager kernel is right either way; the reason says what to fix
        return f"ATTNSCALE_NO_KERNEL={value!r}: expected 1/true/yes/on (no kernel) or 0/false/no/off or unset (the kernel); taken as 'no kernel'"
    if not _cpu_flags():
        wanted = os.environ.get("ATTNSCALE_KERNEL_ISA", "")
        if wanted:
            return f"ATTNSCALE_KERNEL_ISA={wanted!r}: expected one of {', '.join(_ISA_FLAGS)} that this CPU supports"
        return "this CPU lacks AVX2 and FMA, which the kernel is built for"
    return None


def build_precondition() -> str | None:
    """Why the kernel cannot be built on this machine (disabled, a CPU without AVX2 and FMA, no
    compiler, no ninja), or None where it can: there, a kernel that fails to build is a bug."""
    reason = _disabled()
    if reason is not None:
        return reason
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found (install g++)"
    try:
        import ninja  # noqa: F401
    except ImportError:
        return "ninja is not installed (pip install ninja)"
    return None


def _library(name: str) -> Path:
    return kernel_dir() / name / f"{name}.so"


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_dead_builds(directory: Path) -> None:
    """Remove the build folders of builders that no longer run (killed, or interrupted before
    their own clean-up)."""
    for folder in directory.glob("build-*"):
        pid = folder.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def build(*, verbose: bool = False) -> ModuleType:
    """Build (or find already built) and import the kernel; raises RuntimeError if it cannot."""
    reason = _disabled()
    if reason is not None:
        raise RuntimeError(f"attnscale's fused CPU kernel is unavailable: {reason}")
    flags = _FLAGS + _cpu_flags()
    name = _name(flags)
    target = _library(name)
    if target.is_file():
        return _import(name, target)
    reason = build_precondition()
    if reason is not None:
        raise RuntimeError(f"attnscale's fused CPU kernel is unavailable: {reason}")
    from torch.utils import cpp_extension

    directory = target.parent
    print(f"attnscale: building the fused CPU kernel in {directory} (once per torch and source, about a minute) ...", file=sys.stderr, flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(directory)
    with tempfile.TemporaryDirectory(prefix=f"build-{os.getpid()}-", dir=directory) as scratch:
        module = cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=scratch,
            verbose=verbose,
        )
        os.replace(Path(scratch) / f"{name}.so", target)  # atomic: others see no file or a whole one
    return module


def library_path() -> Path:
    """Where this environment's kernel library is (or would be) built."""
    return _library(_name(_FLAGS + _cpu_flags()))


def load() -> ModuleType | None:
    """The kernel module, building it on first use; None (with the reason printed once) if it
    cannot be had."""
    if "module" in _state:  # loaded (or refused) already: no lock on every attention call
        return _state["module"]  # type: ignore[return-value]
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        try:
            built = build()
            _check_option_order(built)
            module: ModuleType | None = built
        except Exception as exc:  # a failed build must never break attention: fall back, say why once
            module = None
            _state["reason"] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"attnscale: {_state['reason']}; using the eager tiled kernel", file=sys.stderr, flush=True)
        _state["module"] = module
        return module


def _check_option_order(module: ModuleType) -> None:
    """The kernel's options in :class:`~attnscale.kernels.ops.KernelOptions`' order: its
    ``forward_ordered`` reads them by position."""
    from .ops import KernelOptions

    names = module.option_names()
    if names != list(KernelOptions._fields):
        raise RuntimeError(f"the compiled kernel's options {names} are not KernelOptions' {list(KernelOptions._fields)}: rebuild it")


def available() -> bool:
    """Whether the compiled kernel can run here (builds it on first call)."""
    return load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`load` gave None, or None if the kernel loaded (or was not tried yet)."""
    return _state.get("reason")  # type: ignore[return-value]


CHECKS_MAX = 1 << 62
"""CPU tensors of float32, float64, bfloat16 or float16 up to this many entries (every size) are
checked by the compiled kernel's ``rows_ok`` and ``all_finite``, one call each, without temporaries: a decoding
step's guard in a few microseconds instead of several torch ops, and tensors past one core's
caches split over every thread as torch's reductions are (``every_run`` in
``csrc/value_checks.h``). The limit stays an argument of the kernel's calls, which refuse what exceeds it."""


_CHECKED_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


def checks(t: torch.Tensor) -> ModuleType | None:
    """The compiled kernel where its ``rows_ok`` and ``all_finite`` check ``t`` (a plain CPU
    tensor or parameter of float32, float64, bfloat16 or float16 with at most :data:`CHECKS_MAX`
    entries; the 16-bit ones read as their bits), else None."""
    if (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.is_cpu and t.dtype in _CHECKED_DTYPES and t.numel() <= CHECKS_MAX:
        return load()
    return None
