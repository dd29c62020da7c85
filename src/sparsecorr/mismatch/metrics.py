r"""Per-token mismatch between the sparse sampler and the dense model.

Tokens are sampled from the sparse (rollout) policy \(q\); the dense model with rollout-time
weights is \(p\). Per token, with the log-ratio \(\ell_t = \log p(y_t) - \log q(y_t)\)
(``old_logp - rollout_logp``), the classic estimators (Schulman, "Approximating KL
divergence", 2020) of \(\mathrm{KL}(q \,\|\, p) = \mathbb{E}_q[\log q - \log p]\) are

\[
k_1 = -\ell_t, \qquad k_2 = \tfrac12 \ell_t^2, \qquad k_3 = e^{\ell_t} - 1 - \ell_t .
\]

\(k_1\) is unbiased but can be negative; \(k_3\) is unbiased and \(\ge 0\); \(k_2\) is biased,
\(\ge 0\), with low variance. \(\chi^2_t = (e^{\ell_t} - 1)^2\) estimates
\(\chi^2(p \,\|\, q) = \mathbb{E}_q[(p/q - 1)^2]\), the quantity that bounds the variance of
importance weights. Every function returns float32, with 0 where the mask is False or the
inputs are not finite; log-ratios are clamped to ±20 before ``exp`` (shared/DESIGN.md).
"""

from __future__ import annotations

import torch

from .._checks import check_choice, check_dim, check_float_tensor, check_mask, check_same_shape
from .._ratio import LOG_RATIO_CLAMP, clamp_log_ratio

__all__ = [
    "LOG_RATIO_CLAMP",
    "chi2",
    "effective_sample_size",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "log_ratio",
    "sequence_log_ratio",
]



def _check_pair(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> None:
    check_float_tensor("old_logp", old_logp)
    check_float_tensor("rollout_logp", rollout_logp)
    check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp)
    check_mask(mask, old_logp)


def log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""\(\ell_t = \mathrm{clamp}(\text{old\_logp} - \text{rollout\_logp}, \pm 20)\), 0 where masked.

    Positions where either input is NaN/inf are set to 0 (count them with
    ``~torch.isfinite``; `mismatch_metrics` reports them).

    Shapes:
        old_logp, rollout_logp, mask: ``[B, T]`` -> ``[B, T]`` float32.
    """
    _check_pair(old_logp, rollout_logp, mask)
    raw = old_logp.float() - rollout_logp.float()
    keep = mask & torch.isfinite(raw)
    return torch.where(keep, clamp_log_ratio(raw), 0.0)


def kl_k1(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""\(k_1 = -\ell_t\): unbiased for KL(q‖p), may be negative. Shapes: ``[B, T]`` -> ``[B, T]``."""
    return -log_ratio(old_logp, rollout_logp, mask)


def kl_k2(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""\(k_2 = \ell_t^2 / 2\): biased, ≥ 0, low variance. Shapes: ``[B, T]`` -> ``[B, T]``."""
    return 0.5 * log_ratio(old_logp, rollout_logp, mask).square()


def kl_k3(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""\(k_3 = e^{\ell_t} - 1 - \ell_t\): unbiased for KL(q‖p) and ≥ 0.

    Shapes:
        ``[B, T]`` -> ``[B, T]`` float32 (0 where masked).
    """
    lr = log_ratio(old_logp, rollout_logp, mask)
    return torch.expm1(lr) - lr


def chi2(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""\((e^{\ell_t} - 1)^2\), unbiased for \(\chi^2(p \| q)\). Shapes: ``[B, T]`` -> ``[B, T]``."""
    return torch.expm1(log_ratio(old_logp, rollout_logp, mask)).square()


def sequence_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, reduce: str = "sum"
) -> torch.Tensor:
    r"""Per-sequence log-ratio: \(\sum_t \ell_t\) (``"sum"``, log of the product of ratios) or
    \(\frac{1}{|m|}\sum_t \ell_t\) (``"mean"``, log of the geometric mean; 0 for empty rows).

    Shapes:
        log_ratio, mask: ``[B, T]`` -> ``[B]`` float32.
    """
    check_float_tensor("log_ratio", log_ratio, ndim=2)
    check_mask(mask, log_ratio)
    check_choice("reduce", reduce, ("sum", "mean"))
    lr = torch.where(mask, log_ratio.float(), 0.0)
    total = lr.sum(-1)
    if reduce == "sum":
        return total
    return total / mask.sum(-1).clamp(min=1)


def effective_sample_size(
    weights: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None
) -> torch.Tensor:
    r"""Normalised effective sample size \((\sum w)^2 / (n \sum w^2) \in (0, 1]\) over valid entries.

    1 when every weight is equal; \(1/n\) when one weight carries everything (Kish, 1965).
    All-zero weights give 0; no valid entry gives NaN.

    Args:
        weights: non-negative importance weights.
        mask: which entries count.
        dim: ``None`` for one value over the batch, ``-1`` for one per sequence.

    Shapes:
        weights, mask: ``[B, T]`` -> ``[]`` (``dim=None``) or ``[B]`` (``dim=-1``).
    """
    check_float_tensor("weights", weights)
    check_mask(mask, weights)
    dim = check_dim("dim", dim, weights.dim(), allow_none=True)
    w = torch.where(mask, weights.float(), 0.0)
    dims = tuple(range(w.dim())) if dim is None else (dim,)
    n = mask.sum(dims).float()
    s1 = w.sum(dims)
    s2 = w.square().sum(dims)
    ess = torch.where(s2 > 0, s1.square() / (n * s2).clamp(min=1e-30), 0.0)
    return torch.where(n > 0, ess, float("nan"))
