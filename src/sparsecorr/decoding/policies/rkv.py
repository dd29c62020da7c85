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
from .snapkv import pool_scores

__all__ = ["RKV", "key_redundancy"]


def _minmax(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    lo = torch.where(valid, x, torch.inf).amin(-1, keepdim=True)
    hi = torch.where(valid, x, -torch.inf).amax(-1, keepdim=True)
    return torch.where(valid, (x - lo) / (hi - lo).clamp(min=1e-12), 0.0)


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity of each valid key to the other valid keys: ``[B, H_kv, S]``."""
    k = F.normalize(keys.float(), dim=-1)
    sim = torch.einsum("bhsd,bhtd->bhst", k, k)
    both = valid[..., :, None] & valid[..., None, :]
    eye = torch.eye(k.shape[2], dtype=torch.bool, device=k.device)
    others = both & ~eye
    return torch.where(others, sim, 0.0).sum(-1) / others.sum(-1).clamp(min=1)


@dataclass(frozen=True)
class RKV(KVPolicy):
    """Importance minus key redundancy (see the module docstring). Eviction; scoring costs a
    W×S attention plus an S×S key similarity per head at each compression event."""

    name: ClassVar[str] = "rkv"
    kind: ClassVar[Kind] = "eviction"
    window: int = 8
    kernel: int = 7
    mix: float = 0.1
    buffer: int = 128
    sink: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix: expected a number in [0, 1], got {self.mix!r}")

    def score(self, *, keys, queries, valid, positions) -> torch.Tensor:
        imp = pool_scores(group_scores(queries, keys, valid).masked_fill(~valid, 0.0),
                          kernel=self.kernel, pooling="max")
        red = key_redundancy(keys, valid)
        return self.mix * _minmax(imp, valid) - (1.0 - self.mix) * _minmax(red, valid)
