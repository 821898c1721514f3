"""``python -m attnscale``: the same command line as ``attnscale``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
