r"""\(e^x\) for the hot paths, as \(2^{x \log_2 e}\) on the CPU.

torch 2.13's CPU ``exp`` kernel keeps its error under one ulp and pays for it: on a float32
``[64, 4096]`` tensor (2 threads, AVX-512) it takes ~160 µs where ``exp2`` takes ~45 µs and
the scaling multiply ~15 µs (``benchmarks/bench_losses.py`` and ``RESULTS.md``). The rounding
of \(x \log_2 e\) costs accuracy in proportion to \(|x|\): measured against float64 over a
2M-point grid, at most 2.5 ulp for \(|x| \le 1\) (the ratios of a training step) and 16 ulp at
the ±20 clamp, against 0.56 ulp for ``exp``. An importance ratio, a clip decision or a weight
cannot see that; the \(k_3\) metric, which needs \(e^x - 1\) exactly for small \(x\), keeps
``expm1`` (``Mismatch.ratio_m1``). On other devices the kernel is memory-bound and ``exp``
itself is used (the multiply would be one more pass over memory).
"""

from __future__ import annotations

import torch

__all__ = ["LOG2E", "exp_", "exp_into"]

LOG2E = 1.4426950408889634


def exp_(x: torch.Tensor) -> torch.Tensor:
    r"""\(e^x\) in place (``x`` overwritten and returned)."""
    if x.device.type == "cpu":
        return x.mul_(LOG2E).exp2_()
    return x.exp_()


def exp_into(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    r"""\(e^x\) into ``out`` (a new tensor when None); ``x`` is left unchanged."""
    if x.device.type == "cpu":
        return torch.mul(x, LOG2E, out=out).exp2_()
    return torch.exp(x, out=out)
