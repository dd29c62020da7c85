# Bootstraps everything from a bare Python 3.11: `make test` and `make demo` create .venv,
# install torch==2.13.0 first (an unpinned torch pulls gigabytes of CUDA wheels), then
# `-e .[dev]` and the integration packages. A second run skips what is already installed.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.sparsecorr-installed
INSTALL_INPUTS := pyproject.toml $(wildcard integrations/*/pyproject.toml) Makefile
PYTEST_ARGS ?=

.PHONY: venv test test-all test-gpu demo docs lint bench clean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python $(INSTALL_INPUTS)
	@$(BIN)/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
	  || $(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet -e ".[dev,plot]"
	@# peers for the parity tests: TRL 1.16 (CPU-installable), OpenRLHF 0.11 without its
	@# GPU-only dependencies (tests load its loss through tests/openrlhf_shim.py)
	$(BIN)/python -m pip install --quiet "trl>=1.16,<1.17"
	$(BIN)/python -m pip install --quiet --no-deps "openrlhf>=0.11,<0.12"
	@if [ -f integrations/trl/pyproject.toml ]; then \
	  $(BIN)/python -m pip install --quiet -e "integrations/trl[trl]"; fi
	@if [ -f integrations/openrlhf/pyproject.toml ]; then \
	  $(BIN)/python -m pip install --quiet -e integrations/openrlhf; fi
	@$(BIN)/python -c "import torch; assert torch.__version__.startswith('$(TORCH_VERSION)'), torch.__version__"
	@touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/sparsecorr demo $(DEMO_ARGS)

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	@for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) site build .pytest_cache .hypothesis
