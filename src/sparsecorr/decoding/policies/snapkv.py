r"""``SnapKV(window=8, kernel=7, pooling="max")`` (Li et al., NeurIPS 2024).

The last ``window`` queries vote for the keys they attend to; votes are summed over the window,
averaged over the query heads of each KV group, and smoothed along the sequence with a 1-D
pooling of width ``kernel`` so neighbouring tokens survive together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import Kind, KVPolicy, check_int, group_scores

__all__ = ["SnapKV", "check_window_policy", "pool_scores"]


def pool_scores(scores: torch.Tensor, *, kernel: int, pooling: str) -> torch.Tensor:
    """1-D ``max``/``avg`` pooling along the last axis, same length (odd ``kernel``)."""
    if kernel <= 1:
        return scores
    b, h, s = scores.shape
    x = scores.reshape(b * h, 1, s)
    # the pooling's own padding: -inf for max, zeros (counted in the mean) for avg
    if pooling == "max":
        y = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        y = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return y.reshape(b, h, s)


def check_window_policy(policy: KVPolicy) -> None:
    """The arguments every observation-window policy (SnapKV, R-KV) shares."""
    check_int("window", policy.window, minimum=1)
    check_int("sink", policy.sink, minimum=0)
    check_int("buffer", policy.buffer, minimum=0)
    if isinstance(policy.kernel, bool) or not isinstance(policy.kernel, int) or policy.kernel < 1 \
            or policy.kernel % 2 == 0:
        raise ValueError(f"kernel: expected an odd positive int, got {policy.kernel!r}")


@dataclass(frozen=True)
class SnapKV(KVPolicy):
    """Observation-window attention, pooled. Eviction; scoring costs one W×S attention."""

    name: ClassVar[str] = "snapkv"
    kind: ClassVar[Kind] = "eviction"
    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    sink: int = 0
    buffer: int = 128

    def __post_init__(self) -> None:
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"pooling: expected 'max' or 'avg', got {self.pooling!r}")
        check_window_policy(self)

    def score(self, *, keys, queries, valid, positions, query_valid=None) -> torch.Tensor:
        # group_scores is exactly 0 at invalid slots of any row with a valid key
        imp = group_scores(queries, keys, valid, query_valid)
        return pool_scores(imp, kernel=self.kernel, pooling=self.pooling)
