# The two commands a newcomer needs: `make test` and `make demo`.
# Both create the virtual environment from pyproject.toml when it is missing or stale.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo env clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,examples]'
	touch $(STAMP)

env: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) examples/train_lm.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
