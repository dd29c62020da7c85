"""KV-cache policies: which past tokens a sparse sampler keeps (eviction) or attends to (selection).

| policy | rule | kind | source |
|---|---|---|---|
| ``Dense()`` | everything | dense | — |
| ``StreamingLLM(sink=4)`` | first ``sink`` + most recent | eviction | Xiao et al., 2024 |
| ``SnapKV(window=8, kernel=7)`` | observation-window attention, max-pooled | eviction | Li et al., 2024 |
| ``RKV(window=8, kernel=7, mix=0.1, buffer=128)`` | 0.1·importance − 0.9·key redundancy | eviction | Sparse-RL / R-KV |
| ``BlockTopK(page_size=16, ...)`` | top pages by mean-key · mean-query | selection | Sparrow |
"""

from __future__ import annotations

from .base import KeepSet, KVPolicy, compress, group_scores
from .block_topk import (
    BlockTopK,
    SelectionPlan,
    keep_counts,
    page_means,
    pages_to_mask,
    rank_pages,
    select_pages,
    selection_plan,
)
from .dense import Dense
from .rkv import RKV, key_redundancy
from .snapkv import SnapKV, pool_scores
from .streaming_llm import StreamingLLM

POLICIES = {p.name: p for p in (Dense, StreamingLLM, SnapKV, RKV, BlockTopK)}


def get_policy(name: str, **kwargs: object) -> KVPolicy:
    """A policy by name (``dense``, ``streaming_llm``, ``snapkv``, ``rkv``, ``block_topk``)."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"name: expected one of {sorted(POLICIES)}, got {name!r}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"kwargs: {name} does not take {sorted(kwargs)}: {exc}") from None


__all__ = [
    "POLICIES", "RKV", "BlockTopK", "Dense", "KVPolicy", "KeepSet", "SelectionPlan", "SnapKV", "StreamingLLM",
    "compress", "get_policy", "group_scores", "keep_counts", "key_redundancy", "page_means",
    "pages_to_mask", "pool_scores", "rank_pages", "select_pages", "selection_plan",
]
