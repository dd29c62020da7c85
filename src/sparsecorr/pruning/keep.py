r"""Correctness-balanced selection of the rollouts that survive pruning (ARRoL).

ARRoL (Xu et al., ACL 2026, arXiv 2603.24840) generates every rollout to a detection length,
predicts for each the probability \(p_i\) that it will end correct, then keeps a fraction of
each group so that the survivors are *correctness-balanced*: a GRPO group whose rewards are all
equal carries no learning signal, so the kept group should have high reward variance. The paper
does not publish its exact survival rule; [`balanced_keep`][sparsecorr.pruning.balanced_keep]
exposes three rules (default ``"variance"``), each keeping exactly
``K = round(keep_ratio · group_size)`` rollouts per group.

Expected variance of the kept rewards: with independent rewards \(r_i \sim \mathrm{Bern}(p_i)\)
on a kept set \(S\), \(|S| = K\), the expected empirical variance of the kept rewards is

\[
\mathbb{E}\Big[\tfrac1K \sum_{i\in S} (r_i - \bar r)^2\Big]
= \bar p (1 - \bar p) - \frac{1}{K^2} \sum_{i \in S} p_i (1 - p_i),
\qquad \bar p = \tfrac1K \sum_{i\in S} p_i .
\]

Holding the other kept items fixed, this is *linear* in any one \(p_i\), so an exchange argument
shows the optimum keeps the ``j`` most likely and the ``K - j`` least likely rollouts for some
``j``: scanning those ``K + 1`` candidates is exact (tested against brute force over subsets).
"""

from __future__ import annotations

import itertools
import math

import torch

from .._checks import check_choice, check_float_tensor, check_probability

__all__ = ["MAX_EXHAUSTIVE", "RULES", "balanced_keep", "expected_kept_variance"]

RULES = ("variance", "target", "random")


def expected_kept_variance(p: torch.Tensor) -> torch.Tensor:
    """Expected empirical variance of Bernoulli rewards with success probabilities ``p``.

    Shapes:
        p: ``[..., K]`` (K >= 1, floating point) -> ``[...]`` (NaN where a ``p`` is NaN).
    """
    check_float_tensor("p", p)
    if p.dim() < 1 or p.shape[-1] < 1:
        raise ValueError(f"p: expected [..., K] with K >= 1, got shape {tuple(p.shape)}")
    k = p.shape[-1]
    pbar = p.mean(-1)
    return pbar * (1 - pbar) - (p * (1 - p)).sum(-1) / (k * k)


#: exhaustive search for rule="target" while C(G, K) is at most this many subsets
MAX_EXHAUSTIVE = 20_000


def _candidate_sets(order: torch.Tensor, k: int, *, windows: bool) -> torch.Tensor:
    """Index sets (into the sorted order) to consider.

    Extremes (j largest + k - j smallest) always; with ``windows`` every subset when there are
    at most ``MAX_EXHAUSTIVE`` of them, else the contiguous windows of the sorted order.
    Returns ``[n_groups, C, K]`` indices into each group.
    """
    n, g = order.shape
    cands = [list(range(k - j)) + list(range(g - j, g)) for j in range(k + 1)]
    if windows and math.comb(g, k) <= MAX_EXHAUSTIVE:
        cands += [list(c) for c in itertools.combinations(range(g), k)]
    elif windows:
        cands += [list(range(s, s + k)) for s in range(g - k + 1)]
    pos = torch.tensor(cands, dtype=torch.long, device=order.device)  # [C, K]
    return order.gather(1, pos.reshape(1, -1).expand(n, -1)).reshape(n, len(cands), k)


def balanced_keep(
    p_success: torch.Tensor,
    *,
    group_size: int,
    keep_ratio: float = 0.5,
    target: float = 0.5,
    rule: str = "variance",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""Choose exactly ``K = round(keep_ratio · group_size)`` rollouts per group to keep.

    Rules:
        - ``"variance"`` (default): maximise the expected reward variance of the kept group
          (formula in the module docstring); exact.
        - ``"target"``: make the expected positive fraction \(\bar p\) of the kept group as
          close as possible to ``target`` (ARRoL's target positive fraction, 0.5). Exact
          (every subset) while there are at most ``MAX_EXHAUSTIVE`` = 20,000 subsets (e.g.
          G = 16, K = 8); beyond that it searches the extreme sets of the variance rule and
          every contiguous window of the group sorted by ``p`` (the gap to the best subset is
          then at most the largest gap between neighbouring sorted ``p``, divided by K). Ties
          go to the set with the larger expected variance.
        - ``"random"``: K uniformly at random per group (the ablation baseline).

    Args:
        p_success: predicted probability that each rollout ends correct, groups of
            ``group_size`` consecutive rows.
        group_size: rollouts per prompt (G).
        keep_ratio: fraction kept per group, in (0, 1] (ARRoL: 0.5).
        target: target expected positive fraction for ``rule="target"``.
        rule: one of ``"variance"``, ``"target"``, ``"random"``.
        generator: RNG for ``rule="random"``.

    Returns:
        keep: ``[B]`` bool with exactly K True per group (empty for B = 0).

    Shapes:
        p_success: ``[B]`` with ``B = n_groups · group_size`` -> keep ``[B]``.
    """
    check_choice("rule", rule, RULES)
    check_probability("keep_ratio", keep_ratio, open_low=True)
    check_probability("target", target)
    if not isinstance(p_success, torch.Tensor) or p_success.dim() != 1:
        shape = tuple(p_success.shape) if isinstance(p_success, torch.Tensor) else type(p_success)
        raise ValueError(f"p_success: expected a 1-D tensor [B], got {shape}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1 \
            or p_success.numel() % group_size:
        raise ValueError(
            f"group_size: expected a positive int dividing B={p_success.numel()}, got {group_size!r}"
        )
    if not p_success.is_floating_point():
        raise ValueError(f"p_success: expected a floating-point tensor, got dtype {p_success.dtype}")
    p = p_success.detach().float()
    if p.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=p.device)
    bad = ~torch.isfinite(p) | (p < 0) | (p > 1)
    if bad.any():
        raise ValueError(
            f"p_success: expected finite probabilities in [0, 1], got {int(bad.sum())} entries "
            f"outside (first: {float(p[bad][0])})"
        )
    g = group_size
    k = max(1, round(keep_ratio * g))
    groups = p.reshape(-1, g)
    n = groups.shape[0]
    if rule == "random":
        scores = torch.rand(n, g, generator=generator, device=p.device)
        chosen = scores.topk(k, dim=1).indices
    else:
        order = groups.argsort(dim=1, stable=True)
        cand = _candidate_sets(order, k, windows=rule == "target")  # [n, C, K]
        vals = groups.gather(1, cand.reshape(n, -1)).reshape(cand.shape)
        var = expected_kept_variance(vals)  # [n, C]
        if rule == "variance":
            best = var.argmax(dim=1)
        else:
            dist = (vals.mean(-1) - target).abs()
            # lexicographic: closest to target, then largest variance
            best = (dist - 1e-9 * var).argmin(dim=1)
        chosen = cand[torch.arange(n, device=p.device), best]
    keep = torch.zeros(n, g, dtype=torch.bool, device=p.device)
    keep.scatter_(1, chosen, True)
    return keep.reshape(-1)
