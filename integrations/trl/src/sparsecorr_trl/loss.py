r"""TRL 1.16's GRPO loss written with ``sparsecorr.losses.sparse_grpo``.

Every ``loss_type`` SparseGRPOTrainer accepts is a ``sparse_grpo`` surrogate and aggregation
(TRL ``GRPOTrainer._compute_loss``):

\[
\ell_{i,t} = w_{i,t}\, f_{i,t}\, s(\rho_{i,t}, A_i) \;+\; \beta\, k_3(\pi_\text{ref}\,\|\,\pi_\theta)_{i,t}\,[\rho_{i,t}]
\]

with \(\rho = \pi_\theta/\pi_\text{old}\) (one length-normalised ratio per row with
``importance_sampling_level="sequence"``: GSPO), \(s\) the surrogate (``PPOClip`` for the PPO
types, ``CISPO(cap=epsilon_high)``, ``SAPO(sapo_temperature_pos, sapo_temperature_neg)``,
``VESPO(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)``),
\(w\) the sparsecorr correction's detached weight (1 without a correction), \(f \in \{0, 1\}\)
TRL's entropy mask (``top_entropy_quantile``) times its off-policy sequence mask
(``off_policy_mask_threshold``, OPSM: DeepSeek-V3.2), which zero a token's loss but keep it in
the denominator, and the bracketed \(\rho\) present with ``use_bias_correction_kl`` (with its
gradient; ``KLPenalty(bias_correction=True)``). \(f\) multiplies the advantage, which gives the
same value and gradient for every surrogate (each is linear in \(A\) once the sign of \(A\) has
picked its branch, and a zeroed term has no gradient). For \(\delta > 1 + \varepsilon_h\)
TRL's two-sided clip is ``PPOClip``'s dual clip (Ye et al. 2020): for \(A<0\) the term is
\(A\,\mathrm{clamp}(\rho, 1-\varepsilon_l, \delta)\). The scalar (`aggregation`):

| ``loss_type`` | surrogate | aggregation | counts | divided by |
|---|---|---|---|---|
| ``grpo``, ``sapo`` | PPO, SAPO | ``seq-mean-token-mean`` | \(S = B\) (empty rows count 0) | GA |
| ``bnpo`` | PPO | ``token-mean`` | \(N\) = this micro-batch's tokens | GA |
| ``dr_grpo`` | PPO | ``seq-mean-token-sum-norm`` | \(S = B\), \(L\) = ``max_completion_length`` | GA |
| ``dapo``, ``cispo`` | PPO, CISPO | ``token-mean`` | \(N\) = ``num_items_in_batch`` / processes x GA / ``steps_per_generation`` | 1 |
| ``luspo`` | PPO | ``seq-mean-token-sum`` | \(S = B\) | GA |
| ``vespo`` | VESPO | ``token-mean`` | as ``dapo`` | 1 |

``num_items_in_batch`` counts the loss tokens of the whole generation batch over all processes
(after the correction's rejections, when one is set), so ``dapo`` divides every micro-batch by
the token count of its accumulation window, global and not local: under data parallelism,
where gradients are averaged over processes, the per-process losses then add up to the loss of
the whole batch. In evaluation there is no accumulation: the divisor is 1 and the ``dapo``
count is ``num_items_in_batch`` / processes.

Shapes:
    logp, old_logp, ref_logp, mask, factor: ``[B, T]`` (factor may be ``[B, 1]``);
    advantages ``[B]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sparsecorr.losses import CISPO, GSPO, SAPO, VESPO, Aggregation, KLPenalty, PPOClip, sparse_grpo

#: TRL ``loss_type`` -> (sparsecorr aggregation, divided by the accumulation steps)
AGGREGATION_BY_LOSS_TYPE = {
    "grpo": ("seq-mean-token-mean", True),
    "sapo": ("seq-mean-token-mean", True),
    "bnpo": ("token-mean", True),
    "dr_grpo": ("seq-mean-token-sum-norm", True),
    "dapo": ("token-mean", False),
    "cispo": ("token-mean", False),
    "luspo": ("seq-mean-token-sum", True),
    "vespo": ("token-mean", False),
}
#: loss types whose surrogate is the clipped PPO ratio (TRL logs ``clip_ratio/*`` for them)
PPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

__all__ = ["AGGREGATION_BY_LOSS_TYPE", "PPO_LOSS_TYPES", "LossParts", "LossSpec", "aggregation",
           "trl_loss"]


@dataclass(frozen=True)
class LossSpec:
    """The loss settings of a ``GRPOConfig`` (read once, at init).

    Attributes:
        loss_type: TRL's ``loss_type`` (a key of ``AGGREGATION_BY_LOSS_TYPE``).
        clip_low: ``epsilon``.
        clip_high: ``epsilon_high`` (``epsilon`` when unset); CISPO's cap.
        delta: TRL's two-sided clip (``None``: off); ``PPOClip``'s dual clip.
        ratio_level: ``importance_sampling_level``.
        beta: the KL coefficient.
        bias_correction_kl: ``use_bias_correction_kl``.
        max_completion_length: the ``dr_grpo`` length.
        sapo_temperatures: ``(sapo_temperature_pos, sapo_temperature_neg)``.
        vespo: ``(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)``.
    """

    loss_type: str
    clip_low: float
    clip_high: float
    delta: float | None
    ratio_level: str
    beta: float
    bias_correction_kl: bool
    max_completion_length: int
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)

    @classmethod
    def from_args(cls, args) -> LossSpec:
        high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        return cls(loss_type=args.loss_type, clip_low=float(args.epsilon), clip_high=float(high),
                   delta=None if args.delta is None else float(args.delta),
                   ratio_level=args.importance_sampling_level, beta=float(args.beta),
                   bias_correction_kl=bool(args.use_bias_correction_kl),
                   max_completion_length=int(args.max_completion_length),
                   sapo_temperatures=(float(args.sapo_temperature_pos),
                                      float(args.sapo_temperature_neg)),
                   vespo=(float(args.vespo_k_pos), float(args.vespo_lambda_pos),
                          float(args.vespo_k_neg), float(args.vespo_lambda_neg)))

    def surrogate(self):
        """The ``sparse_grpo`` surrogate object of this loss type."""
        if self.loss_type == "cispo":
            return CISPO(cap=self.clip_high)
        if self.loss_type == "vespo":
            k_pos, lambda_pos, k_neg, lambda_neg = self.vespo
            return VESPO(k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg)
        if self.loss_type == "sapo":
            return SAPO(temperature_pos=self.sapo_temperatures[0],
                        temperature_neg=self.sapo_temperatures[1])
        cls = GSPO if self.ratio_level == "sequence" else PPOClip
        return cls(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.delta)

    @property
    def ppo(self) -> bool:
        return self.loss_type in PPO_LOSS_TYPES


def aggregation(spec: LossSpec, *, mask: torch.Tensor, num_items_in_batch: torch.Tensor | None,
                num_processes: int, grad_accum: int, steps_per_generation: int,
                train: bool) -> tuple[Aggregation, float]:
    """The ``Aggregation`` of ``spec.loss_type`` for one micro-batch, and what the result is
    divided by (module table).

    Args:
        mask: the micro-batch's loss mask.
        num_items_in_batch: loss tokens of the whole generation batch, all processes (read by
            ``dapo`` and ``cispo`` only).
        num_processes: data-parallel processes.
        grad_accum: the accumulation steps of this optimizer step.
        steps_per_generation: micro-batches per generation batch.
        train: False in evaluation (no accumulation, no window).

    Shapes:
        mask: ``[B, T]``; num_items_in_batch: ``[]``.
    """
    mode, by_accum = AGGREGATION_BY_LOSS_TYPE[spec.loss_type]
    divisor = float(grad_accum) if (by_accum and train) else 1.0
    if spec.loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_batch is None:
            raise ValueError("num_items_in_batch: expected the generation batch's token count "
                             f"with loss_type={spec.loss_type!r}, got None")
        n = num_items_in_batch.float().clamp(min=1.0) / num_processes
        if train:
            n = n * grad_accum / steps_per_generation
        return Aggregation(mode, num_tokens=n), divisor
    if spec.loss_type == "bnpo":
        return Aggregation(mode), divisor
    length = float(spec.max_completion_length) if spec.loss_type == "dr_grpo" else None
    return Aggregation(mode, num_sequences=float(mask.shape[0]), norm_length=length), divisor


@dataclass(frozen=True)
class LossParts:
    """What `trl_loss` returns.

    Attributes:
        loss: the scalar to backpropagate (divided by the accumulation steps where TRL does).
        policy_loss: the same before that division (TRL's ``policy_loss`` metric), detached.
        ratio: detached \\(\\rho\\) as TRL's metrics read it (``[B, T]``, or ``[B, 1]`` per
            sequence), after the ``delta`` clamp.
        per_token_kl: detached \\(k_3\\) (times \\(\\rho\\) with bias correction) where the
            loss applies it, or None without a KL term.
        metrics: ``sparse_grpo``'s ``loss/*`` metrics (and ``mismatch/*`` without a
            correction).
        sums: their 0-d sums and counts (TRL's ``vespo/phi_seq_mean`` is reduced from them).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    ratio: torch.Tensor
    per_token_kl: torch.Tensor | None
    metrics: dict[str, torch.Tensor]
    sums: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def trl_loss(spec: LossSpec, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, agg: Aggregation, divisor: float,
             factor: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
             mismatch=None, correction=None) -> LossParts:
    """TRL's loss for ``spec`` (module docstring) on one micro-batch.

    Args:
        logp: learner log-probs (carry the gradient).
        old_logp: dense log-probs with the rollout-time weights.
        advantages: per sequence.
        mask: bool loss mask (completion and tool mask).
        agg, divisor: from `aggregation`.
        factor: TRL's 0/1 entropy mask times OPSM, or None.
        ref_logp: reference log-probs (needed when ``spec.beta != 0``).
        mismatch: the rollout's ``Mismatch`` record (with ``correction``, or for its metrics).
        correction: a computed ``Correction`` (or a correction callable), or None.

    Shapes:
        logp, old_logp, mask, ref_logp: ``[B, T]``; advantages ``[B]``; factor ``[B, T]`` or
        ``[B, 1]``.
    """
    adv = advantages.float()
    if factor is not None:
        adv = (adv[:, None] if adv.dim() == 1 else adv) * factor.float()
    # KLPenalty's bias correction uses the surrogate's ratio: GSPO's sequence ratio, as TRL
    kl = 0.0 if spec.beta == 0.0 else KLPenalty(spec.beta, spec.bias_correction_kl)
    # the record's and the correction's metrics are logged once per generation batch, where
    # they were computed; a record built here (no correction) is reported with the loss
    out = sparse_grpo(logp, old_logp, adv, mask, mismatch=mismatch, correction=correction,
                      surrogate=spec.surrogate(), aggregation=agg,
                      ref_logp=ref_logp if spec.beta != 0.0 else None, kl=kl,
                      metrics="loss" if mismatch is None else "default")
    loss = out.loss
    ratio = out.ratio  # detached, the one the surrogate used (TRL's metrics read it)
    per_token_kl = out.kl  # the detached k3 term the loss used (times the ratio: bias correction)
    shown = ratio
    if spec.delta is not None and spec.ppo:  # TRL's metrics read the delta-clamped ratio
        shown = shown.clamp(max=spec.delta)
    metrics = {k: v for k, v in out.metrics.items() if k.startswith(("loss/", "mismatch/"))}
    return LossParts(loss=loss / divisor, policy_loss=loss.detach(), ratio=shown,
                     per_token_kl=per_token_kl, metrics=metrics, sums=out.sums)
