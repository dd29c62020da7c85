"""R-KV's kept set, ported from the authors' code.

Source: github.com/Zefan-Cai/R-KV, commit ``d15c9767e67c2bd9807128fecc35223fa2484a69``:
``rkv/compression/r1_kv.py`` (``R1KV.update_kv``) and ``rkv/utils.py``
(``compute_attention_scores``, ``cal_similarity``). Restated op by op for one sequence:

- logits of the cached window queries against every key, ``/ sqrt(head_dim)``; for GQA the
  maximum over the query heads of each KV group (``pooling="max"``, the default);
- softmax (float32) of the window rows over the keys *before* the window, mean over the window,
  cast to the queries' dtype; ``max_pool1d`` (kernel, padding kernel // 2, stride 1);
- ``cal_similarity``: unit keys ``k / (|k| + 1e-8)``, the cosine matrix with a zero diagonal;
  for each row the *last* column above the threshold (0 where none: ``max`` of an index row
  where non-matches are 0) is zeroed; mean over the rows (``dim=1``), softmax over the keys;
  the window's keys sliced off afterwards;
- ``final = attn * mix - sim * (1 - mix)``; ``topk(budget - window)`` of the scored keys plus the
  window's keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention_scores(query_states: torch.Tensor, key_states: torch.Tensor, pooling: str = "max") -> torch.Tensor:
    """``compute_attention_scores``: ``[1, H_q, W, D]``, ``[1, H_kv, S, D]`` -> ``[1, H_kv, W, S]``."""
    b, hq, w, d = query_states.shape
    hkv = key_states.shape[1]
    group = hq // hkv
    if group == 1:
        return query_states @ key_states.transpose(2, 3) / math.sqrt(d)
    q = query_states.view(b, hkv, group, w, d)
    logits = q @ key_states.unsqueeze(2).transpose(3, 4) / math.sqrt(d)  # [1, H_kv, G, W, S]
    return logits.mean(dim=2) if pooling == "mean" else logits.max(dim=2).values


def similarity(key_states: torch.Tensor, *, threshold: float = 0.5, normalization: bool = True) -> torch.Tensor:
    """``cal_similarity`` with ``retain_direction="last"``, ``aggregation="mean"``: ``[1, H, S, D]`` -> ``[H, S]``."""
    k = key_states[0]
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    cos = unit @ unit.transpose(-1, -2)  # [H, S, S]
    for h in range(cos.shape[0]):
        cos[h].fill_diagonal_(0.0)
    s = cos.shape[-1]
    cols = torch.arange(s)
    index = torch.where(cos > threshold, cols, torch.zeros_like(cols))
    retain = index.max(dim=-1).values  # [H, S]: the last near-duplicate of each row (0: none)
    heads = torch.arange(cos.shape[0])[:, None].expand(-1, s)
    rows = cols[None, :].expand(cos.shape[0], -1)
    cos[heads, rows, retain] = 0
    mean = cos.mean(dim=1)
    return mean.softmax(dim=-1) if normalization else mean


def scores(key_states: torch.Tensor, query_states: torch.Tensor, *, window: int, kernel: int, mix: float,
           threshold: float = 0.5) -> torch.Tensor:
    """R-KV's ``final_score`` of the keys before the window: ``[1, H_kv, S - window]``."""
    logits = attention_scores(query_states, key_states, pooling="max")
    attn = F.softmax(logits[:, :, -window:, :-window], dim=-1, dtype=torch.float32).mean(dim=-2)
    attn = attn.to(query_states.dtype)
    attn = F.max_pool1d(attn, kernel_size=kernel, padding=kernel // 2, stride=1)
    sim = similarity(key_states, threshold=threshold)[:, :-window]
    return attn * mix - sim * (1 - mix)


def keep(key_states: torch.Tensor, query_states: torch.Tensor, *, budget: int, window: int, kernel: int = 7,
         mix: float = 0.1, threshold: float = 0.5) -> tuple[list[set[int]], torch.Tensor]:
    """The kept key indices of every KV head (R-KV keeps all below ``budget`` keys) and the scores."""
    s = key_states.shape[2]
    final = scores(key_states, query_states, window=window, kernel=kernel, mix=mix, threshold=threshold)
    if s < budget:
        return [set(range(s)) for _ in range(key_states.shape[1])], final[0]
    top = final.topk(budget - window, dim=-1).indices[0]  # [H_kv, budget - window]
    recent = set(range(s - window, s))
    return [set(row.tolist()) | recent for row in top], final[0]
