r"""The advantage estimator ``algorithm.adv_estimator=sparsecorr_grpo``: verl's GRPO with the
rollouts the correction rejected whole left out of their group's mean and standard deviation.

verl 0.9.1's ``compute_grpo_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``) sums
``token_level_rewards`` per row and normalises it within the rows of the same ``uid`` with no
mask, so a rollout that the rollout correction vetoed whole (every token out of
``response_mask``) still moves its group's baseline and scale (verl#6375, reopened by the open
fix verl#6452). sparsecorr's `group_advantages(valid=...)` leaves such rows out
(shared/METHODS.md §5: "rejected sequences still producing advantages", verl#6362); this
estimator is that computation on verl's inputs.

**Which rows are vetoed.** verl calls a registered estimator as ``fn(token_level_rewards=...,
response_mask=..., config=algorithm_config, index=uid)`` (``ray_trainer.py::compute_advantage``,
the ``else`` branch) and hands it no other batch key. Both verl trainers run the rollout
correction *before* the advantage, on the same batch (``RayPPOTrainer.fit``;
``v1/trainer_base.py::_compute_advantage``), and sparsecorr's correction
(`sparsecorr_verl.correction.rollout_correction`) writes its rejection into ``response_mask``.
So a row vetoed whole arrives with an all-zero ``response_mask``, and

\[
\text{valid}_i = \bigvee_t \text{response\_mask}_{i,t}
\]

is exactly the correction's ``Correction.sequence_mask`` (the rows that keep a token). A row
that had no response token to begin with is left out too (it trains nothing either way); verl's
own rejection (``rollout_rs``) also writes ``response_mask``, so its whole-row vetoes leave the
statistics the same way.

**The computation.** Per ``uid`` group \(g\) with valid rows \(V_g\), \(R_i = \sum_t r_{i,t}\):

\[
A_i = \frac{R_i - \bar R_{V_g}}{\mathrm{std}(R_{V_g}) + \epsilon}\ (i \in V_g),
\qquad A_i = 0\ (i \notin V_g),
\]

with Bessel's standard deviation and ``epsilon = 1e-6`` as verl, no division when
``algorithm.norm_adv_by_std_in_grpo=false`` (Dr. GRPO), and the advantage broadcast over the
response and multiplied by ``response_mask``: ``(advantages, returns)``, both the same tensor, as
verl returns them. With no row vetoed the result is verl's GRPO on every row (tested against
verl's own function), including verl's rule for a group of one row (mean 0, std 1: the
advantage is the reward over ``1 + epsilon``). Differences, on purpose: a group whose valid rows
are one gets advantage 0 for it (its own reward is its baseline: `group_advantages`), not
verl's single-row rule; a row with a non-finite reward gets NaN and leaves its group's
statistics (verl's NaN spreads to the whole group).

**Limits.** The grouping is by ``uid`` only. verl's v1 trainer with multi-turn agent sessions
(``compute_advantage_for_multi_trajectories``) uses only each session's final output for its
*own* ``grpo``; for any other estimator, this one included, it scores every row. With one output
per session (single-turn rollouts) the two agree.

Shapes:
    token_level_rewards, response_mask ``[B, T]``; index ``[B]`` (any hashable ids, verl's
    ``uid``) -> advantages, returns ``[B, T]`` float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sparsecorr.losses import group_advantages

__all__ = ["ADV_ESTIMATOR", "compute_sparsecorr_grpo_advantage", "group_layout"]

ADV_ESTIMATOR = "sparsecorr_grpo"


def group_layout(index: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each row's group (by first appearance of its id) and its place in the group, and the
    largest group's size: the padded ``[groups, size]`` layout `group_advantages` reads.

    Returns:
        ``(group, place, size)``: CPU long ``[B]`` each, and an int.
    """
    ids: dict[Any, int] = {}
    seen: list[int] = []
    group, place = [], []
    for u in np.asarray(index, dtype=object).reshape(-1).tolist():
        g = ids.setdefault(u, len(ids))
        if g == len(seen):
            seen.append(0)
        group.append(g)
        place.append(seen[g])
        seen[g] += 1
    return torch.tensor(group, dtype=torch.long), torch.tensor(place, dtype=torch.long), max(seen, default=1)


def _norm_by_std(config: Any, given: bool | None) -> bool:
    if given is not None:
        return bool(given)
    if config is None:
        return True
    value = config.get("norm_adv_by_std_in_grpo", True) if hasattr(config, "get") else \
        getattr(config, "norm_adv_by_std_in_grpo", True)
    return bool(value)


def compute_sparsecorr_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO advantage with whole-row vetoes left out of the group statistics (module
    docstring); registered as ``algorithm.adv_estimator=sparsecorr_grpo``.

    Args (verl's): ``token_level_rewards`` and ``response_mask`` (after the rollout correction),
        ``index`` (the ``uid`` of each row), ``epsilon`` (added to the std),
        ``norm_adv_by_std_in_grpo`` (None: ``config.norm_adv_by_std_in_grpo``, default True),
        ``config`` (verl's ``algorithm`` config).

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` float32 tensor twice (as verl's GRPO).

    Raises:
        ValueError: no ``index`` (verl passes it when the batch has ``uid``), or shapes that do
            not match.
    """
    if index is None:
        raise ValueError("index: expected the uid of each row (verl passes non_tensor_batch['uid']), got None")
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2 or \
            not isinstance(response_mask, torch.Tensor) or response_mask.shape != token_level_rewards.shape:
        raise ValueError(f"token_level_rewards, response_mask: expected two tensors of one shape [B, T], got "
                         f"{tuple(getattr(token_level_rewards, 'shape', ()))} and "
                         f"{tuple(getattr(response_mask, 'shape', ()))}")
    b = token_level_rewards.shape[0]
    group, place, size = group_layout(index)
    if group.numel() != b:
        raise ValueError(f"index: expected one id per row ({b}), got {group.numel()}")
    dev = token_level_rewards.device
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).float()
        valid = response_mask.bool().any(dim=-1)
        slot = (group * size + place).to(dev)
        n_slots = (int(group.max()) + 1) * size if b else 0
        rewards = torch.zeros(n_slots, dtype=torch.float32, device=dev).index_put((slot,), scores)
        keep = torch.zeros(n_slots, dtype=torch.bool, device=dev).index_put((slot,), valid)
        normalize = "std" if _norm_by_std(config, norm_adv_by_std_in_grpo) else "none"
        adv = group_advantages(rewards, group_size=size, normalize=normalize, eps=float(epsilon),
                               valid=keep)[slot] if b else scores
        # verl's rule for a group of one row: mean 0, std 1
        alone = (torch.bincount(group, minlength=1)[group] == 1).to(dev)
        single = scores / (1.0 + float(epsilon)) if normalize == "std" else scores
        adv = torch.where(alone & valid, single, adv)
        advantages = adv.unsqueeze(-1) * response_mask
    return advantages, advantages


def register(core_algos: Any) -> None:
    """Register the estimator in verl's ``ADV_ESTIMATOR_REGISTRY`` (idempotent)."""
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ADV_ESTIMATOR) is not compute_sparsecorr_grpo_advantage:
        core_algos.register_adv_est(ADV_ESTIMATOR)(compute_sparsecorr_grpo_advantage)


def unregister(core_algos: Any) -> None:
    """Remove the estimator from verl's registry (if it is this one)."""
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ADV_ESTIMATOR) is compute_sparsecorr_grpo_advantage:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(ADV_ESTIMATOR)
