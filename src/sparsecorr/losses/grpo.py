r"""``sparse_grpo``: decoupled three-policy PPO / GRPO for sparse rollouts.

Tokens are sampled by the sparse sampler (``rollout_logp``), the dense model with rollout-time
weights gives ``old_logp`` and the learner gives ``logp``. The loss of Sparse-RL (Luo et al.
2026, arXiv 2601.10079) and decoupled PPO (Hilton et al. 2022) is, per kept token,

\[
\ell_t = -\,w_t \cdot \min\!\big(\rho_t A,\ \mathrm{clip}(\rho_t, 1-\varepsilon_l, 1+\varepsilon_h)\,A\big)
\;+\; \beta\, k_3(\text{ref} \,\|\, \text{logp})_t,
\]

with \(\rho_t = \pi_\theta/\pi_\text{old}\) (``ratio_level="token"``) or the GSPO sequence ratio
\(s_i = \exp(\frac{1}{n_i}\sum_t (\text{logp} - \text{old\_logp}))\) (``ratio_level="sequence"``,
Zheng et al. 2025), \(w_t\) the detached IS weight of the ``correction`` (applied to
\(\pi_\text{old}/\pi_\text{rollout}\)), and \(k_3 = e^{d} - d - 1\), \(d = \text{ref\_logp} -
\text{logp}\) (Schulman 2020). Tokens the correction rejects leave both the numerator and the
denominator; the scalar is one of the aggregation modes of :mod:`sparsecorr.losses.aggregation`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._checks import (
    check_choice,
    check_float_tensor,
    check_mask,
    check_positive,
    check_same_shape,
    count,
)
from .._checks import finite as _finite
from ..correction.base import Correction, CorrectionInputs
from ..mismatch import LOG_RATIO_CLAMP, mismatch_metrics
from .aggregation import AGGREGATIONS, row_scales
from .output import LossOutput
from .surrogate import Surrogate, clipped_surrogate, ratio_bounds

__all__ = ["sparse_grpo"]


def _check_inputs(logp, old_logp, advantages, mask, rollout_logp, ref_logp) -> None:
    check_float_tensor("logp", logp, ndim=2)
    check_float_tensor("old_logp", old_logp, ndim=2)
    check_same_shape(logp=logp, old_logp=old_logp, rollout_logp=rollout_logp, ref_logp=ref_logp)
    for name, t in (("rollout_logp", rollout_logp), ("ref_logp", ref_logp)):
        if t is not None:
            check_float_tensor(name, t, ndim=2)
    check_mask(mask, logp)
    check_float_tensor("advantages", advantages)
    b, t = logp.shape
    if tuple(advantages.shape) not in ((b,), (b, t), (b, 1)):
        raise ValueError(f"advantages: expected shape ({b},) or ({b}, {t}), got {tuple(advantages.shape)}")


def _apply_correction(correction, logp, old_logp, rollout_logp, mask, advantages, acceptance):
    """Call (or accept) the correction and check what it returned."""
    if advantages.dim() == 2 and advantages.shape[1] == 1 and advantages.shape != logp.shape:
        advantages = advantages[:, 0]
    if isinstance(correction, Correction):
        corr = correction
    elif callable(correction):
        corr = correction(CorrectionInputs(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask,
                                           acceptance=acceptance, advantages=advantages,
                                           logp=logp.detach()))
    else:
        raise ValueError(f"correction: expected a callable (CorrectionInputs) -> Correction or a "
                         f"Correction, got {type(correction).__name__}")
    if not isinstance(corr, Correction):
        raise ValueError(f"correction: expected the callable to return a Correction, got {type(corr).__name__}")
    check_same_shape(logp=logp, **{"correction.weights": corr.weights})
    check_mask(corr.mask, logp, name="correction.mask")
    return corr


def _clip_metrics(sur: Surrogate, adv: torch.Tensor, *, n, dual_clip) -> dict[str, torch.Tensor]:
    """Fractions of kept tokens on the clipped (zero-gradient) branch, by side of the clip."""
    t = sur.unclipped.shape[1]
    clipped_rows = t - count(sur.unclipped, dim=1)  # not-kept entries count as unclipped
    c_all = clipped_rows.sum()
    if adv.shape[1] == 1:
        c_neg = (clipped_rows * (adv[:, 0] < 0)).sum()
    else:
        c_neg = count(~sur.unclipped & (adv < 0))
    out = {"loss/clip_frac_high": (c_all - c_neg) / n}
    if dual_clip is None:
        out["loss/clip_frac_low"] = c_neg / n
    else:
        c_dual = count(~sur.unclipped & (adv < 0) & (sur.ratio > 1.0))
        out["loss/clip_frac_low"] = (c_neg - c_dual) / n
        out["loss/clip_frac_dual"] = c_dual / n
    return out


def _ratio_stats(sur: Surrogate, kept: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean, min and max of the PPO ratio over kept tokens (ratio is 1 elsewhere)."""
    n1 = n.clamp(min=1.0)
    mean = (sur.ratio_sum - (kept.numel() - n)) / n1
    lo, hi = torch.aminmax(torch.where(kept, sur.ratio, mean))  # the mean lies inside [min, max]
    nan = torch.tensor(float("nan"), device=mean.device)
    empty = n == 0
    return {"loss/ratio_mean": mean, "loss/ratio_min": torch.where(empty, nan, lo),
            "loss/ratio_max": torch.where(empty, nan, hi)}


