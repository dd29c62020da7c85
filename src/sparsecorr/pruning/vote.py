"""Test-time answer aggregation: plain and quality-weighted majority vote (ARRoL §test time).

ARRoL weights each sampled answer by the quality head's predicted probability of success and
returns the answer with the largest total weight. Ties are broken deterministically: the tied
answer that appears first in ``answers`` wins. ``None`` answers (unparseable completions) are
ignored; if every answer is ``None`` the result is ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Mapping, Sequence, Set
from numbers import Real

import torch

__all__ = ["majority_vote", "weighted_vote"]


def weighted_vote(
    answers: Sequence[Hashable | None], weights: Sequence[float] | torch.Tensor
) -> Hashable | None:
    """The answer with the largest summed weight (first occurrence wins ties).

    Args:
        answers: a list or tuple with one hashable final answer per rollout (a str, number,
            tuple...), ``None`` for no answer.
        weights: one finite weight ≥ 0 per rollout (e.g. the head's predicted success).

    Raises:
        ValueError: ``answers`` is not a list or tuple, or holds an unhashable answer (a list:
            pass ``tuple(answer)``), named by index; ``weights`` has another length, or a value
            that is not a finite number ≥ 0.
    """
    _check_answers(answers)
    if isinstance(weights, torch.Tensor):
        weights = weights.detach().float().reshape(-1).tolist()
    if isinstance(weights, (str, bytes, Set, Mapping)) or not isinstance(weights, Collection):
        raise ValueError(f"weights: expected a sequence or tensor of numbers, got {type(weights).__name__}")
    weights = list(weights)
    if len(weights) != len(answers):
        raise ValueError(
            f"weights: expected one weight per answer ({len(answers)}), got {len(weights)}"
        )
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, Real) or not math.isfinite(w) or w < 0:
            raise ValueError(f"weights: expected finite numbers >= 0, got {w!r}")
    totals: dict[Hashable, float] = {}
    for answer, w in zip(answers, weights):
        if answer is not None:
            totals[answer] = totals.get(answer, 0.0) + w  # dict keeps first-occurrence order
    if not totals:
        return None
    best = max(totals.values())
    return next(a for a, t in totals.items() if t == best)


def _check_answers(answers: object) -> None:
    """``answers``: an ordered collection (list, tuple, array) of hashable answers (``None``
    allowed); not a string, set or mapping."""
    if isinstance(answers, (str, bytes, Set, Mapping)) or not isinstance(answers, Collection):
        raise ValueError(f"answers: expected a list or tuple of hashable answers (None = no answer), "
                         f"got {type(answers).__name__}")
    for i, a in enumerate(answers):
        try:
            hash(a)
        except TypeError:
            raise ValueError(f"answers[{i}]: expected a hashable answer (a str, number, tuple or None; "
                             f"convert a list with tuple(...)), got {type(a).__name__} {a!r}") from None


def majority_vote(answers: Sequence[Hashable | None]) -> Hashable | None:
    """The most frequent answer (first occurrence wins ties); ``weighted_vote`` with weight 1."""
    _check_answers(answers)
    return weighted_vote(answers, [1.0] * len(answers))
