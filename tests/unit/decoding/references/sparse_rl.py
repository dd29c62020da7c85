"""Sparse-RL's kept set (its SGLang fork's R-KV), ported from the authors' code.

Source: github.com/lsjia/Sparse-RL, commit ``182c0b26aeb8f2f6c6f12134c7f57cfe65f95376``:
``sglang-kvc/python/sglang/compress/r1kv_utils.py`` (``KVCluster.get_compress_indices``,
``compute_attention_scores``, ``cal_similarity``), configured in
``sglang-kvc/python/sglang/srt/managers/tp_worker.py`` (``attn_pooling="max"``,
``pooling="maxpool"``, ``mix_alpha=0.1``, ``retain_ratio=0.2``; defaults ``fix_obs_window=True``,
``sim_threshold=0.5``, ``sim_normalization=True``, ``similarity_pooling="mean"``,
``retain_direction="last"``). The per-head score is R-KV's (the same functions, the same
configuration: `tests.unit.decoding.references.r_kv.scores`); then
``final_score.sum(dim=1)``: one index set for all the layer's KV heads, ``topk`` of the keys
before the window plus the window, sorted.
"""

from __future__ import annotations

import torch

from . import r_kv


def keep(key_states: torch.Tensor, query_states: torch.Tensor, *, budget: int, window: int, kernel: int = 7,
         mix: float = 0.1) -> tuple[set[int], torch.Tensor]:
    """The layer's kept key indices (every head keeps them) and the summed scores ``[S - window]``."""
    s = key_states.shape[2]
    final = r_kv.scores(key_states, query_states, window=window, kernel=kernel, mix=mix)  # [1, H, S - W]
    summed = final.sum(dim=1).squeeze(0)
    if s < budget:
        return set(range(s)), summed
    top = summed.topk(budget - window, dim=-1).indices
    kept = torch.cat([top, torch.arange(s - window, s)]).sort().values
    return set(kept.tolist()), summed
