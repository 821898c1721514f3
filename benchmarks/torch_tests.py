"""PyTorch's own SDPA tests, run on torch and again with torch's function replaced by attnscale's.

    python benchmarks/torch_tests.py PATH/test_transformers.py [-k EXPR]

PATH is a copy of PyTorch's test/test_transformers.py (not shipped with torch's wheel, nor with
attnscale: take it from the PyTorch source of the installed version). It runs twice in pytest
(CPU tests only; torch's test helpers need ``pip install expecttest``): as it is, then under
:func:`attnscale.patch_torch` (applied before the file is imported, so its own
``from torch.nn.functional import scaled_dot_product_attention`` sees attnscale's). It prints every
test that passes on torch and fails through attnscale, each with the documented difference that
explains it or "UNEXPLAINED", and the tests that fail on torch and pass through attnscale. Exit
status 1 when a pass-to-fail test has no documented reason (docs/semantics.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

# Tests that fail through attnscale by design, matched on their names: docs/semantics.md says why.
DOCUMENTED = {
    r"causal_attn_mask": "an explicit attn_mask with is_causal=True applies both (torch's math kernel raises)",
    r"test_disable_fastpath|test_mask_check_fastpath": "torch's MHA fast path is off while patched, so that its attention runs through attnscale",
}

PLUGIN = "import attnscale\n\ndef pytest_configure(config):\n    attnscale.patch_torch()\n"


def outcomes(test_file: Path, patched: bool, select: str | None) -> dict[str, str]:
    """{test id: "passed" | "failed" | "skipped"} of one pytest run of ``test_file``."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        env = dict(os.environ)
        plugin: list[str] = []
        if patched:
            (Path(scratch) / "attnscale_patch_plugin.py").write_text(PLUGIN)
            plugin = ["-p", "attnscale_patch_plugin"]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [scratch, env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "pytest", "-q", *plugin, "-p", "no:cacheprovider", str(test_file), f"--junitxml={report}",
                   "-k", f"cpu and ({select})" if select else "cpu"]  # fmt: skip
        subprocess.run(command, cwd=test_file.parent, env=env, stdout=subprocess.DEVNULL, check=False)
        if not report.exists():
            raise SystemExit(f"pytest wrote no report for {test_file} (patched={patched}): run it by hand to see why")
        results = {}
        for case in ET.parse(report).iter("testcase"):
            kinds = {child.tag for child in case}
            state = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
            results[f"{case.get('classname')}::{case.get('name')}"] = state
        return results


def reason(test: str) -> str:
    return next((why for pattern, why in DOCUMENTED.items() if re.search(pattern, test)), "UNEXPLAINED")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, help="a copy of PyTorch's test/test_transformers.py")
    parser.add_argument("-k", dest="select", help="pytest -k expression: run only the tests it selects")
    args = parser.parse_args(argv)
    if not args.test_file.is_file():
        parser.error(f"test_file: expected PyTorch's test/test_transformers.py, got {str(args.test_file)!r}, which is no file")
    torch_runs = outcomes(args.test_file.resolve(), False, args.select)
    ours = outcomes(args.test_file.resolve(), True, args.select)
    broke = sorted(t for t, s in torch_runs.items() if s == "passed" and ours.get(t) != "passed")
    fixed = sorted(t for t, s in torch_runs.items() if s == "failed" and ours.get(t) == "passed")
    count = lambda runs, state: sum(s == state for s in runs.values())  # noqa: E731
    for name, runs in (("torch", torch_runs), ("patched", ours)):
        print(f"{name:8s}: {count(runs, 'passed')} passed, {count(runs, 'failed')} failed, {count(runs, 'skipped')} skipped")
    print(f"pass on torch, fail through attnscale: {len(broke)}")
    for test in broke:
        print(f"  {test}: {reason(test)}")
    print(f"fail on torch, pass through attnscale: {len(fixed)}")
    for test in fixed:
        print(f"  {test}")
    return 1 if any(reason(t) == "UNEXPLAINED" for t in broke) else 0


if __name__ == "__main__":
    sys.exit(main())
