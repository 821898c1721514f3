"""Building and loading the compiled kernel: a failed build is a failure wherever the kernel can be
had, builds are shared across environments, and a killed build blocks nobody."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnscale import kernels

PRECONDITION = kernels.build_precondition()
needs_a_compiler = pytest.mark.skipif(PRECONDITION is not None, reason=f"the compiled kernel cannot be had here: {PRECONDITION}")


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env}, cwd="/"
    )


@needs_a_compiler
def test_the_kernel_builds_wherever_it_can_be_had():
    assert kernels.available(), f"the kernel failed to build: {kernels.unavailable_reason()}"
    assert kernels.library_path().is_file()


def test_where_the_kernel_cannot_be_had_the_reason_is_the_precondition():
    done = python(
        "from attnscale import kernels; print(kernels.build_precondition()); print(kernels.available(), kernels.unavailable_reason())",
        ATTNSCALE_NO_KERNEL="1",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["disabled by ATTNSCALE_NO_KERNEL", "False attnscale's fused CPU kernel is unavailable: disabled by ATTNSCALE_NO_KERNEL"]
    cli = subprocess.run([sys.executable, "-m", "attnscale.kernels"], capture_output=True, text=True, env={**os.environ, "ATTNSCALE_NO_KERNEL": "1"})
    assert cli.returncode == 0 and "disabled by ATTNSCALE_NO_KERNEL" in cli.stderr


@needs_a_compiler
def test_a_build_that_fails_exits_1_and_names_the_failure(tmp_path):
    # A compiler that always fails: the precondition holds (one is on PATH), so the failure is a bug.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "c++").write_text("#!/bin/sh\necho 'fake compiler: refused' >&2\nexit 1\n")
    (fake / "c++").chmod(0o755)
    env = {**os.environ, "ATTNSCALE_KERNEL_DIR": str(tmp_path / "kernels"), "CXX": str(fake / "c++")}
    cli = subprocess.run([sys.executable, "-m", "attnscale.kernels"], capture_output=True, text=True, env=env, timeout=300)
    assert cli.returncode == 1, cli.stderr
    assert "the fused CPU kernel failed to build" in cli.stderr
    assert not list((tmp_path / "kernels").glob("*/build-*")), "the failed build left its folder behind"


@needs_a_compiler
def test_a_built_kernel_loads_in_any_environment_without_a_compiler():
    """The build's name hashes source, torch, Python and flags, never a path: another environment
    (here: another working directory and no compiler at all) loads the same library, no rebuild."""
    assert kernels.available()
    done = python(
        "from attnscale import kernels; print(kernels.available(), kernels.library_path())",
        CXX="/nonexistent/c++",
        PATH="/nonexistent",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", str(kernels.library_path())]
    assert "building" not in done.stderr


# The build machinery on a small extension of its own (a few seconds to compile, where the kernel
# takes about a minute): build() with its source and headers pointed elsewhere.
_BUILD_SMALL = """
import sys
from pathlib import Path
from attnscale import kernels
kernels._SOURCE, kernels._HEADERS = Path(sys.argv[1]), Path(sys.argv[2])
print(kernels.build().one())
"""


def _compiling(source: Path) -> bool:
    """Whether a compiler process is compiling ``source`` now."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if str(source).encode() in words and b"-c" in words and b"-o" in words:  # c++ ... -c SOURCE -o OBJECT
            return True
    return False


@pytest.mark.slow
@needs_a_compiler
def test_a_killed_build_leaves_nothing_that_blocks_the_next_one(tmp_path):
    """A builder killed mid-build (SIGKILL while its compiler runs, as an interrupted job may be)
    leaves its folder; the next build neither waits on it nor trips over it, and removes it."""
    source, headers = tmp_path / "small.cpp", tmp_path / "csrc"
    source.write_text("#include <pybind11/pybind11.h>\nint one() { return 1; }\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"one\", &one); }\n")
    headers.mkdir()
    kernels_dir = tmp_path / "kernels"
    env = {**os.environ, "ATTNSCALE_KERNEL_DIR": str(kernels_dir)}
    command = [sys.executable, "-c", _BUILD_SMALL, str(source), str(headers)]
    first = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not _compiling(source) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, "the first build ended before its compiler was seen"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    (stale,) = kernels_dir.glob("*/build-*")
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout.split() == ["1"], second.stderr
    (library,) = kernels_dir.glob("*/*.so")
    assert library.parent == stale.parent
    assert not Path(stale).exists() and not list(kernels_dir.glob("*/build-*"))


