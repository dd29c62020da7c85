r"""The verl policy loss ``loss_mode="sparsecorr"``, computed by `sparse_grpo`.

verl 0.9.1's actor (``verl/workers/utils/losses.py::ppo_loss``) calls every registered policy
loss as ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights)`` and never hands it the rollout log-probs. The sparse-rollout correction
therefore runs on the driver (`sparsecorr_verl.correction`), which writes its detached weights
into ``rollout_is_weights`` and its rejection into ``response_mask``; this loss consumes both:

- rejected tokens are out of ``response_mask``, so they leave the numerator and the denominator;
- a token's weight \(w_t \ge 0\) multiplies its clipped surrogate. For PPO-clip (dual clip
  included) \(w\,\max(-A\rho, -A\,\mathrm{clip}(\rho)) = \max(-(wA)\rho, -(wA)\,\mathrm{clip}(\rho))\)
  and the dual-clip branch keeps its sign, so the weights enter `sparse_grpo` as the per-token
  advantages \(w_t A_t\): the same product `sparse_grpo` forms from a correction's weights.

With neither (no correction configured) the loss, its gradient and its metrics equal verl's
``vanilla`` (tested against verl's code for every ``loss_agg_mode``).

verl's ``loss_agg_mode`` maps onto `Aggregation`, with verl's global normalisers from
``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``) so the loss stays invariant to data-parallel sharding exactly as
``agg_loss``: ``token-mean`` divides by ``batch_num_tokens / dp_size``, ``token-sum`` by
``1 / dp_size``, the ``seq-mean-*`` modes by ``global_batch_size / dp_size``, and
``seq-mean-token-sum-norm`` also by ``loss_scale_factor`` (default: the padded length).
"""

from __future__ import annotations

from typing import Any

import torch

from sparsecorr.losses import Aggregation, PPOClip, sparse_grpo

__all__ = ["LOSS_AGG_MODES", "LOSS_MODE", "aggregation_for", "sparsecorr_policy_loss"]

LOSS_MODE = "sparsecorr"
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
_LOG_RATIO_CLAMP = 20.0  # verl's and sparsecorr's clamp before exp


def _value(info: dict, key: str) -> Any:
    v = info.get(key)
    return v.reshape(()) if isinstance(v, torch.Tensor) else v


def aggregation_for(loss_agg_mode: str, global_batch_info: dict | None = None) -> Aggregation:
    """verl's ``loss_agg_mode`` and ``global_batch_info`` as a sparsecorr `Aggregation`.

    Raises:
        ValueError: an unknown ``loss_agg_mode``.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode: expected one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    info = dict(global_batch_info or {})
    dp = _value(info, "dp_size")
    dp = 1 if dp is None else dp
    if loss_agg_mode == "token-sum":  # verl: masked_sum * dp_size
        return Aggregation("token-mean", num_tokens=1.0 / dp)
    if loss_agg_mode == "token-mean":
        n = _value(info, "batch_num_tokens")
        return Aggregation("token-mean", num_tokens=None if n is None else n / dp)
    s = _value(info, "global_batch_size")
    scale = _value(info, "loss_scale_factor")
    return Aggregation(loss_agg_mode, num_sequences=None if s is None else s / dp,
                       norm_length=None if (scale is None or loss_agg_mode != "seq-mean-token-sum-norm")
                       else float(scale))


def _clip_range(config: Any) -> tuple[float, float, float]:
    """``(clip_low, clip_high, dual_clip)`` from verl's actor config, as ``vanilla`` reads it."""
    clip = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
    c = config.get("clip_ratio_c", 3.0)
    if not c > 1.0:
        raise ValueError(f"clip_ratio_c: expected a number > 1 (dual-clip PPO), got {c!r}")
    return float(low), float(high), float(c)


@torch.no_grad()
def _verl_metrics(log_prob, old_log_prob, advantages, mask, low, high, c) -> dict[str, torch.Tensor]:
    """verl's PPO metrics under verl's names, as detached 0-d tensors (verl's ``Metric`` reads
    them): ``actor/pg_clipfrac`` (the clipped branch is the larger loss), ``actor/ppo_kl``
    (mean of ``old_logp - logp``) and ``actor/pg_clipfrac_lower`` (the dual clip is active),
    each a mean over the loss's tokens."""
    lr = (log_prob.detach().float() - old_log_prob.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = lr.exp()
    adv = advantages.float()
    loss1, loss2 = -adv * ratio, -adv * ratio.clamp(1.0 - low, 1.0 + high)
    clipped = torch.maximum(loss1, loss2)
    mask_f = mask.float()
    n = mask_f.sum().clamp(min=1.0)  # verl's masked_mean divides by the count + 1e-8

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x.float() * mask_f).sum() / n

    return {"actor/pg_clipfrac": mean(loss2 > loss1),
            "actor/ppo_kl": mean(-lr),
            "actor/pg_clipfrac_lower": mean((clipped > -adv * c) & (adv < 0))}


def sparsecorr_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl policy loss (``loss_mode="sparsecorr"``): dual-clip PPO by `sparse_grpo`.

    Args (verl's): ``old_log_prob`` (``old_logp``), ``log_prob`` (``logp``, carries the gradient),
        ``advantages`` per token, ``response_mask`` (after the driver's rejection),
        ``loss_agg_mode``, ``config`` (verl's ``ActorConfig``: ``clip_ratio``,
        ``clip_ratio_low/high``, ``clip_ratio_c``, ``global_batch_info``) and the driver's
        ``rollout_is_weights`` (detached here) or None.

    Returns:
        ``(loss, metrics)``: metrics under verl's names (``actor/pg_clipfrac``,
        ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``) as 0-d tensors.

    Shapes:
        all tensors ``[B, T]`` -> loss ``[]``.
    """
    if config is None:
        raise ValueError("config: expected verl's ActorConfig (clip_ratio, clip_ratio_low/high, "
                         "clip_ratio_c, global_batch_info), got None")
    low, high, c = _clip_range(config)
    aggregation = aggregation_for(loss_agg_mode, getattr(config, "global_batch_info", None))
    mask = response_mask.bool()
    adv = advantages.float()
    if rollout_is_weights is not None:
        adv = adv * rollout_is_weights.detach().float()
    out = sparse_grpo(log_prob, old_log_prob, adv, mask, surrogate=PPOClip(
        clip_low=low, clip_high=high, dual_clip=c), aggregation=aggregation, metrics="none")
    return out.loss, _verl_metrics(log_prob, old_log_prob, advantages, mask, low, high, c)
