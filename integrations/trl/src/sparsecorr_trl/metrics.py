r"""TRL 1.16's own loss-side metrics and entropy bonus, computed beside ``sparse_grpo``.

``SparseGRPOTrainer`` logs exactly the names and values ``GRPOTrainer._compute_loss`` logs, so
dashboards keep working when the trainer is swapped: ``entropy`` and ``kl`` (token means over
all processes), ``clip_ratio/{low,high,region}_mean`` (token means of
\(\rho < 1-\varepsilon_l \wedge A<0\), \(\rho > 1+\varepsilon_h \wedge A>0\), either),
``clip_ratio/low_min`` and ``clip_ratio/high_max`` (the min / max over all sequences of the
per-sequence fraction), ``policy_loss`` and ``entropy_coef`` (with an entropy bonus) and
``aux_loss`` (MoE), ``cispo_clip_ratio`` (``cispo``). sparsecorr's own metrics are logged beside them as ``sparsecorr/*``.

The entropy bonus is TRL's \(L = L_\text{policy} - c\,\bar H\) with \(\bar H\) the mean entropy
over the tokens the loss acts on (the entropy mask applied), divided by the accumulation
steps; with ``use_adaptive_entropy`` the coefficient follows TRL's controller (raised by
``entropy_coef_delta`` up to ``entropy_coef_max`` while the window-global entropy is at or below
``entropy_target``, lowered towards ``entropy_coef_min`` otherwise), using the trainer's own
state so TRL's checkpointing of it is unchanged.

Shapes:
    ratio, advantages-broadcast, mask, entropies, per_token_kl: ``[B, T]`` (ratio may be
    ``[B, 1]``: one per sequence).
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanmax, nanmin

__all__ = ["entropy_bonus", "trl_metrics"]


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)


def _global_mean(accelerator, x: torch.Tensor, mask: torch.Tensor) -> float:
    if x.shape[1] == 1:
        total, n = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
    else:
        total, n = (x * mask).sum(), mask.sum().float()
    totals = accelerator.reduce(torch.stack([total, n]), reduction="sum")
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def trl_metrics(accelerator, *, loss_type: str, ratio: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, entropies: torch.Tensor, per_token_kl: torch.Tensor | None,
                clip_low: float, clip_high: float,
                sums: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """TRL's ``kl``, ``entropy`` and ``clip_ratio/*`` for one micro-batch (module docstring).

    Args:
        accelerator: the trainer's ``accelerate.Accelerator`` (reduces over processes).
        loss_type: TRL's ``loss_type`` (``clip_ratio/*`` for the PPO types, ``cispo_clip_ratio``
            for ``cispo``, nothing more for ``sapo``).
        ratio: detached \\(\\rho\\) (after TRL's ``delta`` clamp).
        advantages: ``[B, 1]`` advantages as the loss saw them before any masking.
        mask: float loss mask.
        entropies: per-token entropies.
        per_token_kl: the detached KL term, or None without a reference model.
        clip_low, clip_high: \\(\\varepsilon_l, \\varepsilon_h\\).
        sums: ``sparse_grpo``'s metric sums (``vespo`` reads its per-sequence gamma weights'
            sum and count there instead of recomputing them).

    Shapes:
        ratio: ``[B, T]`` or ``[B, 1]``; advantages ``[B, 1]``; others ``[B, T]``.
    """
    out: dict[str, float] = {}
    if per_token_kl is not None:
        out["kl"] = _global_mean(accelerator, per_token_kl, mask)
    out["entropy"] = _global_mean(accelerator, entropies, mask)
    if loss_type == "vespo":
        key = "loss/vespo_phi_seq_mean"
        totals = accelerator.reduce(torch.stack([sums[key], sums[key + "#n"]]).float(), reduction="sum")
        out["vespo/phi_seq_mean"] = (totals[0] / totals[1].clamp(min=1.0)).item()
    elif loss_type == "cispo":
        clipped = ((ratio > clip_high) & (advantages > 0)).float()
        out["cispo_clip_ratio"] = _global_mean(accelerator, clipped, mask)
    elif loss_type not in ("sapo", "vespo"):
        low = ((ratio < 1 - clip_low) & (advantages < 0)).float()
        high = ((ratio > 1 + clip_high) & (advantages > 0)).float()
        out["clip_ratio/low_mean"] = _global_mean(accelerator, low, mask)
        out["clip_ratio/high_mean"] = _global_mean(accelerator, high, mask)
        out["clip_ratio/region_mean"] = _global_mean(accelerator, torch.maximum(low, high), mask)
        out["clip_ratio/low_min"] = nanmin(accelerator.gather(_seq_mean(low, mask))).item()
        out["clip_ratio/high_max"] = nanmax(accelerator.gather(_seq_mean(high, mask))).item()
    return out


def entropy_bonus(trainer, entropies: torch.Tensor, mask: torch.Tensor, *, train: bool,
                  grad_accum: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The term to subtract from the loss, and the ``entropy_coef`` metric on step boundaries.

    Reads and updates ``trainer.entropy_coef``, ``trainer._last_world_entropy`` and
    ``trainer._entropy_window_stats`` exactly as TRL's ``GRPOTrainer`` does.

    Args:
        trainer: the ``GRPOTrainer``.
        entropies: per-token entropies (carry the gradient).
        mask: float mask of the tokens the loss acts on (entropy mask applied).
        train: False in evaluation (no accumulation, no controller update).
        grad_accum: the accumulation steps of this optimizer step.

    Shapes:
        entropies, mask: ``[B, T]`` -> ``[]``.
    """
    args = trainer.args
    accumulation = grad_accum if train else 1.0
    mean_entropy = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    if trainer.use_adaptive_entropy:
        coef = trainer.entropy_coef if trainer._last_world_entropy <= args.entropy_target else 0.0
    else:
        coef = trainer.entropy_coef
    term = coef * mean_entropy
    if trainer.use_adaptive_entropy and train:
        stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
        window = trainer._entropy_window_stats
        trainer._entropy_window_stats = stats if window is None else window + stats
        if trainer.accelerator.sync_gradients:
            totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            world = (totals[0] / totals[1].clamp(min=1.0)).item()
            if world <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta,
                                           args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta,
                                           args.entropy_coef_min)
            trainer._last_world_entropy = world
            trainer._entropy_window_stats = None
    logged = {}
    if train and trainer.accelerator.sync_gradients:
        logged["entropy_coef"] = trainer.entropy_coef
    return term, logged