@pytest.mark.slow
@needs_a_compiler
@pytest.mark.skipif(kernels.isa() not in ("avx512", "avx512_bf16"), reason="no AVX-512 on this CPU: only the AVX2 kernel can run here, and the suite runs it")
def test_the_avx2_kernel_passes_the_kernel_tests_on_an_avx512_cpu():
    """The suite runs the widest build (AVX-512 here); this runs the AVX2 build's tests too, in
    its own process and build, so that both ISAs' paths are tested where the CPU has both."""
    env = {**os.environ, "ATTNSCALE_KERNEL_ISA": "avx2"}
    root = Path(__file__).resolve().parent.parent
    which = subprocess.run([sys.executable, "-c", "from attnscale import kernels; print(kernels.isa(), kernels.available())"],
                           capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert which.stdout.split() == ["avx2", "True"], which.stderr[-2000:]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_fused.py", "tests/test_hostile.py", "tests/test_quantized_kernel.py"],
        capture_output=True, text=True, env=env, cwd=root, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:]


_BF16_OUTPUTS = """
import sys, torch, attnscale
from attnscale import kernels
assert kernels.available(), kernels.unavailable_reason()
torch.manual_seed(0)
out = [kernels.isa()]
# (L, S, D, causal, softcap, statistics, query heads per key head): rows on static offsets and rows that
# do not, tails shorter than a vector pair, several key tiles, statistics, grouped heads.
for L, S, D, causal, cap, stats, group in [(300, 301, 64, True, 30.0, False, 1), (1030, 1030, 128, True, None, False, 1),
                                          (64, 2100, 64, False, None, True, 1), (520, 1200, 32, True, 50.0, False, 2),
                                          (33, 700, 64, False, 5.0, True, 1)]:
    q = torch.randn(2, 2 * group, L, D).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 2, S, D).bfloat16().requires_grad_() for _ in range(2))
    got = attnscale.scaled_dot_product_attention(q, k, v, backend="fused", is_causal=causal, softcap=cap,
                                                 return_stats=stats, enable_gqa=group > 1)
    o, st = (got, None) if torch.is_tensor(got) else got
    out.append(o.detach())
    if st is not None:
        out += [t for t in vars(st).values() if torch.is_tensor(t)]
    out += list(torch.autograd.grad(o.float().square().sum(), (q, k, v)))
torch.save(out, sys.argv[1])
"""


def _outputs_that_differ_between_the_avx512_builds(tmp_path, script: str) -> list[int]:
    """Runs ``script`` (which saves [isa, tensor, ...] to argv[1]) under the avx512_bf16 build and
    the plain avx512 one, each in its own process: the indices of the tensors that differ."""
    import torch

    results = {}
    for isa in ("avx512_bf16", "avx512"):
        path = tmp_path / f"{isa}.pt"
        done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                              env={**os.environ, "ATTNSCALE_KERNEL_ISA": isa}, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results[isa] = torch.load(path)
    wide, plain = results["avx512_bf16"], results["avx512"]
    assert (wide[0], plain[0]) == ("avx512_bf16", "avx512") and len(wide) == len(plain) > 20
    return [i for i, (a, b) in enumerate(zip(wide[1:], plain[1:])) if not torch.equal(a, b)]


@pytest.mark.slow
@needs_a_compiler
@pytest.mark.skipif(kernels.isa() != "avx512_bf16", reason="no AVX512-BF16 on this CPU: the build with its conversion cannot run here")
def test_the_cpus_bfloat16_conversion_gives_atens_bits(tmp_path):
    """Built for AVX512-BF16, the kernel rounds bfloat16 softmax weights with the CPU's own
    instruction; built for plain AVX-512 (ATTNSCALE_KERNEL_ISA=avx512), with ATen's vectors. Every
    output, statistic and gradient must agree bit for bit (each build in its own process)."""
    assert _outputs_that_differ_between_the_avx512_builds(tmp_path, _BF16_OUTPUTS) == []


