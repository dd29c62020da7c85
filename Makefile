# Bootstraps everything from a bare Python 3.11: `make test` and `make demo` create .venv with
# exactly the versions in requirements.lock (torch==2.13.0 CPU first: an unpinned torch pulls
# gigabytes of CUDA wheels), then the three distributions in editable mode. A second run
# changes nothing. `make lock` re-resolves the lock from the ranges in the pyproject files.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PIP_VERSION := 26.3
TORCH_VERSION := 2.13.0
# peers of the parity tests, installed without their GPU-only dependencies (the tests load their
# loss code through tests/openrlhf_shim.py and tests/verl_shim.py)
PEERS := openrlhf>=0.11,<0.12 verl==0.9.1
# the glue distributions, editable (verl's [cpu-test] extra: the light packages its CPU tests need
# to load verl's real DataProto / ActorConfig next to the --no-deps verl)
GLUE := integrations/trl integrations/openrlhf integrations/verl[cpu-test]
# the tested transformers range: its ends are tested by `make test-edges` (the same range is in
# pyproject.toml and src/sparsecorr/decoding/hf.py; tests/unit/test_versions.py checks they agree)
TRANSFORMERS_RANGE := >=5.15,<6
TRANSFORMERS_LOWEST := 5.15.0
export PYTHON PIP_VERSION TORCH_VERSION PEERS GLUE
STAMP := $(VENV)/.sparsecorr-installed
INSTALL_INPUTS := requirements.lock pyproject.toml $(wildcard integrations/*/pyproject.toml) \
  scripts/lock.sh Makefile
PYTEST_ARGS ?=
# what the range tests run: the decoding engine, and (newest only) the TRL sparse rollouts + demo
EDGE_DECODING := tests/unit/decoding tests/property/decoding
EDGE_NEWEST := $(EDGE_DECODING) tests/integration/trl/test_sparse_rollouts.py \
  tests/integration/test_demo.py

.PHONY: venv lock test test-all test-gpu test-edges test-newest test-lowest demo docs lint bench dist clean

venv: $(STAMP)

$(STAMP): $(INSTALL_INPUTS)
	scripts/lock.sh install $(VENV)
	@touch $(STAMP)

lock:
	scripts/lock.sh refresh

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# both ends of the tested transformers range, each in its own venv made from the lock; a failure
# names the package and version that broke us
test-edges: test-newest test-lowest

test-newest: $(STAMP)
	@scripts/lock.sh edge .venv-newest "transformers$(TRANSFORMERS_RANGE)"
	@.venv-newest/bin/python -m pytest -q -m "not gpu" $(EDGE_NEWEST) $(PYTEST_ARGS) || { \
	  echo "UPSTREAM BREAK: the tests above fail with transformers==$$(.venv-newest/bin/python -c \
	  'import transformers; print(transformers.__version__)') (the newest release in $(TRANSFORMERS_RANGE));" \
	  "the locked environment has transformers==$$(grep -i '^transformers==' requirements.lock | cut -d= -f3)"; exit 1; }

test-lowest: $(STAMP)
	@scripts/lock.sh edge .venv-lowest "transformers==$(TRANSFORMERS_LOWEST)"
	@.venv-lowest/bin/python -m pytest -q -m "not gpu" $(EDGE_DECODING) $(PYTEST_ARGS) || { \
	  echo "UPSTREAM BREAK: the decoding tests fail with transformers==$(TRANSFORMERS_LOWEST)," \
	  "the lowest version in $(TRANSFORMERS_RANGE)"; exit 1; }

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
	rm -rf $(VENV) .venv-newest .venv-lowest site build dist .pytest_cache .hypothesis
