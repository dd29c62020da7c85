r"""Importance weights from the sparse-to-dense log-ratio (pure functions, detached, float32).

With \(\ell_t = \text{old\_logp}_t - \text{rollout\_logp}_t\) (clamped to ±20):

- token level (TIS, Yao et al. 2025): \(w_t = \mathrm{clamp}(e^{\ell_t}, \text{floor}, \text{cap})\);
- sequence level, product: \(w_i = \mathrm{clamp}(e^{\sum_t \ell_t})\), which vanishes or explodes
  on long outputs (TRL #5814);
- sequence level, geometric mean: \(w_i = \mathrm{clamp}(e^{\frac{1}{|m_i|}\sum_t \ell_t})\),
  stable in length.

Sequence weights are broadcast to the tokens of their row. Every weight is 0 where masked.
"""

from __future__ import annotations

import torch

from .._checks import check_choice, check_float_tensor, check_mask, count
from .._dist import all_reduce_sum
from .._ratio import ratio
from ..mismatch import sequence_log_ratio

__all__ = ["batch_normalize", "sequence_is_weights", "token_is_weights"]


def _check_bounds(cap: float | None, floor: float) -> None:
    if floor < 0:
        raise ValueError(f"floor: expected a number >= 0, got {floor!r}")
    if cap is not None and not cap > floor:
        raise ValueError(f"cap: expected None or a number > floor ({floor}), got {cap!r}")


def token_is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, cap: float | None = 2.0, floor: float = 0.0
) -> torch.Tensor:
    r"""Truncated token-level IS weights \(\mathrm{clamp}(e^{\ell_t}, \text{floor}, \text{cap})\).

    ``cap=None`` leaves the weights untruncated (unbiased, high variance). TIS default cap 2.

    Shapes:
        log_ratio, mask: ``[B, T]`` -> ``[B, T]`` float32.
    """
    check_float_tensor("log_ratio", log_ratio, ndim=2)
    check_mask(mask, log_ratio)
    _check_bounds(cap, floor)
    w = ratio(log_ratio.detach().float())
    w = w.clamp(min=floor, max=cap)
    return torch.where(mask, w, 0.0)


def sequence_is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    reduce: str = "sum",
    cap: float | None = None,
    floor: float = 0.0,
) -> torch.Tensor:
    r"""Sequence-level IS weights, broadcast to tokens.

    ``reduce="sum"``: product of token ratios \(e^{\sum_t \ell_t}\) (the sum is clamped to ±20
    before ``exp``, as verl does); ``reduce="mean"``: geometric mean \(e^{\bar\ell}\).

    Shapes:
        log_ratio, mask: ``[B, T]`` -> ``[B, T]`` float32.
    """
    check_float_tensor("log_ratio", log_ratio, ndim=2)
    check_mask(mask, log_ratio)
    check_choice("reduce", reduce, ("sum", "mean"))
    _check_bounds(cap, floor)
    s = sequence_log_ratio(log_ratio.detach().float(), mask, reduce=reduce)
    w = ratio(s).clamp(min=floor, max=cap)
    return torch.where(mask, w[:, None], 0.0)


def batch_normalize(
    weights: torch.Tensor, mask: torch.Tensor, *, group: object | None = None
) -> torch.Tensor:
    r"""Rescale so the mean weight over valid tokens is 1: \(w_t / \bar w\).

    With a ``torch.distributed`` process group the mean is over every rank's valid tokens, so
    all ranks share one scale (Sparse-RL normalises over the whole batch). All-zero weights are
    returned unchanged.

    Shapes:
        weights, mask: ``[B, T]`` -> ``[B, T]`` float32.
    """
    check_float_tensor("weights", weights)
    check_mask(mask, weights)
    w = torch.where(mask, weights.detach().float(), 0.0)
    total = all_reduce_sum(torch.stack([w.sum(), count(mask)]), group)
    mean = total[0] / total[1].clamp(min=1)
    return torch.where(mean > 0, w / mean.clamp(min=1e-30), w)
