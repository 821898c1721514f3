"""The README's examples run as written."""

import doctest
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run():
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


def test_readme_stays_under_250_lines():
    """A newcomer's page: the set-up, a taste of each part and links; the detail lives in docs/."""
    assert len(README.read_text().splitlines()) < 250
