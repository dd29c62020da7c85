"""Test-time answer aggregation: plain and quality-weighted majority vote (ARRoL §test time).

ARRoL weights each sampled answer by the quality head's predicted probability of success and
returns the answer with the largest total weight. Ties are broken deterministically: the tied
answer that appears first in ``answers`` wins. ``None`` answers (unparseable completions) are
ignored; if every answer is ``None`` the result is ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

__all__ = ["majority_vote", "weighted_vote"]


def weighted_vote(
    answers: Sequence[Hashable | None], weights: Sequence[float] | torch.Tensor
) -> Hashable | None:
    """The answer with the largest summed weight (first occurrence wins ties).

    Args:
        answers: one (hashable) final answer per rollout, ``None`` for no answer.
        weights: one finite weight ≥ 0 per rollout (e.g. the head's predicted success).
    """
    if isinstance(weights, torch.Tensor):
        weights = weights.detach().float().reshape(-1).tolist()
    weights = list(weights)
    if len(weights) != len(answers):
        raise ValueError(
            f"weights: expected one weight per answer ({len(answers)}), got {len(weights)}"
        )
    for w in weights:
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weights: expected finite numbers >= 0, got {w!r}")
    totals: dict[Hashable, float] = {}
    for answer, w in zip(answers, weights):
        if answer is not None:
            totals[answer] = totals.get(answer, 0.0) + w  # dict keeps first-occurrence order
    if not totals:
        return None
    best = max(totals.values())
    return next(a for a, t in totals.items() if t == best)


def majority_vote(answers: Sequence[Hashable | None]) -> Hashable | None:
    """The most frequent answer (first occurrence wins ties); ``weighted_vote`` with weight 1."""
    return weighted_vote(answers, [1.0] * len(answers))
