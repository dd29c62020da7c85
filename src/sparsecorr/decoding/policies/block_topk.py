r"""``BlockTopK(page_size=16, keep_first_pages=1, keep_last_pages=2, dense_layers=2)``: Sparrow.

A *selection* policy (Zhou et al., 2026, arXiv 2606.08446): the full KV cache is kept, and each
decode step attends to ``budget // page_size`` pages only. Pages of 16 tokens (by true position)
are scored by the
dot product of their mean key with the mean current query over the query heads of the KV group;
the first page and the last 2 pages are always kept; the first 2 layers stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Kind, KVPolicy

__all__ = ["BlockTopK"]


@dataclass(frozen=True)
class BlockTopK(KVPolicy):
    """Page selection by mean-key · mean-query score (see the module docstring)."""

    name: ClassVar[str] = "block_topk"
    kind: ClassVar[Kind] = "selection"
    page_size: int = 16
    keep_first_pages: int = 1
    keep_last_pages: int = 2
    dense_layers: int = 2

    def attend_mask(self, *, keys: torch.Tensor, query: torch.Tensor, valid: torch.Tensor,
                    positions: torch.Tensor, budget: int, layer_idx: int) -> torch.Tensor:
        """Slots this step attends to: ``[B, H_kv, S]`` bool ⊆ ``valid``.

        Shapes:
            keys ``[B, H_kv, S, D]``; query ``[B, H_q, 1, D]``; valid ``[B, H_kv, S]``.
        """
        if layer_idx < self.dense_layers:
            return valid
        b, h, _, d = keys.shape
        ps = self.page_size
        # pages by true position (not slot index), so padding or batching cannot shift them
        n_pages = int(torch.where(valid, positions, 0).max()) // ps + 1
        page = torch.where(valid, positions // ps, n_pages)  # invalid slots -> a dump page
        kv = keys.float() * valid[..., None]
        sums = kv.new_zeros(b, h, n_pages + 1, d).scatter_add_(2, page[..., None].expand(-1, -1, -1, d), kv)
        counts = kv.new_zeros(b, h, n_pages + 1).scatter_add_(2, page, valid.float())
        sums, counts = sums[:, :, :n_pages], counts[:, :, :n_pages]
        mean_k = sums / counts.clamp(min=1)[..., None]
        mean_q = query.float().reshape(b, h, -1, d).mean(2)  # mean over the group's query heads
        score = torch.einsum("bhpd,bhd->bhp", mean_k, mean_q)
        page_valid = counts > 0
        page_idx = torch.arange(n_pages, device=keys.device)
        last_valid = torch.where(page_valid, page_idx, -1).amax(-1, keepdim=True)
        forced = page_valid & ((page_idx < self.keep_first_pages)
                               | (page_idx > last_valid - self.keep_last_pages))
        score = torch.where(forced, torch.inf, score).masked_fill(~page_valid, -torch.inf)
        n_keep = min(max(budget // ps, self.keep_first_pages + self.keep_last_pages), n_pages)
        chosen = torch.zeros_like(page_valid)
        chosen.scatter_(-1, score.topk(n_keep, dim=-1).indices, True)
        chosen &= page_valid
        return valid & chosen.gather(-1, page.clamp(max=n_pages - 1))
