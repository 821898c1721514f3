"""Write tests/slow_tests.txt from a run's durations: every test whose setup, call and teardown
took SECONDS or more (default 0.25) on that run. ``make test-fast`` leaves them out (they get the
``slow`` marker in conftest.py); ``make test`` runs everything.

    .venv/bin/python -m pytest -q -n auto --maxprocesses=4 --durations=0 > durations.log
    .venv/bin/python tests/update_slow_tests.py durations.log [SECONDS]

A fixture's setup is counted against the first test that uses it: after leaving that test out,
a run of ``-m "not slow" --durations=0`` finds the next one; pass both logs (joined) to list both.
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

LIST = Path(__file__).with_name("slow_tests.txt")


def slow_tests(log: str, seconds: float = 0.25) -> list[str]:
    """Node ids of the tests that took at least ``seconds`` in a ``--durations=0`` log."""
    spent: collections.Counter[str] = collections.Counter()
    for line in log.splitlines():
        found = re.match(r"([\d.]+)s (?:call|setup|teardown)\s+(\S+::.+)$", line.strip())  # ids may hold spaces
        if found:
            spent[found.group(2)] += float(found.group(1))
    return sorted(node for node, total in spent.items() if total >= seconds)


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    seconds = float(argv[1]) if len(argv) == 2 else 0.25
    nodes = slow_tests(Path(argv[0]).read_text(encoding="utf-8"), seconds)
    header = f"# Tests that took {seconds} s or more (tests/update_slow_tests.py); make test-fast leaves them out.\n"
    LIST.write_text(header + "".join(f"{node}\n" for node in nodes), encoding="utf-8")
    print(f"{len(nodes)} slow tests written to {LIST}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
