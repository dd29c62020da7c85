"""The PyTorch reference backend: float32 masked softmax attention, CPU and CUDA (the oracle)."""

from __future__ import annotations

import torch

__all__ = ["TorchRefBackend"]


class TorchRefBackend:
    """Attention over the allowed slots in float32; returns the query's dtype."""

    name = "torch"

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor, *, scaling: float) -> torch.Tensor:
        b, hq, q, d = query.shape
        hkv = key.shape[1]
        g = hq // hkv
        qf = query.float().reshape(b, hkv, g, q, d)
        logits = torch.einsum("bhgqd,bhsd->bhgqs", qf, key.float()) * scaling
        logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with nothing allowed -> 0
        out = torch.einsum("bhgqs,bhsd->bhgqd", probs, value.float())
        return out.reshape(b, hq, q, d).to(query.dtype)
