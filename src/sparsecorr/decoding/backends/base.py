r"""The decoding backend interface: attention of new queries over the kept (or selected) KV.

The engine owns the cache, the policies and sampling; a backend only computes

\[ o = \mathrm{softmax}\big(s \, q k^\top + \log \mathbb{1}[\text{allowed}]\big)\, v \]

for each query head over the KV slots it may attend to (GQA: query head ``h`` reads KV head
``h // G``), with two optional variants: ``softcap`` \(c\) replaces the scaled logits by
\(c \tanh(\ell / c)\) before the mask (Gemma 2), and ``sinks`` \(s_h\) (one logit per query
head, natural-log units) joins the softmax denominator with no value (GPT-OSS):
\(o = \sum_j e^{\ell_j} v_j / (\sum_j e^{\ell_j} + e^{s_h})\). ``torch`` runs it with ``scaled_dot_product_attention`` in the model's dtype (CPU
and CUDA), ``reference`` in float32 with explicit einsums (the oracle), and the FlashInfer
backend (GPU) runs decode steps through paged kernels (`.paged`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn.attention.bias import CausalBias

__all__ = ["AttentionBackend"]


class AttentionBackend(Protocol):
    """What a decoding backend implements.

    ``allowed`` is ``None`` (every slot), a ``torch.nn.attention.bias.CausalBias`` (causal,
    aligned to the last slot: a chunk of full rows at one length) or a bool mask broadcastable
    to ``[B, H_kv, Q, S]`` (the engine passes ``[B, 1, Q, S]`` when every KV head reads the same
    slots); a backend that declares ``additive_mask = True`` (``torch``) may instead get a
    single-token step's mask as a float bias in the query's dtype (0 allowed, ``-inf`` not), made
    once per step and shared by every layer. A backend
    that also defines ``paged = True`` and the methods of
    [`PagedBackend`][sparsecorr.decoding.backends.paged.PagedBackend] reads single-token
    decode steps through page tables instead.

    Shapes:
        query: ``[B, H_q, Q, D]``; key, value: ``[B, H_kv, S, D]``; sinks: ``[H_q]`` -> output
        ``[B, H_q, Q, D]`` in the query's dtype.
    """

    name: str

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor | CausalBias | None, *, scaling: float, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...
