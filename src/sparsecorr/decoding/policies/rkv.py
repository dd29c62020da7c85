r"""``RKV(window=8, kernel=7, mix=0.1, buffer=128)``: R-KV, Sparse-RL's main compression.

Score = ``mix`` · importance − (1 − ``mix``) · redundancy (Sparse-RL, Luo et al., ACL 2026,
after R-KV): importance is SnapKV's pooled observation-window attention; redundancy of a key is
its mean cosine similarity to the other valid keys of the same head (reasoning traces repeat
themselves; a key like many others carries little). Both terms are min-max normalised per
(sequence, head) before mixing so ``mix`` weighs comparable quantities (our choice: the source
does not say how they are scaled). Compression runs when the cache reaches budget + buffer
(every 128 decode steps in Sparse-RL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import Kind, KVPolicy, group_scores
from .snapkv import check_window_policy, pool_scores

__all__ = ["RKV", "key_redundancy"]


def _minmax(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    lo = torch.where(valid, x, torch.inf).amin(-1, keepdim=True)
    hi = torch.where(valid, x, -torch.inf).amax(-1, keepdim=True)
    return torch.where(valid, (x - lo) / (hi - lo).clamp(min=1e-12), 0.0)


def _unit_keys(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return F.normalize(keys.float(), dim=-1) * valid[..., None]


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor, *, chunk: int = 4096) -> torch.Tensor:
    r"""Mean cosine similarity of each valid key to the other valid keys: ``[B, H_kv, S]``.

    With unit keys \(\hat k_j\) and \(n\) valid keys,
    \(\mathrm{red}_j = \frac{1}{n-1}\sum_{t \ne j} \hat k_j \cdot \hat k_t
    = \frac{\hat k_j \cdot \sum_t \hat k_t - \lVert \hat k_j \rVert^2}{n - 1}\), so the score
    costs O(S·D) and never forms the S×S similarity matrix: two passes over the keys in
    ``chunk``-slot pieces (float32), the first summing the unit keys, the second taking each
    key's dot product with the sum. A zero key has similarity 0 to everything; invalid slots
    and rows with a single valid key score 0.

    Shapes:
        keys ``[B, H_kv, S, D]``; valid ``[B, H_kv, S]`` bool -> ``[B, H_kv, S]`` float32.
    """
    s = keys.shape[2]
    total = keys.new_zeros(keys.shape[:2] + keys.shape[3:], dtype=torch.float32)
    for lo in range(0, s, chunk):
        total += _unit_keys(keys[:, :, lo:lo + chunk], valid[:, :, lo:lo + chunk]).sum(2)
    n = valid.sum(-1, keepdim=True).float()
    parts = []
    for lo in range(0, s, chunk):
        u = _unit_keys(keys[:, :, lo:lo + chunk], valid[:, :, lo:lo + chunk])
        parts.append(torch.einsum("bhsd,bhd->bhs", u, total) - u.square().sum(-1))
    red = torch.cat(parts, -1) / (n - 1).clamp(min=1)
    return torch.where(valid, red, 0.0)


@dataclass(frozen=True)
class RKV(KVPolicy):
    """Importance minus key redundancy (see the module docstring). Eviction; scoring costs a
    W×S attention plus an O(S·D) key redundancy per head at each compression event."""

    name: ClassVar[str] = "rkv"
    kind: ClassVar[Kind] = "eviction"
    window: int = 8
    kernel: int = 7
    mix: float = 0.1
    buffer: int = 128
    sink: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix: expected a number in [0, 1], got {self.mix!r}")
        check_window_policy(self)

    def score(self, *, keys, queries, valid, positions, query_valid=None) -> torch.Tensor:
        imp = pool_scores(group_scores(queries, keys, valid, query_valid).masked_fill(~valid, 0.0),
                          kernel=self.kernel, pooling="max")
        red = key_redundancy(keys, valid)
        return self.mix * _minmax(imp, valid) - (1.0 - self.mix) * _minmax(red, valid)
