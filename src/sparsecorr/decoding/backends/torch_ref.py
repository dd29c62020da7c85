r"""PyTorch backends: ``torch`` (SDPA in the model's dtype) and ``reference`` (float32 oracle).

Both also compute the two logit variants some decoder families use (`softmax_attention`):

- **soft-capping** (Gemma 2): the scaled logits go through \(c \tanh(\ell / c)\) before the mask
  and the softmax (transformers ``models/gemma2/modeling_gemma2.py``, ``eager_attention_forward``:
  scale, divide by ``softcap``, ``tanh``, multiply, then add the mask);
- **learned sinks** (GPT-OSS): one logit \(s_h\) per query head joins the softmax denominator and
  carries no value, \(o = \sum_j e^{\ell_j} v_j / (\sum_j e^{\ell_j} + e^{s_h})\) (transformers
  ``models/gpt_oss/modeling_gpt_oss.py``, ``eager_attention_forward``: the sink column is
  concatenated to the masked logits and dropped after the softmax).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

__all__ = ["ReferenceBackend", "TorchBackend", "check_sinks", "check_softcap", "softmax_attention"]


def check_softcap(softcap: float | None) -> None:
    """``softcap`` must be ``None`` or a positive finite number (host value: no device work)."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap: expected None or a positive finite float (the model's attention logit "
                         f"soft-cap), got {softcap!r}")


def check_sinks(sinks: torch.Tensor | None, heads: int) -> None:
    """``sinks`` must be ``None`` or a ``[H_q]`` tensor (shape only: no device sync)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.numel() != heads or sinks.dim() != 1:
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks: expected a [{heads}] tensor (one sink logit per query head), got {got}")


def _mask5(allowed: torch.Tensor, hq: int, hkv: int) -> torch.Tensor:
    """A mask broadcastable to ``[B, H_kv or H_q, Q, S]`` as ``[B', H_kv', G', Q', S]`` against
    logits laid out ``[B, H_kv, G, Q, S]`` (GQA: query head ``h`` reads KV head ``h // G``)."""
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    b, h, q, s = allowed.shape
    if h == hq and hq != hkv:  # per query head
        return allowed.reshape(b, hkv, hq // hkv, q, s)
    return allowed.unsqueeze(2)  # per KV head (or shared by all): the group's query heads share it


def softmax_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      allowed: torch.Tensor | CausalBias | None, *, scaling: float,
                      softcap: float | None = None, sinks: torch.Tensor | None = None,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    r"""Masked softmax attention with optional soft-capping and sinks, written out (no SDPA).

    \[ \ell = s\, q k^\top;\quad \ell \leftarrow c \tanh(\ell / c) \text{ (softcap)};\quad
       \ell_j = -\infty \text{ where not allowed};\quad
       o = \frac{\sum_j e^{\ell_j} v_j}{\sum_j e^{\ell_j} + e^{\text{sink}_h}} \]

    The products run in ``dtype`` (default: the query's), the softmax in float32 (as HF's eager
    attention upcasts it); GQA folds a KV head's query heads into one matmul (no K/V repeat).
    ``allowed`` is ``None``, a ``CausalBias``, a bool mask or an additive float bias (0 / -inf),
    broadcastable to ``[B, H_kv or H_q, Q, S]``.

    Shapes:
        query ``[B, H_q, Q, D]``; key, value ``[B, H_kv, S, D]``; sinks ``[H_q]`` -> ``[B, H_q, Q, D]``
        in ``dtype``.
    """
    b, hq, q_len, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g = hq // hkv
    dtype = query.dtype if dtype is None else dtype
    q = query.to(dtype).reshape(b, hkv, g * q_len, d)
    logits = (torch.matmul(q, key.to(dtype).transpose(-1, -2)) * scaling).reshape(b, hkv, g, q_len, s)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    if isinstance(allowed, CausalBias):
        allowed = allowed._materialize(query.device)
    if allowed is not None:
        mask = _mask5(allowed, hq, hkv)
        logits = logits.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else logits + mask.float()
    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:
        sink = sinks.float().reshape(1, hkv, g, 1, 1).expand(b, hkv, g, q_len, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :s]
    out = torch.matmul(probs.to(dtype).reshape(b, hkv, g * q_len, s), value.to(dtype))
    return out.reshape(b, hq, q_len, d)


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

    ``softcap`` or ``sinks`` (Gemma 2, GPT-OSS) take `softmax_attention` instead, in the model's
    dtype with a float32 softmax: SDPA can neither transform its logits nor report their
    log-sum-exp, and every exact way to fold a per-query-head sink into SDPA (an extra key
    column with a per-head bias) materialises a ``[B, H_q, Q, S + 1]`` bias as large as the
    logits this path writes, plus a copy of K and V.
    """

    name = "torch"
    paged = False
    additive_mask = True  # the engine may pass a step's mask as a float bias (0 / -inf): no per-layer conversion

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor | None, *, scaling: float, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        b, hq, q_len, d = query.shape
        if softcap is not None or sinks is not None:
            check_softcap(softcap)
            check_sinks(sinks, hq)
            return softmax_attention(query, key, value, allowed, scaling=scaling, softcap=softcap, sinks=sinks)
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
    """Float32 masked softmax attention written out (`softmax_attention` in float32, CPU and
    CUDA), soft-capping and sinks included: the oracle the other backends are tested against.
    A row with nothing allowed (and no sink) gives 0. Returns the query's dtype."""

    name = "reference"
    paged = False
    additive_mask = False  # the float32 oracle takes the boolean mask

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor | None, *, scaling: float, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        check_softcap(softcap)
        check_sinks(sinks, query.shape[1])
        out = softmax_attention(query, key, value, allowed, scaling=scaling, softcap=softcap, sinks=sinks,
                                dtype=torch.float32)
        return out.nan_to_num(0.0).to(query.dtype)
