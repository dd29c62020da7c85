r"""Rejection masks (pure functions): each returns a bool ``[B, T]`` subset of ``mask``.

- [`band_mask`][sparsecorr.correction.band_mask]: keep where the ratio lies in [low, high] —
  per token (MIS, IcePop), per sequence product, or per sequence geometric mean (Geo-RS);
- [`veto_mask`][sparsecorr.correction.veto_mask]: drop a whole sequence if any token's ratio
  is below a threshold (Sparse-RL, 1e-4);
- [`divergence_mask`][sparsecorr.correction.divergence_mask]: drop sequences whose max or
  mean k2/k3 divergence exceeds a threshold (verl ``seq_max_k3`` ...);
- [`tail_mask`][sparsecorr.correction.tail_mask]: drop sequences whose own q-quantile of the
  acceptance rate is below tau (sparsity-aware, from Sparrow's tail statistic);
- [`opsm_mask`][sparsecorr.correction.opsm_mask]: drop negative-advantage sequences that
  drifted too far (DeepSeek-V3.2 off-policy sequence masking).
"""

from __future__ import annotations

import math

import torch

from .._checks import (
    check_advantages,
    check_choice,
    check_float_tensor,
    check_mask,
    check_number,
    check_probability,
    count,
)
from ..mismatch import LOG_RATIO_CLAMP, masked_quantile, sequence_log_ratio

__all__ = ["band_mask", "divergence_mask", "divergence_stat", "opsm_mask", "tail_mask", "veto_mask"]

LEVELS = ("token", "sequence", "geometric")


def _check(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    check_float_tensor(name, x, ndim=2)
    check_mask(mask, x)


def band_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, low: float, high: float, level: str = "token"
) -> torch.Tensor:
    r"""Keep tokens (or whole sequences) whose ratio lies in ``[low, high]``.

    token: \(e^{\ell_t}\); sequence: \(e^{\sum_t \ell_t}\); geometric: \(e^{\bar\ell}\).
    Compared in log space, so no overflow.

    Shapes:
        log_ratio, mask: ``[B, T]`` -> ``[B, T]`` bool.
    """
    _check("log_ratio", log_ratio, mask)
    check_choice("level", level, LEVELS)
    if not (0 <= low <= high):
        raise ValueError(f"low, high: expected 0 <= low <= high, got low={low!r}, high={high!r}")
    lo = math.log(low) if low > 0 else -math.inf
    hi = math.log(high) if high < math.inf else math.inf
    lr = log_ratio.detach().float()
    if level == "token":
        return mask & (lr >= lo) & (lr <= hi)
    s = sequence_log_ratio(lr, mask, reduce="sum" if level == "sequence" else "mean")
    return mask & ((s >= lo) & (s <= hi))[:, None]


def veto_mask(log_ratio: torch.Tensor, mask: torch.Tensor, *, threshold: float = 1e-4) -> torch.Tensor:
    r"""Drop every sequence with a token whose ratio \(e^{\ell_t}\) is below ``threshold``.

    Sparse-RL (Luo et al., ACL 2026): a token the dense model finds ~10⁴× less likely than the
    sampler did signals a corrupted rollout; the whole sequence goes.

    Shapes:
        log_ratio, mask: ``[B, T]`` -> ``[B, T]`` bool.
    """
    _check("log_ratio", log_ratio, mask)
    if not threshold > 0:
        raise ValueError(f"threshold: expected a number > 0, got {threshold!r}")
    bad = (mask & (log_ratio.detach().float() < math.log(threshold))).any(-1)
    return mask & ~bad[:, None]


def divergence_mask(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str = "k3",
    reduce: str = "max",
    threshold: float,
) -> torch.Tensor:
    r"""Drop sequences whose max (or mean) per-token k2/k3 divergence exceeds ``threshold``.

    \(k_2 = \ell^2/2\), \(k_3 = e^{\ell} - 1 - \ell\) with \(\ell\) = old_logp − rollout_logp
    (clamped ±20). verl's ``seq_max_k3`` / ``seq_mean_k2`` modes.

    Shapes:
        old_logp, rollout_logp, mask: ``[B, T]`` -> ``[B, T]`` bool.
    """
    _check("old_logp", old_logp, mask)
    _check("rollout_logp", rollout_logp, mask)
    check_choice("estimator", estimator, ("k2", "k3"))
    check_choice("reduce", reduce, ("max", "mean"))
    if not threshold >= 0:
        raise ValueError(f"threshold: expected a number >= 0, got {threshold!r}")
    raw = old_logp.detach().float() - rollout_logp.detach().float()
    valid = mask & torch.isfinite(raw)
    lr = torch.where(valid, raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
    return mask & (divergence_stat(lr, valid, estimator=estimator, reduce=reduce) <= threshold)[:, None]


def divergence_stat(log_ratio: torch.Tensor, valid: torch.Tensor, *, estimator: str,
                    reduce: str) -> torch.Tensor:
    r"""``[B]`` max or mean over the valid tokens of \(k_2\) or \(k_3\); ``log_ratio`` must be
    0 off the valid tokens (both estimators are then 0 there), as in a ``Mismatch`` record.
    Rows without a valid token (and T = 0) give 0."""
    lr = log_ratio
    k = 0.5 * lr.square() if estimator == "k2" else torch.expm1(lr) - lr
    if lr.shape[-1] == 0:
        return torch.zeros(lr.shape[0], device=lr.device)
    if reduce == "max":
        return k.amax(-1)
    return k.sum(-1) / count(valid, dim=-1).clamp(min=1)


def tail_mask(
    acceptance: torch.Tensor, mask: torch.Tensor, *, q: float = 0.05, tau: float = 0.86
) -> torch.Tensor:
    r"""Drop sequences whose own ``q``-quantile of the acceptance rate is below ``tau``.

    Sparrow (Zhou et al., 2026) shows training stays stable while the 5th percentile of the
    per-token acceptance \(\alpha_t = 1 - \mathrm{TV}\) stays at or above \(\tau \approx 0.86\);
    applied per sequence, the statistic rejects exactly the rollouts whose tail collapsed.

    Shapes:
        acceptance, mask: ``[B, T]`` -> ``[B, T]`` bool.
    """
    _check("acceptance", acceptance, mask)
    check_probability("q", q)
    check_probability("tau", tau)
    tail = masked_quantile(acceptance.detach().float(), mask, q, dim=1)  # NaN for empty rows
    return mask & (tail >= tau)[:, None]


def opsm_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *, delta: float
) -> torch.Tensor:
    r"""Off-policy sequence masking (DeepSeek-V3.2): drop a sequence when its advantage is
    negative and its mean drift \(-\bar\ell = \frac{1}{|m|}\sum_t \log\frac{\pi_\text{sampler}}{\pi}\)
    exceeds ``delta``.

    ``log_ratio`` is \(\log \pi - \log \pi_\text{sampler}\) per token (old_logp − rollout_logp,
    or logp − rollout_logp to measure drift to the current policy, as DeepSeek does).

    Shapes:
        log_ratio, mask: ``[B, T]``; advantages: ``[B]`` or ``[B, T]`` -> ``[B, T]`` bool.
    """
    _check("log_ratio", log_ratio, mask)
    check_advantages(advantages, log_ratio, column=False)
    check_number("delta", delta, low=0)
    adv = advantages.detach().float()
    if adv.dim() == 2:  # per-token advantages: the sequence's sign is that of its mean
        adv = torch.where(mask, adv, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    drift = -sequence_log_ratio(log_ratio.detach().float(), mask, reduce="mean")
    return mask & ~((adv < 0) & (drift > delta))[:, None]
