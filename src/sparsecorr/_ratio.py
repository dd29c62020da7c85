r"""The one importance-ratio helper: \(\rho = e^{\mathrm{clamp}(x, \pm 20)}\).

Every ratio the library forms (the corrections' weights, the surrogates' \(\pi_\theta/\pi_\text{old}\),
the glue's) goes through [`ratio`][sparsecorr._ratio.ratio], so a log-ratio of any size gives a
finite ratio and the bound lives in one place (shared/DESIGN.md: ±20).
"""

from __future__ import annotations

import torch

__all__ = ["LOG_RATIO_CLAMP", "clamp_log_ratio", "ratio", "ratio_m1"]

#: the one bound on every per-token log-ratio before ``exp`` (shared/DESIGN.md: ±20)
LOG_RATIO_CLAMP = 20.0


def clamp_log_ratio(x: torch.Tensor) -> torch.Tensor:
    r"""\(\mathrm{clamp}(x, -20, 20)\) (any shape; keeps the gradient)."""
    return x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    r"""\(e^{\mathrm{clamp}(x, \pm 20)}\) (any shape; keeps the gradient; never inf)."""
    return torch.exp(clamp_log_ratio(log_ratio))


def ratio_m1(log_ratio: torch.Tensor) -> torch.Tensor:
    r"""\(\rho - 1 = \mathrm{expm1}(\mathrm{clamp}(x, \pm 20))\), exact for a small \(x\) (any
    shape; keeps the gradient): for sums of terms near the on-policy point."""
    return torch.expm1(clamp_log_ratio(log_ratio))
