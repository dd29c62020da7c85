"""StreamingLLM's kept set, from its rule.

Source: github.com/mit-han-lab/streaming-llm, ``streaming_llm/kv_cache.py``
(``StartRecentKVCache``: the first ``start_size`` and the last ``recent_size`` tokens of the
cache). That repository is not mirrored here: the port is written from that rule (and matches
R-KV's ``rkv/compression/streamingllm.py``, commit ``d15c9767e67c2bd9807128fecc35223fa2484a69``:
the first tokens and the last ``budget - first`` tokens).
"""

from __future__ import annotations


def keep(seq_len: int, *, start: int, recent: int) -> set[int]:
    """Indices kept of a ``seq_len``-token cache (all of them when it fits)."""
    if seq_len <= start + recent:
        return set(range(seq_len))
    return set(range(start)) | set(range(seq_len - recent, seq_len))