def _sequence_surrogate(logp, old_logp, kept, adv, weights, scales, *, clip_low, clip_high,
                        dual_clip) -> Surrogate:
    """GSPO: one length-normalised ratio per row (plain autograd; ``[B, 1]`` tensors are cheap)."""
    raw = torch.where(kept, logp.float() - old_logp.float(), 0.0)
    n_i = count(kept, dim=1, keepdim=True).clamp(min=1)
    ratio = (raw.sum(dim=1, keepdim=True) / n_i).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    lo, hi = ratio_bounds(adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    clipped = torch.clamp(ratio, lo, hi)
    w = kept.float() if weights is None else weights
    token_loss = w * adv.neg() * clipped
    r = torch.where(kept, ratio.detach(), 1.0)
    return Surrogate(token_loss=token_loss, loss=(token_loss.sum(dim=1) * scales).sum(), ratio=r,
                     unclipped=(clipped.detach() == ratio.detach()) | ~kept,
                     log_ratio_sum=raw.detach().sum(), ratio_sum=r.sum())


def _check_hparams(clip_low, clip_high, dual_clip, ratio_level, aggregation, kl_coef, ref_logp) -> None:
    check_positive("clip_low", clip_low, allow_zero=True)
    check_positive("clip_high", clip_high, allow_zero=True)
    if clip_low >= 1:
        raise ValueError(f"clip_low: expected a number in [0, 1), got {clip_low!r}")
    if dual_clip is not None and not (isinstance(dual_clip, (int, float)) and dual_clip > 1):
        raise ValueError(f"dual_clip: expected None or a number > 1, got {dual_clip!r}")
    check_choice("ratio_level", ratio_level, ("token", "sequence"))
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_positive("kl_coef", kl_coef, allow_zero=True)
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"ref_logp: expected a [B, T] tensor when kl_coef > 0 (kl_coef={kl_coef!r}), got None")


