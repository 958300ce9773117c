# Two entry points a newcomer needs: `make demo` and `make test` (lint, types, then the tests).
# Each creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch comes first, from the index pip is configured with, or from TORCH_INDEX when set: the PyTorch
# wheel index of your platform (its CPU build, or the CUDA version of your driver). pyproject.toml's
# range then installs no second torch.
TORCH_INDEX ?=
TORCH_PIP_ARGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

.PHONY: setup lint demo test setup-vllm test-vllm wheel-check clean

$(BIN)/moe-sbo: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/moe-sbo

demo: setup
	$(BIN)/moe-sbo demo --overlap all

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# Two test processes (pytest-xdist), each test taken by whichever is free: most tests wait on rank
# processes or subprocesses, so two keep a 2-core machine busy; more only contend.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

# The vLLM plugin's tests run vLLM 0.33.0's own classes on CPU, in an environment of their own: vLLM
# pins a CUDA torch 2.14 and GPU kernels, so it is installed with --no-deps after torch (held by a
# constraint at the CPU build above), moe-sbo, and only what vLLM's MoE modules import
# (tests/engines/vllm/requirements.txt, pinned). VLLM_SPEC may name a downloaded wheel instead.
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm==0.33.0

$(VLLM_VENV)/.ready: pyproject.toml tests/engines/vllm/requirements.txt
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	echo "torch==2.13.0" > $(VLLM_VENV)/torch-constraint.txt
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/torch-constraint.txt -e . -r tests/engines/vllm/requirements.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps $(VLLM_SPEC)
	touch $@

setup-vllm: $(VLLM_VENV)/.ready

test-vllm: setup-vllm
	$(VLLM_VENV)/bin/python -m pytest -q tests/engines/vllm

# A wheel of moe-sbo builds, installs into a clean venv (torch first, as above) and runs there.
wheel-check: setup
	rm -rf build/wheel-check dist
	$(BIN)/pip wheel -q --no-deps -w dist .
	$(PY) -m venv build/wheel-check
	build/wheel-check/bin/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	build/wheel-check/bin/pip install -q dist/moe_sbo-*.whl
	cd build && wheel-check/bin/python -c "import moe_sbo.cli.main, moe_sbo.dispatch, moe_sbo.planner; print('moe_sbo', moe_sbo.__version__, 'from', moe_sbo.__file__)"
	cd build && wheel-check/bin/moe-sbo plan > /dev/null && echo "wheel-check: moe-sbo plan ran from the wheel"

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache build dist
