#!/usr/bin/env bash
# The CUDA checks in one run, for a machine with a CUDA GPU and a torch with FlexAttention already
# installed (no package registry needed): attnscale from src/ (PYTHONPATH, not installed), the
# compiled CPU kernel not built (ATTNSCALE_NO_KERNEL=1: CUDA tensors never use it), then
#   1. the CUDA tests of tests/test_cuda.py and tests/test_flex.py (JUnit XML and log in OUT),
#   2. with PROFILE set, benchmarks/profile_flex.py into OUT/profile.txt,
#   3. python benchmarks/bench_flex.py --quick (or BENCH_ARGS) --json OUT/flex_gpu.json, cut at BENCH_MINUTES.
#
#   OUT=/tmp/gpu BENCH_MINUTES=5 BENCH_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to a folder for the logs and the recording}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 ATTNSCALE_NO_KERNEL=1
PY="${PYTHON:-python3}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  "$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
  "$PY" -c 'import time; t = time.perf_counter(); import attnscale; from attnscale import flex; print("import attnscale", round(time.perf_counter() - t, 2), "s; flex available:", flex.available())'
} 2>&1 | tee "$OUT/env.txt"
start=$(date +%s)
# -p no:benchmark: pytest-benchmark, where installed, warns under xdist (an error with filterwarnings).
# -n: the tests' FlexAttention compilations in parallel worker processes (each compiles its own).
timeout "${TEST_SECONDS:-300}" "$PY" -m pytest -q -p no:cacheprovider -p no:benchmark -n "${TEST_WORKERS:-8}" -o addopts="" \
  --strict-markers --import-mode=importlib -rfEs --junitxml="$OUT/junit.xml" \
  tests/test_cuda.py tests/test_flex.py -k cuda 2>&1 | tee "$OUT/tests.log"
echo "tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/tests.log"
if [ -n "${PROFILE:-}" ]; then  # where a flex call's time goes (benchmarks/profile_flex.py)
  timeout 120 "$PY" benchmarks/profile_flex.py > "$OUT/profile.txt" 2>&1; echo "profile: exit $?"
fi
start=$(date +%s)
"$PY" benchmarks/bench_flex.py ${BENCH_ARGS:---quick} --max-minutes "${BENCH_MINUTES:-5}" --json "$OUT/flex_gpu.json" 2>&1 | tee "$OUT/bench.log"
echo "bench: exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
