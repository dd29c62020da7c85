"""The decoding backend interface: attention of new queries over the kept (or selected) KV.

The engine owns the cache, the policies and sampling; a backend only computes

\\[ o = \\mathrm{softmax}\\big(s \\, q k^\\top + \\log \\mathbb{1}[\\text{allowed}]\\big)\\, v \\]

for each query head over the KV slots it may attend to (GQA: query head ``h`` reads KV head
``h // G``). ``torch_ref`` is the float32 oracle on CPU and CUDA; the FlashInfer backend
(GPU) reads the same kept sets through page tables (`.paging`).
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["AttentionBackend"]


class AttentionBackend(Protocol):
    """What a decoding backend implements.

    Shapes:
        query: ``[B, H_q, Q, D]``; key, value: ``[B, H_kv, S, D]``; allowed: ``[B, H_kv, Q, S]``
        bool -> output ``[B, H_q, Q, D]`` in the query's dtype.
    """

    name: str

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor, *, scaling: float) -> torch.Tensor: ...
