"""``StreamingLLM(sink=4)``: attention sinks plus the most recent tokens (Xiao et al., ICLR 2024)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Kind, KVPolicy

__all__ = ["StreamingLLM"]


@dataclass(frozen=True)
class StreamingLLM(KVPolicy):
    """Keep the first ``sink`` tokens and the most recent ones (score = position).

    Eviction; cost O(1) per step beyond the kept window. ``window`` is the always-kept recent
    span (the score already prefers recent tokens); ``buffer`` tokens may accumulate before a
    compression event.
    """

    name: ClassVar[str] = "streaming_llm"
    kind: ClassVar[Kind] = "eviction"
    sink: int = 4
    window: int = 0
    buffer: int = 0

    def score(self, *, keys, queries, valid, positions) -> torch.Tensor:
        return positions.float()
