"""What the tests of the compiled kernel's memory of answers share: the memory emptied around each
test (import ``_nothing_remembered`` into a test module: it is autouse there), and a count of the
calls of a function (the pipeline's validation, its planned route)."""

from __future__ import annotations

import pytest

from attnscale import kernels


@pytest.fixture(autouse=True)
def _nothing_remembered():
    kernel = kernels.load()
    if kernel is not None:
        kernel.forget_calls()
    yield
    if kernel is not None:
        kernel.forget_calls()


def counting(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """A list that gets one entry per call of ``module.name`` (replaced by a counting wrapper)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
