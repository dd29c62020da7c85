r"""Page tables for paged-KV attention kernels (FlashInfer), built from kept sets on any device.

A paged KV kernel reads, for each *request*, a list of pages of a shared KV pool in CSR form:
``indptr [R + 1]`` (request r's pages are ``indices[indptr[r]:indptr[r + 1]]``), ``indices
[nnz]`` (page ids into the pool) and ``last_page_len [R]`` (valid tokens of each request's last
page, in ``[1, page_size]``; every other page is full). This is FlashInfer's layout.

Sparse policies keep a different set of tokens for every (sequence, KV head), so each pair is
one request with a single KV head, and the query heads of its GQA group become that request's
query heads: request ``r = b · H_kv + h``. Then

- **token-level eviction** (StreamingLLM, SnapKV, R-KV) uses page size 1: the kept slots of
  row r are pages ``r · S + index``;
- **block selection** (BlockTopK) uses page size 16: the selected pages of row r are pages
  ``r · ⌈S / 16⌉ + p``, and only the row's final (partial) page may be short.

[`paged_attention_reference`][sparsecorr.decoding.backends.paging.paged_attention_reference]
reads a pool through a page table in plain torch (float32): it is the CPU oracle that checks
these tables, and the reference the GPU kernel is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "PageTable",
    "SelectionOffsets",
    "dense_page_table",
    "page_table_from_keep",
    "page_table_from_mask",
    "paged_attention_reference",
    "scatter_selected_pages",
    "selection_offsets",
]


@dataclass(frozen=True)
class PageTable:
    """CSR page table of ``R`` requests over a pool of pages of ``page_size`` tokens.

    Shapes:
        indptr: ``[R + 1]`` int32; indices: ``[nnz]`` int32; last_page_len: ``[R]`` int32.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    page_size: int

    @property
    def num_requests(self) -> int:
        return self.indptr.numel() - 1

    def kv_lengths(self) -> torch.Tensor:
        """Tokens attended per request ``[R]``: full pages plus the last page's length."""
        n_pages = (self.indptr[1:] - self.indptr[:-1]).long()
        return ((n_pages - 1).clamp(min=0) * self.page_size
                + torch.where(n_pages > 0, self.last_page_len.long(), 0))


def _csr(counts: torch.Tensor) -> torch.Tensor:
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    indptr[1:] = counts.cumsum(0).to(torch.int32)
    return indptr


def dense_page_table(lengths: torch.Tensor, *, heads: int, pages_per_row: int, page_size: int,
                     device: torch.device | str) -> PageTable:
    """Table of a paged pool read from slot 0 to each row's length (a compact or dense cache).

    The pool is the engine's ``[B, H_kv, pages_per_row · page_size, D]`` K (or V) buffer seen as
    ``B · H_kv · pages_per_row`` pages; request ``r = b · H_kv + h`` reads pages
    ``r · pages_per_row + 0 … ⌈length_b / page_size⌉ - 1``. ``indptr`` and ``last_page_len``
    are built on the host from the host-side ``lengths`` (known to the engine without a device
    sync) and stay there (a paged kernel's ``plan`` reads them on the host); ``indices`` is built
    on ``device`` with a sized ``repeat_interleave`` and non-blocking copies (no sync).

    Shapes:
        lengths: ``[B]`` (CPU, each >= 1) -> ``R = B · H_kv`` requests.
    """
    lengths = lengths.long().cpu()
    n_pages = (lengths + page_size - 1) // page_size
    counts = n_pages.repeat_interleave(heads)
    indptr = _csr(counts)
    nnz = int(indptr[-1])
    nb = dict(non_blocking=True)  # fresh host tensors: staged, no stream sync
    req = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts.to(device, **nb),
                                  output_size=nnz)
    k = torch.arange(nnz, device=device) - indptr[:-1].to(device, **nb).long()[req]
    return PageTable(indptr=indptr, indices=(req * pages_per_row + k).to(torch.int32),
                     last_page_len=(lengths - (n_pages - 1) * page_size).repeat_interleave(heads).to(torch.int32),
                     page_size=page_size)


