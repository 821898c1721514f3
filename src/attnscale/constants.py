"""The numbers attnscale's two kernels share, defined once.

The tiled kernel (:mod:`attnscale.tiled`, the executable specification of the algorithm) reads
them as Python values; the compiled kernel (``attnscale/kernels/fused.cpp``) as macros its build
defines from this module (:func:`cpp_defines`; the build's name hashes them, so a change rebuilds
it). ``tests/test_fused.py`` holds the two kernels' weights equal, entry by entry, on small tiles.

* ``EXP_FLOOR``: no softmax weight is taken below ``exp(floor)`` times its row's offset's weight.
  ATen's vectorised exp runs some 50x slower for results below the normal range, and a matmul
  some 90x slower for products there (``bench_tiled.py --op-probe``), while such a weight is far
  below the precision of its row's sum next to the offset's ``exp(0) = 1``. The tiled kernel
  raises arguments below the floor to it (weight ``exp(-69) = 1.0e-30`` in float32; hidden keys
  are set back to exactly 0 after); the compiled kernel sets those weights to 0 (one blend in the
  same vector pass).
* ``OFFSET_LIMIT``: a row whose logits are bounded, ``|s_ij| <= u_i``, may subtract a static offset
  instead of a running max once no weight against it can overflow or fall below the floor:
  ``-floor / 2`` (34.5 in float32, 345 in float64). The tiled kernel takes offset 0 or ``u_i`` for
  a whole query block whose bounds are within the limit; the compiled kernel takes the row's
  running max as its static offset once that comes within the limit of ``u_i``.
"""

from __future__ import annotations

import torch

__all__ = ["EXP_FLOOR", "OFFSET_LIMIT", "cpp_defines"]

EXP_FLOOR: dict[torch.dtype, float] = {torch.float32: -69.0, torch.float64: -690.0}
"""The exp floor per accumulation dtype (16-bit inputs accumulate in float32)."""

OFFSET_LIMIT: dict[torch.dtype, float] = {dtype: -floor / 2 for dtype, floor in EXP_FLOOR.items()}
"""How far below a row's bound a static offset may lie: ``-floor / 2``."""


def cpp_defines() -> list[str]:
    """The compiled kernel's build flags that define these numbers (read in ``csrc/vector_math.h``)."""
    return [f"-DATTNSCALE_EXP_FLOOR_F32={EXP_FLOOR[torch.float32]!r}", f"-DATTNSCALE_EXP_FLOOR_F64={EXP_FLOOR[torch.float64]!r}"]
