"""docs/variants.md's accuracy numbers for FAVOR+ and INT8 are what examples/variant_errors.py prints."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_tables_are_what_the_script_prints(capsys):
    spec = importlib.util.spec_from_file_location("variant_errors", ROOT / "examples" / "variant_errors.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([]) == 0
    printed = capsys.readouterr().out
    doc = (ROOT / "docs" / "variants.md").read_text(encoding="utf-8")
    rows = [line for line in printed.splitlines() if line.startswith("| ") and not line.startswith("| features")]
    assert len(rows) == 6  # three FAVOR+ rows, the INT8 header and two rows
    missing = [row for row in rows if row not in doc]
    assert not missing, "docs/variants.md differs from `python examples/variant_errors.py`:\n" + "\n".join(missing)
    unit = re.search(r"m = 2048: (\S+)\n", printed).group(1)
    assert f"the relative error is\nstill {unit} at m = 2048" in doc
    plain, smoothed = re.search(r"mean error (\S+) without smoothing, (\S+) with it", printed).groups()
    assert f"smoothing cuts the mean error from {plain} to {smoothed}." in doc
