"""SnapKV's kept set, ported from the authors' code.

Source: github.com/FasterDecoding/SnapKV, commit ``e216ddc84c5bd210378cbdbbba12ba02102aa640``,
``snapkv/monkeypatch/snapkv_utils.py`` (``SnapKVCluster.update_kv``), restated for the window's
queries: logits of the last ``window`` queries against every key ``/ sqrt(head_dim)``; a causal
mask inside the window (query ``t`` of the window sees the window's keys ``0..t``: the finfo min
added above the diagonal); softmax (float32) over all keys, cast to the queries' dtype; summed
over the window at the keys before the window; ``avg_pool1d`` / ``max_pool1d`` (kernel, padding
kernel // 2, stride 1) over those keys only; ``topk(budget - window)`` plus the window's keys.

SnapKV's code scores one KV head per query head (MHA). For GQA the port averages the query
heads' window sums over each KV group before pooling: the library's documented choice, not
SnapKV's code (which has no GQA rule).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def scores(key_states: torch.Tensor, query_states: torch.Tensor, *, window: int, kernel: int,
           pooling: str = "maxpool") -> torch.Tensor:
    """SnapKV's pooled votes of the keys before the window: ``[1, H_kv, S - window]``."""
    d = query_states.shape[-1]
    hq, hkv = query_states.shape[1], key_states.shape[1]
    keys = key_states.repeat_interleave(hq // hkv, dim=1)  # one KV head per query head
    logits = query_states[..., -window:, :] @ keys.transpose(2, 3) / math.sqrt(d)  # [1, H_q, W, S]
    mask = torch.full((window, window), torch.finfo(logits.dtype).min)
    cond = torch.arange(window)
    mask.masked_fill_(cond < (cond + 1).view(window, 1), 0)
    logits[:, :, -window:, -window:] += mask[None, None]
    probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(query_states.dtype)
    votes = probs[:, :, -window:, :-window].sum(dim=-2)  # [1, H_q, S - W]
    votes = votes.reshape(1, hkv, hq // hkv, -1).mean(2)  # GQA: the group's mean (see the module docstring)
    if pooling == "avgpool":
        return F.avg_pool1d(votes, kernel_size=kernel, padding=kernel // 2, stride=1)
    return F.max_pool1d(votes, kernel_size=kernel, padding=kernel // 2, stride=1)


def keep(key_states: torch.Tensor, query_states: torch.Tensor, *, budget: int, window: int, kernel: int = 7,
         pooling: str = "maxpool") -> tuple[list[set[int]], torch.Tensor]:
    """The kept key indices of every KV head and the scores ``[H_kv, S - window]``."""
    s = key_states.shape[2]
    votes = scores(key_states, query_states, window=window, kernel=kernel, pooling=pooling)
    top = votes.topk(budget - window, dim=-1).indices[0]
    recent = set(range(s - window, s))
    return [set(row.tolist()) | recent for row in top], votes[0]
