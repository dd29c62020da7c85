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

__all__ = ["entropy_bonus", "log_sparsecorr", "trl_metrics"]


def log_sparsecorr(trainer, metrics: dict) -> None:
    """Append ``metrics`` (0-d tensors or numbers) to the trainer's logged metrics as
    ``sparsecorr/<name>``. The tensors are read back to the host together: one transfer, not
    one per metric (TRL's own metrics make one each)."""
    mode = "train" if trainer.model.training else "eval"
    logged = trainer._metrics[mode]
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    read = {}
    if tensors:  # float64 holds every float32 value and every count exactly
        read = dict(zip(tensors, torch.stack([v.detach().reshape(()).double() for v in tensors.values()]).tolist()))
    for name, value in metrics.items():
        logged[f"sparsecorr/{name}"].append(float(read.get(name, value)))


def _global_mean(accelerator, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's ``global_masked_mean`` as a 0-d tensor (read back with the others)."""
    if x.shape[1] == 1:
        total, n = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
    else:
        total, n = (x * mask).sum(), mask.sum().float()
    totals = accelerator.reduce(torch.stack([total, n]), reduction="sum")
    return totals[0] / totals[1].clamp(min=1.0)


def _clip_fractions(accelerator, flags: torch.Tensor, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's global mean (``global_masked_mean``) and per-sequence means (``masked_seq_mean``)
    of each 0/1 indicator of ``flags``, from one row-sum pass and one reduction over processes.
    The sums are counts, exact in any order, so every value is the one TRL computes.

    Shapes:
        flags: ``[K, B, T]`` or ``[K, B, 1]`` (one value per sequence) -> ``[K]``, ``[K, B]``.
    """
    if flags.shape[-1] == 1:
        per_seq = flags[..., 0]  # [K, B]
        n = torch.tensor(float(flags.shape[1]), device=flags.device)
    else:
        per_seq = (flags * mask).sum(-1)  # [K, B] counts
        n = mask.sum().float()
    totals = accelerator.reduce(torch.cat([per_seq.sum(-1), n.reshape(1)]), reduction="sum")
    means = totals[:-1] / totals[-1].clamp(min=1.0)  # [K]
    if flags.shape[-1] != 1:
        per_seq = per_seq / mask.sum(-1)
    return means, per_seq


def _nan_extremes(x: torch.Tensor) -> torch.Tensor:
    """``[nanmin(x[:, 0]), nanmax(x[:, 1])]`` as TRL's ``nanmin`` / ``nanmax`` (NaN where every
    value is NaN), without reading anything back to the host.

    Shapes:
        x: ``[N, 2]`` -> ``[2]``.
    """
    if x.shape[0] == 0:
        return torch.full((2,), float("nan"), dtype=x.dtype, device=x.device)
    signed = x * torch.tensor([1.0, -1.0], dtype=x.dtype, device=x.device)  # max = -min(-x)
    missing = torch.isnan(signed)
    lowest = torch.where(missing, float("inf"), signed).amin(0)  # [2]
    lowest = torch.where(missing.all(0), float("nan"), lowest)
    return lowest * torch.tensor([1.0, -1.0], dtype=x.dtype, device=x.device)


def trl_metrics(accelerator, *, loss_type: str, ratio: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, entropies: torch.Tensor, per_token_kl: torch.Tensor | None,
                clip_low: float, clip_high: float,
                sums: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """TRL's ``kl``, ``entropy`` and ``clip_ratio/*`` for one micro-batch (module docstring).

    The values are TRL's; they are read back to the host together (one synchronisation, TRL
    makes one per metric), and the three clip fractions share one reduction over processes.

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
    names: list[str] = []
    values: list[torch.Tensor] = []  # 1-d pieces, read back together
    if per_token_kl is not None:
        names.append("kl")
        values.append(_global_mean(accelerator, per_token_kl, mask).reshape(1))
    names.append("entropy")
    values.append(_global_mean(accelerator, entropies, mask).reshape(1))
    if loss_type == "vespo":
        key = "loss/vespo_phi_seq_mean"
        totals = accelerator.reduce(torch.stack([sums[key], sums[key + "#n"]]).float(), reduction="sum")
        names.append("vespo/phi_seq_mean")
        values.append((totals[0] / totals[1].clamp(min=1.0)).reshape(1))
    elif loss_type == "cispo":
        clipped = ((ratio > clip_high) & (advantages > 0)).float()
        names.append("cispo_clip_ratio")
        values.append(_global_mean(accelerator, clipped, mask).reshape(1))
    elif loss_type not in ("sapo", "vespo"):
        low = (ratio < 1 - clip_low) & (advantages < 0)
        high = (ratio > 1 + clip_high) & (advantages > 0)
        flags = torch.stack([low, high, low | high]).float()  # [3, B, T] or [3, B, 1]
        means, per_seq = _clip_fractions(accelerator, flags, mask)
        gathered = accelerator.gather(per_seq[:2].T.contiguous())  # [B, 2] of every process
        names += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                  "clip_ratio/low_min", "clip_ratio/high_max"]
        values += [means, _nan_extremes(gathered)]
    return dict(zip(names, torch.cat(values).tolist()))


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
