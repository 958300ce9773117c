# Two entry points a newcomer needs: `make demo` and `make test` (lint, types, then the tests).
# Each creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup lint demo test clean

$(BIN)/moe-sbo: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch first, so the range in pyproject.toml installs nothing more (no CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/moe-sbo

demo: setup
	$(BIN)/moe-sbo demo --overlap all

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
