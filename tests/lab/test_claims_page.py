"""docs/claims.md is the lab's list of claims: every experiment's exact statement and every source
it cites are in its claim's section there, and no source names a document the reader does not have."""

import re
from pathlib import Path

import pytest

from attnscale.lab import registry

PAGE = Path(__file__).resolve().parents[2] / "docs" / "claims.md"


def _sections() -> dict[str, str]:
    parts = re.split(r"^## ", PAGE.read_text(encoding="utf-8"), flags=re.M)
    return {part.split("\n", 1)[0].strip(): part for part in parts[1:]}


def _flat(text: str) -> str:
    return " ".join(text.split())  # the page wraps lines


def test_every_claim_of_the_lab_has_a_section():
    assert set(registry.CLAIM_IDS) <= set(_sections())


@pytest.mark.parametrize("exp", registry.discover().experiments, ids=lambda e: e.id)
def test_the_experiment_states_and_cites_what_its_section_says(exp):
    section = _flat(_sections()[exp.id])
    assert f"**Statement.** {exp.claim.statement}" in section
    assert exp.claim.sources, f"{exp.id} cites no source"
    for source in exp.claim.sources:
        assert f"- {source}" in section, f"{exp.id}: source {source!r} is not listed in docs/claims.md#{exp.id}"
        assert not re.search(r"\bseeds?\b", source), source
    module = exp.module_name.replace(".", "/").removeprefix("attnscale/")
    assert f"`attnscale/{module}.py`" in section
