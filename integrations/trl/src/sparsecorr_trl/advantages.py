r"""TRL 1.16's advantages, with the rollouts a correction vetoed left out of every statistic.

TRL computes one advantage per rollout from the rewards of the whole generation batch (all
processes), in ``GRPOTrainer._generate_and_score_completions``. With ``sum_then_normalize``
(default), \(R_i = \sum_k w_k r_{i,k}\) and

\[
A_i = \frac{R_i - \bar R_{g(i)}}{\sigma + 10^{-4}}, \qquad
\sigma = \begin{cases} \mathrm{std}(R_{g(i)}) & \texttt{scale\_rewards="group"} \\
\mathrm{std}(R) & \texttt{"batch"} \end{cases},
\]

(no division with ``"none"``); with ``normalize_then_sum`` each reward function is normalised
within its group first, the weighted sum is then normalised over the batch. Means and standard
deviations (Bessel) ignore NaN: a rollout every reward function declined (all ``None``) is
left out, and its advantage is 0.

`trl_advantages` is the same computation with a ``valid`` mask: a rollout the correction
rejected as a whole (``Correction.sequence_mask`` False) is treated exactly like an unscorable
one, so it does not move its group's mean or standard deviation (shared/METHODS.md §5; the
``group_advantages(valid=...)`` semantics) and gets advantage 0. With every rollout valid the
result is TRL's, bit for bit (tested against TRL's own output in the trainer).

Shapes:
    rewards_per_func: ``[B, K]`` (B rollouts of the generation batch, all processes, groups of
    ``num_generations`` consecutive); weights ``[K]``; valid ``[B]`` -> ``[B]``.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanstd

__all__ = ["trl_advantages"]

_EPS = 1e-4  # TRL's


def _sum_then_normalize(rewards_per_func, weights, drop, *, g: int, scale: str) -> torch.Tensor:
    rewards = (rewards_per_func * weights[None]).nansum(dim=1)
    rewards[drop] = torch.nan
    grouped = rewards.view(-1, g)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(g, dim=0)
    if scale in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(g, dim=0) if g > 1 else torch.zeros_like(rewards)
    elif scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards: expected 'group', 'batch' or 'none', got {scale!r}")
    adv = rewards - mean
    return adv if scale == "none" else adv / (std + _EPS)


def _normalize_then_sum(rewards_per_func, weights, drop, *, g: int) -> torch.Tensor:
    k = rewards_per_func.shape[1]
    grouped = rewards_per_func.masked_fill(drop[:, None], torch.nan).view(-1, g, k)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + _EPS)).view(-1, k)
    rewards = (reward_k * weights[None]).nansum(dim=1)
    rewards[drop] = torch.nan
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return (rewards - torch.nanmean(rewards)) / (std + _EPS)


def trl_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, *, num_generations: int,
                   scale_rewards: str, multi_objective_aggregation: str,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's advantages of a generation batch, invalid rollouts left out (module docstring).

    Args:
        rewards_per_func: every reward function's reward per rollout (NaN = declined).
        weights: ``reward_weights``.
        num_generations: rollouts per prompt (the group size).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        multi_objective_aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"``.
        valid: bool, False = rejected whole by the correction; None = all valid.

    Shapes:
        rewards_per_func: ``[B, K]``; weights ``[K]``; valid ``[B]`` -> ``[B]`` float32.
    """
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[0] % num_generations:
        raise ValueError(f"rewards_per_func: expected [B, K] with B a multiple of "
                         f"{num_generations}, got {tuple(rewards_per_func.shape)}")
    drop = torch.isnan(rewards_per_func).all(dim=1)
    if valid is not None:
        drop = drop | ~valid.to(drop.device)
    w = weights.to(rewards_per_func.device)
    if multi_objective_aggregation == "sum_then_normalize":
        adv = _sum_then_normalize(rewards_per_func, w, drop, g=num_generations, scale=scale_rewards)
    elif multi_objective_aggregation == "normalize_then_sum":
        adv = _normalize_then_sum(rewards_per_func, w, drop, g=num_generations)
    else:
        raise ValueError(f"multi_objective_aggregation: expected 'sum_then_normalize' or "
                         f"'normalize_then_sum', got {multi_objective_aggregation!r}")
    return torch.nan_to_num(adv, nan=0.0)
