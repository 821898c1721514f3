"""Shared test set-up: a derandomized hypothesis profile, so every run tests the same examples."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "attnscale",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("attnscale")


def pytest_configure(config):
    """Under ``pytest -n N`` (pytest-xdist) each worker takes its share of torch's threads, so N
    workers together use the cores one process would, instead of N times as many threads."""
    import os

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // int(workers)))


def pytest_collection_modifyitems(config, items):
    """Where the compiled kernel cannot be had (no compiler or ninja, ATTNSCALE_NO_KERNEL, a CPU
    without AVX2 and FMA), a test parametrized with ``backend="fused"`` is skipped with that reason:
    the backend refuses such calls by design. Where it can be had, those tests run, and a kernel
    that fails to build fails them (tests/test_kernels_build.py)."""
    import pytest

    from attnscale import kernels

    _mark_slow(items)
    reason = kernels.build_precondition()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"backend 'fused' needs the compiled kernel, which cannot be had here: {reason}")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("backend") == "fused":
            item.add_marker(skip)


def pytest_make_parametrize_id(config, val, argname):
    """Readable ids for torch dtypes ("bfloat16", not "dtype1"); pytest's own for the rest."""
    import torch

    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None


def _slow_tests() -> frozenset[str]:
    from pathlib import Path

    listed = Path(__file__).with_name("slow_tests.txt")
    lines = listed.read_text(encoding="utf-8").splitlines() if listed.is_file() else []
    return frozenset(line for line in lines if line and not line.startswith("#"))


def _mark_slow(items):
    """The tests listed in slow_tests.txt (measured: tests/update_slow_tests.py) get the ``slow``
    marker, so that ``make test-fast`` (``-m "not slow"``) leaves them out."""
    import pytest

    slow = _slow_tests()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