_INT8_OUTPUTS = """
import sys, torch, attnscale
from attnscale import kernels
assert kernels.available(), kernels.unavailable_reason()
gen = torch.Generator().manual_seed(0)
out = [kernels.isa()]
run = kernels.load().forward_int8
base = dict(scale=0.08, softcap=0.0, causal=False, q_offset=0, left=-1, right=-1, q_start=0, k_start=0, with_stats=False,
            block_q=256, block_k=256, half_products=False, round_out=False)
# (L, S, D, group, options): decoding steps of 8 query heads over 2 key heads, a bfloat16 query's values in float32,
# q.k in integers (q_int16); several key tiles, a tail of keys, groups of 32 and 64, statistics, softcap, a window.
for L, S, D, group, extra in [(1, 700, 128, 64, {}), (1, 300, 64, 32, dict(softcap=5.0, with_stats=True)),
                              (3, 513, 64, 64, dict(causal=True, q_offset=510, left=40, right=0)), (2, 33, 96, 32, dict(with_stats=True))]:
    q = torch.randn(2, 8, L, D, generator=gen).bfloat16().float()
    k = torch.randn(2, 2, S, D, generator=gen) + 2.0 * torch.randn(1, 1, 1, D, generator=gen)
    kv = attnscale.quantize_kv(k, torch.randn(2, 2, S, 48, generator=gen), group=group)
    got = run(q, kv.k, kv.k_scale, kv.k_mean, kv.v, kv.v_scale, None, None, q_int16=True, **{**base, **extra})
    out += [t for t in got if t.numel()]
torch.save(out, sys.argv[1])
"""


@pytest.mark.slow
@needs_a_compiler
@pytest.mark.skipif(kernels.isa() != "avx512_bf16", reason="no AVX512-VNNI on this CPU (the avx512_bf16 build has it): only one of the two builds can run here")
def test_int8_decodings_integer_products_give_the_same_bits_with_and_without_vnni(tmp_path):
    """Built for avx512_bf16 (with AVX512-VNNI), int8 decoding's q.k products take vpdpwssd; built
    for plain AVX-512, vpmaddwd and an add. The integers are the same, so every output and
    statistic must agree bit for bit (each build in its own process)."""
    assert _outputs_that_differ_between_the_avx512_builds(tmp_path, _INT8_OUTPUTS) == []


@pytest.mark.parametrize(
    "value, disabled",
    [("", False), ("0", False), ("false", False), ("No", False), ("off", False), ("1", True), ("true", True), ("YES", True), ("maybe", True)],
)
def test_the_switch_reads_words_as_people_write_them(monkeypatch, value, disabled):
    """ATTNSCALE_NO_KERNEL=false turned the kernel off (any value but "" or "0" did); a value that
    is neither yes nor no says so in the reason."""
    monkeypatch.setenv("ATTNSCALE_NO_KERNEL", value)
    reason = kernels._disabled()
    assert (reason is not None) == disabled
    if value == "maybe":
        assert reason.startswith("ATTNSCALE_NO_KERNEL='maybe': expected 1/true/yes/on")


def test_the_builds_name_follows_every_source_file(tmp_path, monkeypatch):
    """A change to any of the kernel's files (the binding or a header it includes) gives the build
    a new name, so a stale library is never loaded for new source."""
    sources = tmp_path / "csrc"
    sources.mkdir()
    for header in kernels._HEADERS.glob("*.h"):
        (sources / header.name).write_bytes(header.read_bytes())
    monkeypatch.setattr(kernels, "_HEADERS", sources)
    flags = ["-O3"]
    before = kernels._name(flags)
    assert before == kernels._name(flags)
    header = sources / "rows.h"
    header.write_text(header.read_text() + "\n// an edit\n")
    assert kernels._name(flags) != before
