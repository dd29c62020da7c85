"""PyTorch backends: ``torch`` (SDPA in the model's dtype) and ``reference`` (float32 oracle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

__all__ = ["ReferenceBackend", "TorchBackend"]


class TorchBackend:
    """``scaled_dot_product_attention`` in the model's dtype, CPU and CUDA (PyTorch picks the
    kernel: flash / memory-efficient / cuDNN on CUDA, the fused CPU kernel on CPU).

    A single-token step folds the GQA group into the query axis (``[B, H_kv, G, D]`` against the
    ``[B, H_kv, S, D]`` cache), so K/V are never repeated per query head; longer chunks use
    ``enable_gqa`` on CPU and, on CUDA, repeat one layer's K/V per query head when a mask is
    needed (the fused kernels that take a mask do not take GQA). A query with no allowed slot
    never occurs: the engine always lets a query read its own slot. A chunk whose rows are all
    full and at one length comes as a ``CausalBias`` (``causal_lower_right``): SDPA then runs its
    causal kernel with ``enable_gqa`` (flash on CUDA), with no mask tensor and no K/V copy.
    """

    name = "torch"
    additive_mask = True  # the engine may pass a step's mask as a float bias (0 / -inf): no per-layer conversion

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor | None, *, scaling: float) -> torch.Tensor:
        b, hq, q_len, d = query.shape
        hkv = key.shape[1]
        g = hq // hkv
        if q_len == 1:
            q = query.reshape(b, hkv, g, d)
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=allowed, scale=scaling)
            return out.reshape(b, hq, 1, d)
        if isinstance(allowed, CausalBias):  # full, aligned rows: causal, no mask tensor, no K/V copy
            return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                                  enable_gqa=g > 1)
        if allowed is not None and allowed.shape[1] not in (1, hq):
            allowed = allowed.repeat_interleave(g, dim=1)  # per-KV-head mask -> per query head
        if g > 1 and allowed is not None and query.is_cuda:
            # CUDA's fused kernels that take a mask do not take GQA: repeat K/V for this layer
            # (transient) rather than fall back to the math kernel's [B, H, Q, S] scores
            key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
            g = 1
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                              enable_gqa=g > 1)


class ReferenceBackend:
    """Float32 masked softmax attention with explicit einsums (CPU and CUDA): the oracle the
    other backends are tested against. Returns the query's dtype."""

    name = "reference"

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor | None, *, scaling: float) -> torch.Tensor:
        b, hq, q, d = query.shape
        hkv = key.shape[1]
        g = hq // hkv
        qf = query.float().reshape(b, hkv, g, q, d)
        logits = torch.einsum("bhgqd,bhsd->bhgqs", qf, key.float()) * scaling
        if isinstance(allowed, CausalBias):
            allowed = allowed._materialize(query.device)[None, None]  # [1, 1, Q, S]
        if allowed is not None:
            logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with nothing allowed -> 0
        out = torch.einsum("bhgqs,bhsd->bhgqd", probs, value.float())
        return out.reshape(b, hq, q, d).to(query.dtype)
