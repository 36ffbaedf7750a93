# Every target creates the local virtualenv (.venv) and installs what it needs on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEV    := $(VENV)/.installed-dev

.PHONY: demo test lint format bench clean

$(DEV): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

## demo: run the example agent with compaction and show its releases and spans
demo: $(DEV)
	$(PY) examples/compaction_agent.py

## test: lint, then the whole test suite
test: $(DEV) lint
	$(PY) -m pytest

lint: $(DEV)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(DEV)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

## bench: client-side benchmarks (results in benchmarks/results/)
bench: $(DEV)
	$(PY) benchmarks/hook_overhead.py
	$(PY) benchmarks/session_memory.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
