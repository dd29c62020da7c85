r"""Group-relative advantages (GRPO, Shao et al. 2024; Dr. GRPO, Liu et al. 2025).

Rewards of the \(G\) rollouts of one prompt are consecutive in the batch. For a group with valid
members \(V\) (rollouts not rejected as a whole):

\[
A_i = \frac{R_i - \bar R_V}{\sigma_V + \varepsilon}\ (\texttt{normalize="std"}), \qquad
A_i = R_i - \bar R_V\ (\texttt{normalize="none"}, \text{Dr. GRPO}),
\]

with \(\bar R_V\) the mean and \(\sigma_V\) the unbiased (Bessel, as in TRL) standard deviation
over \(V\) (0 when \(|V| \le 1\)). Invalid rollouts get \(A_i = 0\) and do not move their group's
statistics, so a sequence vetoed by the correction (``Correction.sequence_mask``) cannot shift
the advantages of its siblings (shared/METHODS.md §5, verl #6362). A rollout whose reward is NaN
or ±inf leaves its group the same way and gets \(A_i = \text{NaN}\), so that
[`sparse_grpo`][sparsecorr.losses.sparse_grpo] drops it from the loss and counts it
(``loss/nonfinite_advantage_seqs``) instead of training on a made-up advantage.
"""

from __future__ import annotations

import torch

from .._checks import check_choice, check_float_tensor, check_positive, finite

__all__ = ["group_advantages"]


def group_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int,
    normalize: str = "std",
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-normalised advantages of consecutive groups of ``group_size`` rollouts.

    Args:
        rewards: one scalar reward per rollout, groups consecutive.
        group_size: \\(G\\), rollouts per prompt; ``B`` must be a multiple of it.
        normalize: ``"std"`` (GRPO) or ``"none"`` (Dr. GRPO: centre only).
        eps: added to the standard deviation.
        valid: optional bool, False = rollout rejected whole: advantage 0, left out of the
            group's mean and standard deviation. Typically ``correction.sequence_mask``.

    Returns:
        float32 advantages, 0 for invalid rollouts, NaN for rollouts with a non-finite reward
        (the rest of their group is unaffected).

    Shapes:
        rewards, valid: ``[B]`` -> ``[B]``.
    """
    check_float_tensor("rewards", rewards, ndim=1)
    check_choice("normalize", normalize, ("std", "none"))
    check_positive("eps", eps, allow_zero=True)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size: expected a positive int dividing B={rewards.shape[0]}, "
                         f"got {group_size!r}")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.shape != rewards.shape:
        raise ValueError(f"valid: expected a bool tensor of shape {tuple(rewards.shape)}, got "
                         f"{getattr(valid, 'dtype', type(valid))} {tuple(getattr(valid, 'shape', ()))}")
    ok = finite(rewards.float())
    valid = valid & ok
    r = torch.where(valid, rewards.float(), 0.0).reshape(-1, group_size)
    v = valid.reshape(-1, group_size).float()
    n = v.sum(dim=1, keepdim=True)
    mean = r.sum(dim=1, keepdim=True) / n.clamp(min=1.0)
    centred = (r - mean) * v
    adv = centred
    if normalize == "std":
        var = centred.square().sum(dim=1, keepdim=True) / (n - 1.0).clamp(min=1.0)
        adv = centred / (var.sqrt() + eps)
    adv = adv.reshape(-1) * valid.float()
    return torch.where(ok, adv, float("nan"))
