# Bootstraps everything from a bare Python 3.11: `make test` and `make demo` create .venv,
# install torch==2.13.0 first (an unpinned torch pulls gigabytes of CUDA wheels), then
# `-e .[dev]` and the integration packages. A second run skips what is already installed.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
VERL_VERSION := 0.9.1
STAMP := $(VENV)/.sparsecorr-installed
INSTALL_INPUTS := pyproject.toml $(wildcard integrations/*/pyproject.toml) Makefile
PYTEST_ARGS ?=

.PHONY: venv test test-all test-gpu demo docs lint bench dist clean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python $(INSTALL_INPUTS)
	@$(BIN)/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
	  || $(BIN)/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet -e ".[dev,plot]"
	@# peers for the parity tests: TRL 1.16 (CPU-installable, a requirement of the TRL glue),
	@# OpenRLHF 0.11 and verl 0.9.1 without their GPU-only dependencies (the tests load their
	@# loss code through tests/openrlhf_shim.py and tests/verl_shim.py)
	$(BIN)/python -m pip install --quiet --no-deps "openrlhf>=0.11,<0.12" "verl==$(VERL_VERSION)"
	@# the glue distributions, editable; the TRL glue provides `sparsecorr demo` (entry point)
	$(BIN)/python -m pip install --quiet -e "integrations/trl[demo]" -e integrations/openrlhf -e "integrations/verl[cpu-test]"
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

# sdist + wheel of the three distributions into dist/ (what a release uploads)
dist: $(STAMP)
	rm -rf dist
	@for d in . integrations/trl integrations/openrlhf integrations/verl; do \
	  $(BIN)/python -m build --outdir dist $$d >/dev/null || exit 1; done
	@ls -1 dist

clean:
	rm -rf $(VENV) site build dist .pytest_cache .hypothesis
