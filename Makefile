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

.PHONY: setup lint demo test setup-vllm test-vllm test-sglang wheel-check clean

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

# SGLang's plugin (src/moe_sbo/engines/sglang) tested through SGLang's own code on gloo CPU ranks, in
# its own venv: SGLang 0.5.23 pins torch 2.14.1 and CUDA-only packages, so its wheel goes in without
# its dependencies, beside the CPU torch above and exactly what its imports need (pinned; SGLang's own
# pins where it has them). torchvision is PyPI's (a CUDA build): tests/engines/sglang/sglang_runtime.py
# says how it imports on a CPU torch.
SGLANG_VENV ?= .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
SGLANG_IMPORTS := sglang==0.5.23 torchvision==0.28.0 transformers==5.19.0 tokenizers==0.23.2 \
	huggingface_hub==1.33.0 safetensors==0.8.0 hf-xet==1.8.0 regex==2026.12.2 pyyaml==6.0.4 tqdm==4.70.1 \
	packaging==26.4 numpy==2.4.6 triton==3.9.0 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 \
	sentencepiece==0.2.1 openai==2.8.0 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 \
	urllib3==2.8.0 idna==3.21 certifi==2026.10.19.post1 pillow==13.0.0 starlette==1.10.0 anyio==4.16.0 \
	sniffio==1.3.1 distro==1.9.0 msgspec==0.23.0 pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 \
	annotated-types==0.8.0 pyzmq==27.3.0 ipython==9.19.1 traitlets==5.16.1 aiohttp==3.14.5 \
	aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 \
	propcache==0.5.4 httpx==0.29.0 httpcore==1.0.9 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 \
	truststore==0.10.5 dill==0.4.1 einops==0.8.2 loguru==0.7.3 gguf==0.19.0 partial-json-parser==0.2.1.1.post7 \
	rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0

$(SGLANG_BIN)/.ready: pyproject.toml Makefile
	rm -rf $(SGLANG_VENV)
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/pip install -q --upgrade pip
	$(SGLANG_BIN)/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(SGLANG_BIN)/pip install -q --no-deps $(SGLANG_IMPORTS)
	$(SGLANG_BIN)/pip install -q --no-deps -e .
	touch $@

test-sglang: $(SGLANG_BIN)/.ready
	$(SGLANG_BIN)/python -m pytest -q -p no:xdist tests/engines/sglang

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
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .pytest_cache build dist
