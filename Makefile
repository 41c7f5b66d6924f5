# The two commands a newcomer needs: `make test` and `make demo`.
# Both create the virtual environment from pyproject.toml when it is missing or stale.
# `make test` first runs `make lint` (ruff and pyright on jaxmp/, both pinned in the dev
# extra); any finding fails it.
# `make docs` builds the documentation site (Sphinx, docs/ -> docs/_build/html) with the
# docs extra; warnings and broken cross-references fail it.
# `make test-min` runs the fast tests on the oldest releases pyproject.toml allows: it
# builds .venv-min with each runtime dependency pinned at its `>=` bound
# (.ci/lower_bounds.py reads them from pyproject.toml, the one place they are written).
# `make gpu-report` estimates H100 (and TPU) performance without the hardware: it builds
# .venv-cuda beside .venv (jax[cuda12,tpu] at .venv's jax version, 6.5 GB) on first use.
# `make gpu-session` is the prepared run on a machine with a GPU (9 minutes: the GPU's
# tests, the measured tables, the kernel benchmarks; CONTRIBUTING.md).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

CUDA_VENV  ?= .venv-cuda
CUDA_PY    := $(CUDA_VENV)/bin/python
CUDA_STAMP := $(CUDA_VENV)/.installed

MIN_VENV  ?= .venv-min
MIN_PY    := $(MIN_VENV)/bin/python
MIN_STAMP := $(MIN_VENV)/.installed

.PHONY: test test-fast test-min golden lint demo env gpu-report gpu-session test-gpu-arithmetic clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,examples]'
	touch $(STAMP)

env: $(STAMP)

# pyright is given the venv's interpreter so that it reads the installed jax, flax, optax,
# and this pyproject.toml (a pyrightconfig.json in a parent folder would otherwise win).
lint: $(STAMP)
	$(VENV)/bin/ruff check jaxmp
	$(VENV)/bin/pyright --warnings --project pyproject.toml --pythonpath $(PY)

# The whole suite, spread over the machine's cores (pytest-xdist; -n auto starts one worker
# per core). --dist loadfile keeps each test file on one worker, so a module's shared fixture
# (a compiled model, an 8-device subprocess) runs once.
test: lint
	$(PY) -m pytest -n auto --dist loadfile

# The inner loop: everything but the tests marked slow (end-to-end runs of examples,
# benchmarks and published models), in parallel. Most of a test's time is XLA compiling
# its steps, so the inner loop keeps JAX's persistent compilation cache in .jax_cache/
# (every compile, however short): a second run compiles only what changed. `make test`
# (CI) runs without it, every compile fresh.
JAX_CACHE := JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax_cache \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0

test-fast: $(STAMP)
	$(JAX_CACHE) $(PY) -m pytest -m "not slow" -n auto --dist loadfile

# The lower bounds, pinned, beside the newest dev tools that install with them. The fast
# tests but the golden ones (jaxprs as the newest JAX and Flax print them); no persistent
# compilation cache, as `make test`.
$(MIN_STAMP): pyproject.toml .ci/lower_bounds.py
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_PY) -m pip install --quiet --upgrade pip
	$(PYTHON) .ci/lower_bounds.py > $(MIN_VENV)/lower-bounds.txt
	$(MIN_PY) -m pip install --quiet -r $(MIN_VENV)/lower-bounds.txt -e '.[dev]'
	touch $(MIN_STAMP)

test-min: $(MIN_STAMP)
	@echo "make test-min: the fast tests on $$(tr '\n' ' ' < $(MIN_VENV)/lower-bounds.txt)"
	$(MIN_PY) -m pytest -m "not slow and not golden" -n auto --dist loadfile

# Rewrites tests/golden/ from the current code with the installed JAX and Flax (their
# first line names the versions; the test fails when they are not the installed ones).
golden: $(STAMP)
	PYTHONPATH=. $(PY) tests/nonfinite_golden.py --write

demo: $(STAMP)
	$(PY) examples/train_lm.py

# The docs extra goes into the same environment (autodoc imports jaxmp, jax and flax).
# -E rereads every page and docstring, so a rebuild reports every warning again.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

.PHONY: docs
docs: $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -E -W --keep-going -n -b html docs docs/_build/html

# The CUDA and TPU plugins compile for chips that are not here (no GPU needed); one
# environment holds both (they do not conflict), with jaxmp installed editable.
$(CUDA_STAMP): pyproject.toml $(STAMP)
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_PY) -m pip install --quiet --upgrade pip
	$(CUDA_PY) -m pip install --quiet "jax[cuda12,tpu]==$$($(PY) -c 'import jax; print(jax.__version__)')" -e '.[dev,examples]'
	touch $(CUDA_STAMP)

gpu-report: $(CUDA_STAMP)
	$(CUDA_PY) benchmarks/gpu_report.py

# On a machine with a GPU: benchmarks/gpu_session.sh with .venv's Python if there is one
# (a project checkout with jax[cuda]), else python3 (a GPU machine's own image, which
# has no internet to build .venv from). Results: benchmarks/results/gpu-session-*.
gpu-session:
	JAXMP_PYTHON=$(if $(wildcard $(PY)),$(PY),python3) benchmarks/gpu_session.sh

# The GPU session's tests on this CPU, with float32 rounded as GPUs round it
# (tests/gpu_arithmetic.py: FMA, division in two roundings, TF32 GEMMs): a test that
# fails here and not in `make test` assumes the CPU's arithmetic.
test-gpu-arithmetic: $(STAMP)
	$(JAX_CACHE) $(PY) -m pytest -p tests.gpu_arithmetic -m "not slow" -n auto --dist loadfile \
		$$($(PY) benchmarks/gpu_session.py --list-tests)

clean:
	rm -rf $(VENV) $(MIN_VENV) .pytest_cache .jax_cache build *.egg-info docs/_build
