# Two entry points a newcomer needs: `make demo` and `make test`. Each creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test clean

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

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
