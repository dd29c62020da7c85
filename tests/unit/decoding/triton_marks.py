"""Where the engine's Triton kernels can run in the tests (`sparsecorr.decoding.kernels`): on a
GPU, or on the CPU under Triton's interpreter (``make test-triton`` installs Triton beside the
lock's venv and runs the kernels' test files with ``TRITON_INTERPRET=1``); elsewhere the tests
marked `needs_triton` are skipped."""

import importlib.util
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter is chosen when Triton is imported: the variable is set by the caller
RUN_TRITON = importlib.util.find_spec("triton") is not None and (
    DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not RUN_TRITON, reason="needs Triton and a GPU, or Triton's interpreter "
                                  "(TRITON_INTERPRET=1 with Triton installed: make test-triton)")
