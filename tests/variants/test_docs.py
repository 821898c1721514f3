import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "variants.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_every_module_is_in_the_table():
    text = DOC.read_text()
    for name in ("rope.py", "qknorm.py", "temperature.py", "length.py", "linear.py", "performer.py", "quant.py", "softcap", "ALiBi"):
        assert name in text


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_examples_run(code):
    exec(compile(code, str(DOC), "exec"), {})
