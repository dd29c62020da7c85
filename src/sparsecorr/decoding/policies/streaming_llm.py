"""``StreamingLLM(sink=4)``: attention sinks plus the most recent tokens (Xiao et al., ICLR 2024).

Reference: github.com/mit-han-lab/streaming-llm, ``streaming_llm/kv_cache.py``
(``StartRecentKVCache``: the first ``start_size`` and the last ``recent_size`` tokens); R-KV's
``rkv/compression/streamingllm.py`` (commit ``d15c9767e67c2bd9807128fecc35223fa2484a69``) keeps
the same. A compression keeps the first ``sink`` tokens and the most recent ``budget - sink``:
the same tokens (``tests/unit/decoding/references``).
"""

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
    compression event.

    **What ``budget`` bounds**: a compression keeps ``budget`` tokens, and runs once a row holds
    more than ``budget + buffer`` (`EvictionPolicy.due`), so the step that triggers it attends
    ``budget + buffer + 1`` tokens (the new token is written before the cache is compressed):
    33 at budget 32 with ``buffer=0``. With ``buffer=0`` the cache is compressed after every
    token (StreamingLLM's rule: ``budget`` kept, ``budget + 1`` attended), so teacher forcing
    replays it one token per forward; a buffer of 64-128 lets it replay in chunks. For at most
    ``n`` attended tokens, pass ``budget = n - buffer - 1``.
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