@dataclass(frozen=True)
class SelectionOffsets:
    """Where each entry of a step's page selection goes in a table's ``indices`` buffer (the same
    for every sparse layer of the step; built once by
    [`selection_offsets`][sparsecorr.decoding.backends.paging.selection_offsets]).

    Shapes:
        pos ``[R · K]`` long: buffer position of entry ``(r, i)`` of a selection in rank order
        (`sparsecorr.decoding.policies.block_topk.rank_pages`: the query's own page first): with
        ``c_r`` the request's page count, entry 0 goes last (``indptr[r] + c_r - 1``: a paged
        kernel reads a request's last page as the partial one), entry ``0 < i < c_r`` to
        ``indptr[r] + i - 1``, the rest to the dump entry ``buffer[-1]``; base ``[R, 1]`` long:
        ``r · pages_per_row`` (the first page of request ``r``'s pool row).
    """

    pos: torch.Tensor
    base: torch.Tensor


def selection_offsets(indptr: torch.Tensor, *, k: int, pages_per_row: int, dump: int) -> SelectionOffsets:
    """The CSR write positions of a selection of ``k`` pages per request, once per step.

    Args:
        indptr: the selection table's ``[R + 1]`` offsets (on the buffer's device).
        k: entries per request in the selection (``pages.shape[-1]``).
        pages_per_row: pages of one (sequence, KV head) row in the pool.
        dump: the dump position (``buffer.numel() - 1``).
    """
    r = indptr.numel() - 1
    start, counts = indptr[:-1].long()[:, None], (indptr[1:] - indptr[:-1]).long()[:, None]
    i = torch.arange(k, device=indptr.device)
    at = torch.where(i == 0, counts - 1, i - 1)  # rank 0 (the query's own page) last, the others before it
    pos = torch.where(i < counts, start + at, dump)
    return SelectionOffsets(pos=pos.reshape(-1), base=torch.arange(r, device=indptr.device)[:, None] * pages_per_row)


def scatter_selected_pages(buffer: torch.Tensor, indptr: torch.Tensor, pages: torch.Tensor,
                           ok: torch.Tensor, *, pages_per_row: int,
                           offsets: SelectionOffsets | None = None) -> None:
    """Write a selection's page ids into a table's ``indices`` buffer, in place, on its device.

    Request ``r``'s ``ok`` pages are the first ones of its ``pages`` row, in rank order (the
    query's own page first, as `sparsecorr.decoding.policies.block_topk.rank_pages` ranks them),
    and go to ``buffer[indptr[r] : indptr[r + 1]]`` with the own page last (a paged kernel reads
    a request's last page as the partial one; attention does not depend on the order of the
    others); the rest go to the dump entry ``buffer[-1]``. The
    counts of ``ok`` must match ``indptr`` (the engine derives both from the same keep counts;
    the write positions are taken from ``indptr``, so ``ok`` itself is not read). With ``offsets`` (built once per step by
    [`selection_offsets`][sparsecorr.decoding.backends.paging.selection_offsets]; then ``ok`` is
    already encoded in them) a layer's write is two ops: the page ids plus the row's base, written
    as int32, and one scatter.

    Shapes:
        buffer ``[nnz + 1]`` int32; indptr ``[R + 1]`` (on buffer's device); pages, ok
        ``[B, H_kv, K]`` with ``R = B · H_kv``.
    """
    r = pages.shape[0] * pages.shape[1]
    flat = pages.reshape(r, -1)
    if offsets is None:
        offsets = selection_offsets(indptr, k=flat.shape[1], pages_per_row=pages_per_row, dump=buffer.numel() - 1)
    vals = torch.add(flat, offsets.base, out=torch.empty(flat.shape, dtype=buffer.dtype, device=buffer.device))
    buffer.scatter_(0, offsets.pos, vals.reshape(-1))


def page_table_from_keep(index: torch.Tensor, valid: torch.Tensor, *, slots: int) -> PageTable:
    """Page-size-1 table of a token-level kept set (eviction policies).

    Args:
        index: kept slot indices into each row's ``slots`` cache slots.
        valid: which entries of ``index`` are real.
        slots: cache slots per (sequence, KV head) row in the pool (the pool holds
            ``B · H_kv · slots`` pages of one token).

    Shapes:
        index, valid: ``[B, H_kv, K]`` -> a table with ``R = B · H_kv`` requests.
    """
    if index.shape != valid.shape or index.dim() != 3:
        raise ValueError(
            f"index/valid: expected two [B, H_kv, K] tensors of one shape, got "
            f"{tuple(index.shape)} and {tuple(valid.shape)}"
        )
    if valid.dtype != torch.bool:
        raise ValueError(f"valid: expected dtype torch.bool, got {valid.dtype}")
    b, h, k = index.shape
    counts = valid.reshape(b * h, k).sum(-1)
    if (counts == 0).any():
        raise ValueError("valid: every (sequence, KV head) row must keep at least one token")
    rows = torch.arange(b * h, device=index.device)[:, None] * slots
    pages = (rows + index.reshape(b * h, k))[valid.reshape(b * h, k)]
    return PageTable(
        indptr=_csr(counts),
        indices=pages.to(torch.int32),
        last_page_len=torch.ones(b * h, dtype=torch.int32, device=index.device),
        page_size=1,
    )


