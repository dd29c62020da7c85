r"""TRL 1.16's GRPO loss written with ``sparsecorr.losses.sparse_grpo``.

Every ``loss_type`` SparseGRPOTrainer accepts is one aggregation of the same per-token term
(TRL ``GRPOTrainer._compute_loss``):

\[
\ell_{i,t} = -\,w_{i,t}\,f_{i,t}\,\min\big(\min(\rho_{i,t}, \delta) A_i,\
\mathrm{clip}(\rho_{i,t}, 1-\varepsilon_l, 1+\varepsilon_h) A_i\big)
\;+\; \beta\, k_3(\pi_\text{ref}\,\|\,\pi_\theta)_{i,t}\,[\rho_{i,t}]
\]

with \(\rho = \pi_\theta/\pi_\text{old}\) (one length-normalised ratio per row with
``importance_sampling_level="sequence"``, GSPO), \(w\) the sparsecorr correction's detached
weight, \(f \in \{0, 1\}\) TRL's entropy mask (``top_entropy_quantile``) times its off-policy
sequence mask (``off_policy_mask_threshold``, OPSM: DeepSeek-V3.2), which zero a token's loss
but keep it in the denominator, and the bracketed factor \(\rho\) present with
``use_bias_correction_kl`` (it carries gradient). For \(\delta > 1 + \varepsilon_h\) TRL's
two-sided clip is the dual clip of ``sparse_grpo`` (Ye et al. 2020): for \(A<0\) the term is
\(A\,\mathrm{clamp}(\rho, 1-\varepsilon_l, \delta)\), for \(A \ge 0\) it is unchanged; the
factor \(f\) is applied by zeroing the token's advantage, which gives the same value and
gradient. The scalar (``window_counts``):

| ``loss_type`` | aggregation | counts | divided by |
|---|---|---|---|
| ``grpo`` | ``seq-mean-token-mean`` | \(S = B\) (empty rows count 0) | GA |
| ``bnpo`` | ``token-mean`` | \(N\) = this micro-batch's tokens | GA |
| ``dr_grpo`` | ``seq-mean-token-sum-norm`` | \(S = B\), \(L\) = ``max_completion_length`` | GA |
| ``dapo`` | ``token-mean`` | \(N\) = ``num_items_in_batch`` / processes x GA / ``steps_per_generation`` | 1 |
| ``luspo`` | ``seq-mean-token-sum`` | \(S = B\) | GA |

``num_items_in_batch`` counts the loss tokens of the whole generation batch over all processes,
so ``dapo`` divides every micro-batch by the token count of its accumulation window (global,
not local): under data parallelism, where gradients are averaged over processes, the
per-process losses then add up to the loss of the whole batch. In evaluation there is no
accumulation: the divisor is 1 and the ``dapo`` count is ``num_items_in_batch`` / processes.

Shapes:
    logp, old_logp, ref_logp, rollout_logp, mask, factor: ``[B, T]``; advantages ``[B]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsecorr.losses import aggregation_coefficients, sparse_grpo
from sparsecorr.mismatch import LOG_RATIO_CLAMP

#: TRL ``loss_type`` -> (sparsecorr aggregation, divided by the accumulation steps)
AGGREGATION_BY_LOSS_TYPE = {
    "grpo": ("seq-mean-token-mean", True),
    "bnpo": ("token-mean", True),
    "dr_grpo": ("seq-mean-token-sum-norm", True),
    "dapo": ("token-mean", False),
    "luspo": ("seq-mean-token-sum", True),
}

__all__ = ["AGGREGATION_BY_LOSS_TYPE", "LossParts", "LossSpec", "trl_loss", "window_counts"]


@dataclass(frozen=True)
class LossSpec:
    """The loss settings of a ``GRPOConfig`` (read once, at init).

    Attributes:
        loss_type: TRL's ``loss_type`` (a key of ``AGGREGATION_BY_LOSS_TYPE``).
        clip_low: ``epsilon``.
        clip_high: ``epsilon_high`` (``epsilon`` when unset).
        delta: TRL's two-sided clip (``None``: off); the dual clip of ``sparse_grpo``.
        ratio_level: ``importance_sampling_level``.
        beta: the KL coefficient.
        bias_correction_kl: ``use_bias_correction_kl``.
        max_completion_length: the ``dr_grpo`` length.
    """

    loss_type: str
    clip_low: float
    clip_high: float
    delta: float | None
    ratio_level: str
    beta: float
    bias_correction_kl: bool
    max_completion_length: int

    @classmethod
    def from_args(cls, args) -> LossSpec:
        high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        return cls(loss_type=args.loss_type, clip_low=float(args.epsilon), clip_high=float(high),
                   delta=None if args.delta is None else float(args.delta),
                   ratio_level=args.importance_sampling_level, beta=float(args.beta),
                   bias_correction_kl=bool(args.use_bias_correction_kl),
                   max_completion_length=int(args.max_completion_length))


@dataclass(frozen=True)
class WindowCounts:
    """Counts that turn the per-token terms into TRL's scalar (see the module table)."""

    aggregation: str
    num_tokens: torch.Tensor | None
    num_sequences: float | None
    norm_length: float | None
    divisor: float


