"""``python -m attnscale.kernels``: build the fused CPU kernel now (``make`` runs this at install)."""

import sys

from . import build, kernel_dir


def main() -> int:
    try:
        module = build(verbose="-v" in sys.argv[1:])
    except RuntimeError as exc:
        print(f"{exc}; attnscale will use its eager tiled kernel", file=sys.stderr)
        return 0 if "--check" not in sys.argv[1:] else 1
    print(f"attnscale: fused CPU kernel ready ({module.__file__}, under {kernel_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