def page_table_from_mask(mask: torch.Tensor, lengths: torch.Tensor, *, page_size: int) -> PageTable:
    """Table of a page-aligned attention mask (selection policies such as BlockTopK).

    Args:
        mask: which cached tokens a decode step attends to; must be page-aligned: within a
            page, every valid token is selected or none is.
        lengths: valid tokens of each row (the full KV is kept; tokens ``[0, length)``).
        page_size: tokens per page (Sparrow: 16).

    Shapes:
        mask: ``[B, H_kv, S]`` bool; lengths: ``[B]`` or ``[B, H_kv]`` -> ``R = B · H_kv``.
    """
    if mask.dim() != 3 or mask.dtype != torch.bool:
        raise ValueError(f"mask: expected a [B, H_kv, S] bool tensor, got {tuple(mask.shape)} {mask.dtype}")
    b, h, s = mask.shape
    lengths = lengths.reshape(b, -1).expand(b, h).reshape(-1).long()
    n_pages = -(-s // page_size)
    pad = n_pages * page_size - s
    m = torch.nn.functional.pad(mask.reshape(b * h, s), (0, pad)).reshape(b * h, n_pages, page_size)
    pos = torch.arange(n_pages * page_size, device=mask.device).reshape(n_pages, page_size)
    in_len = pos[None] < lengths[:, None, None]
    if (m & ~in_len).any():
        raise ValueError("mask: selects tokens at or beyond the row's length")
    selected = m.any(-1)
    if ((m != in_len) & selected[..., None]).any():
        raise ValueError(f"mask: expected page-aligned selection (pages of {page_size} tokens)")
    counts = selected.sum(-1)
    if (counts == 0).any():
        raise ValueError("mask: every (sequence, KV head) row must attend to at least one page")
    rows = torch.arange(b * h, device=mask.device)[:, None] * n_pages
    pages = (rows + torch.arange(n_pages, device=mask.device)[None])[selected]
    last_page = (lengths - 1) // page_size  # index of the row's final (maybe partial) page
    last_selected = torch.where(selected, torch.arange(n_pages, device=mask.device), -1).amax(-1)
    partial = lengths - last_page * page_size
    last_len = torch.where(last_selected == last_page, partial, page_size)
    return PageTable(
        indptr=_csr(counts),
        indices=pages.to(torch.int32),
        last_page_len=last_len.to(torch.int32),
        page_size=page_size,
    )


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: PageTable,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Decode attention read through a page table, in float32 (the oracle of the GPU kernel).

    For request r with attended tokens \(j \in J_r\) and logits \(\ell_j = s\, q_r \cdot k_j\)
    (soft-capped to \(c \tanh(\ell_j / c)\) with ``softcap`` \(c\), as FlashInfer's
    ``logits_soft_cap``): \(o_r = \sum_{j} \mathrm{softmax}_j(\ell)\, v_j\) and
    \(\mathrm{lse}_r = \log \sum_j e^{\ell_j}\) (natural log; FlashInfer reports base 2,
    convert with \(\ln 2\)).

    Shapes:
        q: ``[R, G, D]`` (G query heads per request); k_pool, v_pool: ``[P, page_size, D]``
        -> out ``[R, G, D]``, lse ``[R, G]`` (float32).
    """
    r, g, d = q.shape
    scale = d**-0.5 if scale is None else scale
    ps = table.page_size
    out = torch.empty(r, g, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(r, g, dtype=torch.float32, device=q.device)
    indptr = table.indptr.tolist()
    for i in range(r):  # reference: clarity over speed
        pages = table.indices[indptr[i]: indptr[i + 1]].long()
        k = k_pool[pages].float().reshape(-1, d)
        v = v_pool[pages].float().reshape(-1, d)
        n = (pages.numel() - 1) * ps + int(table.last_page_len[i])
        logits = scale * q[i].float() @ k[:n].T  # [G, n]
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        lse[i] = torch.logsumexp(logits, dim=-1)
        out[i] = torch.softmax(logits, dim=-1) @ v[:n]
    return out, lse
