"""``python -m attnscale.kernels``: build the fused CPU kernel now (``make`` runs this at install).

Exits 0 when the kernel is ready, or when it cannot be had on this machine (no compiler, a CPU
without AVX2, ``ATTNSCALE_NO_KERNEL``: attnscale then runs its eager tiled kernel); exits 1 when
it could be built and the build failed, or, with ``--check``, whenever it is unavailable.
"""

import sys

from . import build, build_precondition, library_path


def main() -> int:
    try:
        build(verbose="-v" in sys.argv[1:])
    except Exception as exc:  # a compiler's failure comes as several exception types
        precondition = build_precondition()
        if precondition is None:
            print(f"attnscale: the fused CPU kernel failed to build: {exc}", file=sys.stderr)
            return 1
        print(f"attnscale's fused CPU kernel is unavailable: {precondition}; attnscale will use its eager tiled kernel", file=sys.stderr)
        return 0 if "--check" not in sys.argv[1:] else 1
    print(f"attnscale: fused CPU kernel ready ({library_path()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
