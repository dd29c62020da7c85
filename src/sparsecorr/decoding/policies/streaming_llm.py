"""``StreamingLLM(sink=4)``: attention sinks plus the most recent tokens (Xiao et al., ICLR 2024)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import EvictionPolicy, check_int

__all__ = ["StreamingLLM"]


@dataclass(frozen=True)
class StreamingLLM(EvictionPolicy):
    """Keep the first ``sink`` tokens and the most recent ones (score = position).

    Eviction; cost O(1) per step beyond the kept window. ``window`` is the always-kept recent
    span (the score already prefers recent tokens); ``buffer`` tokens may accumulate before a
    compression event. With ``buffer=0`` (the paper's rule: exactly ``budget`` tokens attended)
    the cache is compressed after every token, so teacher forcing replays it one token per
    forward; a buffer of 64-128 lets it replay in chunks.
    """

    name: ClassVar[str] = "streaming_llm"
    sink: int = 4
    window: int = 0
    buffer: int = 0

    def __post_init__(self) -> None:
        check_int("sink", self.sink, minimum=0)
        check_int("window", self.window, minimum=0)
        check_int("buffer", self.buffer, minimum=0)

    def score(self, *, keys, queries, valid, positions, query_valid=None) -> torch.Tensor:
        return positions.float()