def window_counts(spec: LossSpec, *, mask: torch.Tensor, num_items_in_batch: torch.Tensor | None,
                  num_processes: int, grad_accum: int, steps_per_generation: int,
                  train: bool) -> WindowCounts:
    """The aggregation and counts of ``spec.loss_type`` for one micro-batch (module table).

    Args:
        mask: the micro-batch's loss mask (after any rejection).
        num_items_in_batch: loss tokens of the whole generation batch, all processes (read
            by ``dapo`` only).
        num_processes: data-parallel processes.
        grad_accum: the accumulation steps of this optimizer step.
        steps_per_generation: micro-batches per generation batch.
        train: False in evaluation (no accumulation, no window).

    Shapes:
        mask: ``[B, T]``; num_items_in_batch: ``[]``.
    """
    mode, by_accum = AGGREGATION_BY_LOSS_TYPE[spec.loss_type]
    divisor = float(grad_accum) if (by_accum and train) else 1.0
    b = float(mask.shape[0])
    if spec.loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("num_items_in_batch: expected the generation batch's token count "
                             "with loss_type='dapo', got None")
        n = num_items_in_batch.float().clamp(min=1.0) / num_processes
        if train:
            n = n * grad_accum / steps_per_generation
        return WindowCounts(mode, n, None, None, divisor)
    if spec.loss_type == "bnpo":
        return WindowCounts(mode, None, None, None, divisor)
    length = float(spec.max_completion_length) if spec.loss_type == "dr_grpo" else None
    return WindowCounts(mode, None, b, length, divisor)


@dataclass(frozen=True)
class LossParts:
    """What :func:`trl_loss` returns.

    Attributes:
        loss: the scalar to backpropagate (divided by the accumulation steps where TRL does).
        policy_loss: the same before that division (TRL's ``policy_loss`` metric), detached.
        ratio: detached \\(\\rho\\) as TRL's metrics read it (``[B, T]`` or ``[B, 1]``), after
            the ``delta`` clamp.
        per_token_kl: detached \\(k_3\\) (times \\(\\rho\\) with bias correction), or None.
        metrics: ``sparse_grpo``'s metrics.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    ratio: torch.Tensor
    per_token_kl: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


def _ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """\\(\\rho\\) with gradient: per token, or \\(\\exp\\) of the row's mean log-ratio ``[B, 1]``."""
    log_ratio = torch.where(mask, logp - old_logp, 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _kl_term(spec: LossSpec, logp, ref_logp, ratio, coef, mask):
    """\\(\\beta\\sum c\\,k_3\\,[\\rho]\\) with gradient, and the detached per-token \\(k_3[\\rho]\\)."""
    d = torch.where(mask, ref_logp - logp, 0.0)
    kl = torch.exp(d) - d - 1
    if spec.bias_correction_kl:
        kl = kl * ratio
    kl = torch.where(mask, kl, 0.0)
    return spec.beta * (coef * kl).sum(), kl.detach()


def trl_loss(spec: LossSpec, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, counts: WindowCounts, factor: torch.Tensor | None = None,
             ref_logp: torch.Tensor | None = None, rollout_logp: torch.Tensor | None = None,
             correction=None) -> LossParts:
    """TRL's loss for ``spec`` (module docstring) on one micro-batch.

    Args:
        logp: learner log-probs (carry the gradient).
        old_logp: dense log-probs with the rollout-time weights.
        advantages: per sequence.
        mask: bool loss mask (completion and tool mask).
        counts: from :func:`window_counts`.
        factor: TRL's 0/1 entropy mask times OPSM (``[B, T]`` or ``[B, 1]``), or None.
        ref_logp: reference log-probs (needed when ``spec.beta != 0``).
        rollout_logp: the sampler's log-probs (with ``correction``).
        correction: a sparsecorr correction (callable or computed ``Correction``), or None.

    Shapes:
        logp, old_logp, mask, ref_logp, rollout_logp: ``[B, T]``; advantages ``[B]``.
    """
    adv = advantages.float()
    if factor is not None:
        adv = adv[:, None] * factor.float()
    dual = spec.delta
    out = sparse_grpo(
        logp, old_logp, adv, mask, rollout_logp=rollout_logp, correction=correction,
        clip_low=spec.clip_low, clip_high=spec.clip_high, dual_clip=dual,
        ratio_level=spec.ratio_level, aggregation=counts.aggregation,
        num_tokens=counts.num_tokens, num_sequences=counts.num_sequences,
        norm_length=counts.norm_length)
    kept = out.mask
    loss = out.loss
    ratio = _ratio(logp, old_logp, kept, spec.ratio_level)
    per_token_kl = None
    if spec.beta != 0.0:
        if ref_logp is None:
            raise ValueError("ref_logp: expected the reference log-probs with beta != 0, got None")
        coef = aggregation_coefficients(kept, mode=counts.aggregation, num_tokens=counts.num_tokens,
                                        num_sequences=counts.num_sequences,
                                        norm_length=counts.norm_length)
        kl_loss, per_token_kl = _kl_term(spec, logp, ref_logp, ratio, coef, kept)
        loss = loss + kl_loss
    shown = ratio.detach() if dual is None else ratio.detach().clamp(max=dual)
    return LossParts(loss=loss / counts.divisor, policy_loss=loss.detach(), ratio=shown,
                     per_token_kl=per_token_kl, metrics=out.metrics)
