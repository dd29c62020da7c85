"""The fallback every fused CUDA kernel of the engine shares.

The engine's fused kernels (`sparsecorr.decoding.kernels.kv_write`,
`sparsecorr.decoding.kernels.votes`) are Triton kernels registered as the CUDA kernel of a custom op whose default kernel is the
stock chain of aten ops, so no code of ours branches on the device. Triton ships with CUDA builds
of torch, but a kernel can still fail where it runs (no Triton, a compiler that rejects it):
`fused_or_stock` then warns once, remembers the error, and runs the stock chain from then on,
which gives the same values.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

__all__ = ["fused_or_stock"]


def fused_or_stock(op: str, failed: list[str], fused: Callable, stock: Callable, *args):
    """``fused(*args)`` on the device of ``args[0]`` (Triton launches on the current device);
    if it raises, append the error to ``failed`` (the op's own list), warn once, and use
    ``stock(*args)``, as every later call does without trying again.
    """
    if not failed:
        try:
            with torch.cuda.device_of(args[0]):
                return fused(*args)
        except Exception as err:  # no Triton, or a kernel that does not build here
            failed.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"{op}: the fused Triton kernel failed ({failed[0]}); using the stock ops (same values)",
                          RuntimeWarning, stacklevel=3)
    return stock(*args)
