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
# the fused kernels' Triton (sparsecorr::window_votes, sparsecorr::write_kv), tested on the CPU by Triton's interpreter
TRITON_VERSION := 3.9.0
# peers of the parity tests, installed without their GPU-only dependencies (the tests load their
# loss code through tests/openrlhf_shim.py and tests/verl_shim.py)
PEERS := openrlhf>=0.11,<0.12 verl==0.9.1
# the glue distributions, editable (verl's [cpu-test] extra: the light packages its CPU tests need
# to load verl's real DataProto / ActorConfig next to the --no-deps verl)
GLUE := integrations/trl integrations/openrlhf integrations/verl[cpu-test]
# the tested ranges (the same ranges are in pyproject.toml and src/sparsecorr/decoding/hf.py;
# tests/unit/test_versions.py checks they agree). Their ends are tested by `make test-edges`:
# torch 2.11.0 with transformers 5.9.0 (verl 0.9.1's pins: the lowest of both), torch 2.14.1 with
# transformers 5.19.0 (SGLang 0.5.23's), and the newest transformers on the lock's torch.
TORCH_LOWEST := 2.11.0
TORCH_NEWEST := 2.14.1
TRANSFORMERS_RANGE := >=5.9,<6
TRANSFORMERS_LOWEST := 5.9.0
TRANSFORMERS_AT_TORCH_NEWEST := 5.19.0
export PYTHON PIP_VERSION TORCH_VERSION PEERS GLUE
STAMP := $(VENV)/.sparsecorr-installed
INSTALL_INPUTS := requirements.lock pyproject.toml $(wildcard integrations/*/pyproject.toml) \
  scripts/lock.sh Makefile
PYTEST_ARGS ?=
# what the range tests run: the loss path (losses, corrections, mismatch), the verl plugin and
# the OpenRLHF glue; the compile tests in full (every preset, surrogate and aggregation, the
# correction built inside and outside the compiled step: slow ones included); the decoding
# engine; and (newest transformers only) the TRL sparse rollouts + demo
COMPILE_TESTS := tests/unit/losses/test_compile.py
EDGE_LOSS := tests/unit/losses tests/unit/correction tests/unit/mismatch tests/property/losses \
  tests/property/correction tests/property/mismatch tests/integration/verl tests/integration/openrlhf
EDGE_DECODING := tests/unit/decoding tests/property/decoding
# the trainer's rollouts on a model TRL prepared (gradient checkpointing, the input-require-grads
# hook: fused on, nothing alive) and sharded by FSDP2 over gloo, at each end of the torch range
EDGE_TRAINER := tests/integration/trl/test_rollout_model.py tests/integration/trl/test_fsdp.py
EDGE_NEWEST := $(EDGE_DECODING) tests/integration/trl/test_sparse_rollouts.py \
  tests/integration/test_demo.py
# the runtime pieces the rollout backends' tests load beside the --no-deps peers, in the verl
# stack's job only: Ray (verl requires ray>=2.41; OpenRLHF runs on it); cachetools / FastAPI /
# uvicorn, which verl's rollout modules import (tests/integration/verl/test_verl_rollout_*); aiohttp
# and pylatexenc, which OpenRLHF's agent executors import (tests/integration/openrlhf/test_rollout_*;
# a vLLM or SGLang install brings them all); without them those tests skip
RAY_RUNTIME := ray==2.60.0 cachetools==8.0.2 fastapi==0.165.0 uvicorn==0.54.0 aiohttp==3.14.5 pylatexenc==2.11 pyzmq==27.3.0
# one edge job: $(call edge,VENV,TORCH,TRANSFORMERS SPEC,WHAT IT IS[,MORE SPECS]); a failure names
# the package versions that broke us
define edge
	@scripts/lock.sh edge $(1) $(2) "transformers$(3)" $(5)
	@{ $(1)/bin/python -m pytest -q -m "not gpu and not slow" $(EDGE_LOSS) $(EDGE_DECODING) \
	     $(EDGE_TRAINER) --ignore=$(COMPILE_TESTS) $(PYTEST_ARGS) \
	   && $(1)/bin/python -m pytest -q -m "not gpu" $(COMPILE_TESTS) $(PYTEST_ARGS); } || { \
	  echo "UPSTREAM BREAK: the tests above fail with torch==$(2) and transformers==$$($(1)/bin/python \
	  -c 'import transformers; print(transformers.__version__)') ($(4)); the locked environment has" \
	  "torch==$(TORCH_VERSION), transformers==$$(grep -i '^transformers==' requirements.lock | cut -d= -f3)"; \
	  exit 1; }
endef

.PHONY: venv lock test test-slow test-all test-gpu test-edges test-newest test-lowest test-torch-newest \
  test-compile test-resolve test-triton demo docs lint bench dist clean

venv: $(STAMP)

$(STAMP): $(INSTALL_INPUTS)
	scripts/lock.sh install $(VENV)
	@touch $(STAMP)

lock:
	scripts/lock.sh refresh

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu and not resolve" $(PYTEST_ARGS)

# the slow tests no other job runs (CI runs this after `make test`): the kernel-count benchmark's
# smoke run, graph-step parities, long decodes, the schedule fit, second loss types of the
# 2-process runs; the release path and the compile tests have jobs of their own
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not gpu and not resolve" --ignore=tests/integration/test_release.py \
	  --ignore=$(COMPILE_TESTS) $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# the ends of the tested torch and transformers ranges, each in its own venv made from the lock
# (torch and transformers swapped); a failure prints UPSTREAM BREAK with the versions that broke us
test-edges: test-newest test-lowest test-torch-newest

test-newest: $(STAMP)
	@scripts/lock.sh edge .venv-newest $(TORCH_VERSION) "transformers$(TRANSFORMERS_RANGE)"
	@.venv-newest/bin/python -m pytest -q -m "not gpu" $(EDGE_NEWEST) $(PYTEST_ARGS) || { \
	  echo "UPSTREAM BREAK: the tests above fail with transformers==$$(.venv-newest/bin/python -c \
	  'import transformers; print(transformers.__version__)') (the newest release in $(TRANSFORMERS_RANGE));" \
	  "the locked environment has transformers==$$(grep -i '^transformers==' requirements.lock | cut -d= -f3)"; exit 1; }

# the lowest torch and the lowest transformers: verl 0.9.1's stack
test-lowest: $(STAMP)
	$(call edge,.venv-lowest,$(TORCH_LOWEST),==$(TRANSFORMERS_LOWEST),the lowest of torch>=2.11 and transformers$(TRANSFORMERS_RANGE): verl 0.9.1's pins,$(RAY_RUNTIME))

# the newest torch the stacks pin, with SGLang 0.5.23's transformers
test-torch-newest: $(STAMP)
	$(call edge,.venv-torch-newest,$(TORCH_NEWEST),==$(TRANSFORMERS_AT_TORCH_NEWEST),SGLang 0.5.23's pins)

# the compile tests in full (slow ones included) in the locked environment (torch 2.13.0)
test-compile: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" $(COMPILE_TESTS) $(PYTEST_ARGS)

# pip resolves sparsecorr beside each stack's pins (tests/constraints), metadata only: needs the
# package index
test-resolve: $(STAMP)
	$(BIN)/python -m pytest -q -s -m resolve tests/resolve $(PYTEST_ARGS)

# the Triton kernels on the CPU, under Triton's interpreter: Triton (not in the CPU lock: CUDA
# torch brings its own) is installed beside the venv, in .venv-triton, and put on the path
test-triton: $(STAMP)
	@[ -f .venv-triton/.triton-$(TRITON_VERSION) ] || { rm -rf .venv-triton && $(BIN)/python -m pip install -q \
	  --no-deps --target .venv-triton triton==$(TRITON_VERSION) && touch .venv-triton/.triton-$(TRITON_VERSION); }
	TRITON_INTERPRET=1 PYTHONPATH=$(CURDIR)/.venv-triton $(BIN)/python -m pytest -q -m "not gpu" \
	  tests/unit/decoding/test_votes.py tests/unit/decoding/test_kv_write.py $(PYTEST_ARGS)

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
	rm -rf $(VENV) .venv-newest .venv-lowest .venv-torch-newest .venv-triton site build dist .pytest_cache .hypothesis
