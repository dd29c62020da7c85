r"""``BlockTopK(page_size=16, keep_first_pages=1, keep_last_pages=2, dense_layers=2)``: Sparrow.

A *selection* policy (Zhou et al., 2026, arXiv 2606.08446): the full KV cache is kept, and each
decode step attends to ``budget // page_size`` pages only. Pages of 16 tokens (by true position)
are scored by the dot product of their mean key with the mean current query over the query heads
of the KV group; the first page and the last 2 pages are always kept; the first 2 layers stay
dense.

The engine keeps a running *page summary* (the mean key of every complete page, written once
when the page fills) and scores pages from it, so a decode step reads ``S / page_size`` summaries
instead of rescanning the ``S`` cached keys
([`select_pages`][sparsecorr.decoding.policies.block_topk.select_pages]). Because the page that
holds the current token is always kept (``keep_last_pages >= 1``), every scored page is
complete, and the summaries give exactly the selection of the rescan rule
[`BlockTopK.attend_mask`][sparsecorr.decoding.policies.BlockTopK.attend_mask].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Kind, KVPolicy, check_int

__all__ = ["BlockTopK", "keep_counts", "page_means", "pages_to_mask", "select_pages"]


@dataclass(frozen=True)
class BlockTopK(KVPolicy):
    """Page selection by mean-key · mean-query score (see the module docstring)."""

    name: ClassVar[str] = "block_topk"
    kind: ClassVar[Kind] = "selection"
    page_size: int = 16
    keep_first_pages: int = 1
    keep_last_pages: int = 2
    dense_layers: int = 2

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, minimum=1)
        check_int("keep_first_pages", self.keep_first_pages, minimum=0)
        # the page holding the current token must be attended (it is the query's own page)
        check_int("keep_last_pages", self.keep_last_pages, minimum=1)
        check_int("dense_layers", self.dense_layers, minimum=0)

    def attend_mask(self, *, keys: torch.Tensor, query: torch.Tensor, valid: torch.Tensor,
                    positions: torch.Tensor, budget: int, layer_idx: int) -> torch.Tensor:
        """The rule, restated over a whole cache (rescans every key; the engine uses page
        summaries instead). Slots this step attends to: ``[B, H_kv, S]`` bool ⊆ ``valid``.

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


def page_means(keys: torch.Tensor, *, page_size: int) -> torch.Tensor:
    """Mean key of each page of a page-aligned slice of the cache (the page summaries).

    Shapes:
        keys ``[B, H_kv, n · page_size, D]`` -> ``[B, H_kv, n, D]`` in the keys' dtype (the sum
        is taken in float32).
    """
    b, h, s, d = keys.shape
    return keys.reshape(b, h, s // page_size, page_size, d).float().mean(3).to(keys.dtype)


def keep_counts(policy: BlockTopK, *, slots: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Pages each query attends to: ``min(max(budget // page_size, first + last), pages so far)``;
    every page so far where the budget is -1 (dense). Same shape as ``slots`` (any device)."""
    n_pages = slots // policy.page_size + 1
    want = (budgets // policy.page_size).clamp(min=policy.keep_first_pages + policy.keep_last_pages)
    return torch.where(budgets < 0, n_pages, torch.minimum(want, n_pages))


def select_pages(policy: BlockTopK, *, summaries: torch.Tensor, query: torch.Tensor,
                 slots: torch.Tensor, budgets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The pages each query attends to, scored from the page summaries.

    For a query at slot \(s\) (its position: selection policies never evict) the candidate pages
    are \(0 \dots \lfloor s / p \rfloor\); the first ``keep_first_pages`` and the last
    ``keep_last_pages`` of them are forced; the rest compete by
    \(\bar k_{\text{page}} \cdot \bar q\) (\(\bar q\): the query's mean over its KV group's query
    heads) for the remaining places of
    [`keep_counts`][sparsecorr.decoding.policies.block_topk.keep_counts].

    Args:
        summaries: mean key of every complete page (entries of incomplete pages are ignored).
        query: the step's queries (post-RoPE).
        slots: slot of each query's token.
        budgets: budget in force for each query (-1 = dense).
        k: at least the largest keep count (a host int, so no device sync is needed).

    Shapes:
        summaries ``[B, H_kv, P, D]``; query ``[B, H_q, Q, D]``; slots, budgets ``[B, Q]`` ->
        pages ``[B, H_kv, Q, k]`` (ascending; unused entries last, set to P) and ok
        ``[B, H_kv, Q, k]`` bool.
    """
    b, h, n_pages, d = summaries.shape
    q_len = query.shape[2]
    mean_q = query.float().reshape(b, h, -1, q_len, d).mean(2)  # [B, H, Q, D]
    score = torch.einsum("bhqd,bhpd->bhqp", mean_q, summaries.float())
    page = torch.arange(n_pages, device=summaries.device)
    current = (slots // policy.page_size)[:, None, :, None]  # [B, 1, Q, 1]
    forced = (page < policy.keep_first_pages) | (page > current - policy.keep_last_pages)
    score = torch.where(forced, torch.inf, score).masked_fill(page > current, -torch.inf)
    k = min(k, n_pages)
    top = score.topk(k, dim=-1).indices
    ok = torch.arange(k, device=top.device) < keep_counts(policy, slots=slots, budgets=budgets)[:, None, :, None]
    pages = torch.where(ok, top, n_pages).sort(-1).values
    return pages, pages < n_pages


def pages_to_mask(pages: torch.Tensor, ok: torch.Tensor, *, page_size: int, slots: int) -> torch.Tensor:
    """Slot mask of selected pages: ``[B, H_kv, Q, K]`` pages -> ``[B, H_kv, Q, slots]`` bool."""
    n_pages = -(-slots // page_size)
    chosen = torch.zeros(*pages.shape[:-1], n_pages + 1, dtype=torch.bool, device=pages.device)
    chosen.scatter_(-1, torch.where(ok, pages, n_pages).clamp(max=n_pages), True)
    return chosen[..., :n_pages].repeat_interleave(page_size, dim=-1)[..., :slots]