def sparse_grpo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_logp: torch.Tensor | None = None,
    correction: Callable | object | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    aggregation: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    norm_length: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    acceptance: torch.Tensor | None = None,
    mismatch: bool = True,
    mismatch_quantiles: Sequence[float] = (),
    validate: bool = True,
) -> LossOutput:
    r"""Decoupled three-policy PPO/GRPO loss with an optional sparse-rollout correction.

    Without ``rollout_logp`` and ``correction`` this is plain GRPO/DAPO (clipped PPO on
    \(\pi_\theta/\pi_\text{old}\)). With both, the correction's detached weights \(w_t\)
    multiply each token's clipped term and its mask removes rejected tokens from numerator and
    denominator. With ``rollout_logp`` but no correction, the loss is **not reweighted**: the
    untruncated decoupled weight \(\pi_\text{old}/\pi_\text{rollout}\) has unbounded variance,
    so the mismatch is only measured (``mismatch/*`` metrics) and non-finite rollout tokens are
    masked and counted; pass e.g. ``correction=sparse_rl()`` to act on it.

    A sequence rejected as a whole (vetoed) gets no gradient here; keep it out of the group
    statistics as well by computing the correction first and passing
    ``valid=correction.sequence_mask`` to
    [`group_advantages`][sparsecorr.losses.group_advantages], then passing that ``Correction``
    object itself as ``correction``.

    Args:
        logp: learner log-probs of the sampled tokens (carry the gradient).
        old_logp: dense log-probs with the rollout-time weights.
        advantages: per sequence ``[B]`` or per token ``[B, T]``.
        mask: bool, True = the token counts.
        rollout_logp: sparse sampler log-probs; required with ``correction``.
        correction: a callable ``(CorrectionInputs) -> Correction`` (e.g. ``sparse_rl()``,
            ``tis(cap=2.0)``) or an already computed ``Correction``.
        clip_low: \(\varepsilon_l\) (0.2 PPO and DAPO; 3e-4 GSPO).
        clip_high: \(\varepsilon_h\) (0.2 PPO; 0.28 DAPO and Sparrow; 4e-4 GSPO).
        dual_clip: \(c > 1\) for dual-clip PPO on negative advantages (None: off).
        ratio_level: ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO: length-normalised
            sequence ratio, one per row).
        aggregation: one of ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm`` (see :mod:`sparsecorr.losses.aggregation`).
        num_tokens: global count of *kept* tokens over data-parallel ranks (``token-mean``).
        num_sequences: global count of sequences with a kept token (``seq-mean-*``).
        norm_length: \(L\) of ``seq-mean-token-sum-norm`` (default ``T``).
        ref_logp: reference-model log-probs for the k3 KL penalty / metric.
        kl_coef: \(\beta\) (Sparse-RL: 1e-4); the KL term is added on kept tokens, unweighted.
        acceptance: optional per-token acceptance rate, passed to the correction and metrics.
        mismatch: add :func:`~sparsecorr.mismatch.mismatch_metrics` (``mismatch/*``) when
            ``rollout_logp`` is given (about two loss-passes of extra time: turn off on steps
            that are not logged).
        mismatch_quantiles: log-ratio quantiles to report (each one sorts the batch: off by
            default in the training step).
        validate: check shapes and dtypes (set False in a hot loop once inputs are trusted).

    Returns:
        ``LossOutput(loss, token_loss, metrics, mask)``; metrics: ``loss/*`` (clip fractions
        low/high/dual, ratio mean/min/max, ``ppo_kl_k1_mean``, ``kl_ref_k3_mean``, ``tokens``,
        ``sequences``, ``weight_mean``, ``nonfinite_rollout``), ``correction/*`` and
        ``mismatch/*`` when a rollout is given.

    Shapes:
        logp, old_logp, rollout_logp, ref_logp, acceptance, mask: ``[B, T]``;
        advantages: ``[B]`` or ``[B, T]`` -> loss ``[]``, token_loss/mask ``[B, T]``.
    """
    _check_hparams(clip_low, clip_high, dual_clip, ratio_level, aggregation, kl_coef, ref_logp)
    if correction is not None and rollout_logp is None:
        raise ValueError("rollout_logp: expected the sparse sampler's [B, T] log-probs when a "
                         "correction is given, got None (a correction cannot act without them)")
    if validate:
        _check_inputs(logp, old_logp, advantages, mask, rollout_logp, ref_logp)
    metrics: dict[str, torch.Tensor] = {}
    kept, weights = mask, None
    if rollout_logp is not None:
        finite = _finite(rollout_logp)
        metrics["loss/nonfinite_rollout"] = count(mask & ~finite)
        kept = mask & finite
        if correction is not None:
            corr = _apply_correction(correction, logp, old_logp, rollout_logp, mask, advantages,
                                     acceptance)
            kept = kept & corr.mask
            weights = torch.where(kept, corr.weights.detach().float(), 0.0)
            metrics.update(corr.metrics)
        if mismatch:
            metrics.update(mismatch_metrics(old_logp, rollout_logp, mask, acceptance=acceptance,
                                            quantiles=tuple(mismatch_quantiles)))
    adv = advantages.float()
    adv = adv[:, None] if adv.dim() == 1 else torch.where(kept, adv, 0.0)
    scales = row_scales(kept, mode=aggregation, num_tokens=num_tokens, num_sequences=num_sequences,
                        norm_length=norm_length)
    surrogate = clipped_surrogate if ratio_level == "token" else _sequence_surrogate
    sur = surrogate(logp, old_logp, kept, adv, weights, scales, clip_low=clip_low,
                    clip_high=clip_high, dual_clip=dual_clip)
    token_loss, loss = sur.token_loss, sur.loss
    with torch.no_grad():
        n = count(kept)
        n1 = n.clamp(min=1.0)
        metrics.update(_clip_metrics(sur, adv, n=n1, dual_clip=dual_clip))
        metrics.update(_ratio_stats(sur, kept, n))
        metrics["loss/ppo_kl_k1_mean"] = -sur.log_ratio_sum / n1
        metrics["loss/tokens"] = n
        metrics["loss/sequences"] = count(kept.any(dim=1))
        metrics["loss/weight_mean"] = n / n1 if weights is None else weights.sum() / n1
        metrics["loss/pg_loss"] = loss.detach()
    if ref_logp is not None:
        d = torch.where(kept, ref_logp.float() - logp.float(), 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.expm1(d) - d
        metrics["loss/kl_ref_k3_mean"] = k3.detach().sum() / n1
        if kl_coef > 0:
            token_loss = token_loss + kl_coef * k3
            loss = loss + kl_coef * (k3.sum(dim=1) * scales).sum()
    metrics["loss/loss"] = loss.detach()
    return LossOutput(loss=loss, token_loss=token_loss,
                      metrics={k: v.detach().float().reshape(()) for k, v in metrics.items()}, mask=kept)
