r"""Paged decode: single-token steps read the engine's KV pool through page tables.

The engine's pool for one layer is ``[B, H_kv, C, D]`` with ``C`` a multiple of the page size,
so seen as ``[B · H_kv · C / page, page, D]`` it is already a paged KV pool in FlashInfer's NHD
layout with one KV head per request (request ``r = b · H_kv + h``, its GQA group's query heads
are the request's query heads). Per decode step the backend builds **one** table of every row's
valid pages (shared by every dense layer, every eviction-policy layer: all layers hold the same
number of slots) and, for a selection policy, **one** table layout for the selected pages
(every sparse layer keeps the same number of pages per row), planned once; each sparse layer
then writes its own page ids into that table's index buffer before its kernel runs.

The kernel is pluggable: `FlashInferDecode` on a GPU, [`ReferenceDecodeKernel`][sparsecorr.decoding.backends.paged.ReferenceDecodeKernel]
(the float32 oracle, CPU) in the CPU tests, which therefore run the same tables, plans and index
writes the GPU path runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from .paging import PageTable, dense_page_table, paged_attention_reference, scatter_selected_pages
from .torch_ref import TorchBackend

__all__ = ["DecodeKernel", "PagedBackend", "ReferenceDecodeKernel"]


class DecodeKernel(Protocol):
    """A paged decode-attention kernel: plan once per step, run once per layer."""

    def plan(self, table: PageTable, *, dtype: torch.dtype, scale: float | None = None) -> None: ...

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class ReferenceDecodeKernel:
    """[`paged_attention_reference`][sparsecorr.decoding.backends.paging.paged_attention_reference]
    behind the kernel interface (float32, any device; slow, for tests)."""

    def __init__(self, **_: object) -> None:
        self.table: PageTable | None = None
        self.scale: float | None = None

    def plan(self, table: PageTable, *, dtype: torch.dtype, scale: float | None = None) -> None:
        self.table, self.scale = table, scale

    def run(self, q, k_pool, v_pool):
        return paged_attention_reference(q, k_pool, v_pool, self.table, scale=self.scale)


class PagedBackend:
    """Decode steps through a paged kernel; prefill and multi-token chunks through SDPA.

    Args:
        kernel_factory: ``(device=..., group_size=..., head_dim=...) -> DecodeKernel``.
        name: recorded in ``RolloutBatch.meta["backend"]``.
    """

    paged = True

    def __init__(self, kernel_factory: Callable[..., DecodeKernel], *, name: str) -> None:
        self.name = name
        self._factory = kernel_factory
        self._chunks = TorchBackend()
        self._dense: DecodeKernel | None = None
        self._sparse: DecodeKernel | None = None
        self._buffer: torch.Tensor | None = None
        self._indptr: torch.Tensor | None = None
        self._graph = False

    def attend(self, query, key, value, allowed, *, scaling):
        return self._chunks.attend(query, key, value, allowed, scaling=scaling)

    def enable_graph(self, *, batch: int, heads: int, pages_per_row: int, keep_cap: int, group: int,
                     head_dim: int, device: torch.device) -> None:
        """Kernels with fixed table buffers for ``batch`` rows (CUDA graphs): ``plan`` copies each
        step's table into them, and a captured step reads them at fixed addresses."""
        r = batch * heads
        i32 = dict(dtype=torch.int32, device=device)
        self._graph = True
        self._dense = self._factory(device=device, group_size=group, head_dim=head_dim, graph_buffers=(
            torch.zeros(r + 1, **i32), torch.zeros(r * pages_per_row, **i32), torch.zeros(r, **i32)))
        self._indptr, self._buffer = torch.zeros(r + 1, **i32), torch.zeros(r * keep_cap + 1, **i32)
        self._sparse = self._factory(device=device, group_size=group, head_dim=head_dim,
                                     graph_buffers=(self._indptr, self._buffer, torch.zeros(r, **i32)))

    def begin_step(self, *, lengths: torch.Tensor, keep: torch.Tensor | None, heads: int,
                   group: int, head_dim: int, pages_per_row: int, page_size: int,
                   dtype: torch.dtype, scale: float, device: torch.device) -> None:
        """Plan one decode step (host work; no per-layer planning).

        Shapes:
            lengths: ``[B]`` CPU, slots each row attends after this step's write; keep: ``[B]``
            CPU pages each sparse layer keeps per row (selection policies) or None.
        """
        if self._dense is None:
            self._dense = self._factory(device=device, group_size=group, head_dim=head_dim)
            self._sparse = self._factory(device=device, group_size=group, head_dim=head_dim)
        geo = dict(heads=heads, pages_per_row=pages_per_row, page_size=page_size)
        self._pages_per_row = pages_per_row
        table = dense_page_table(lengths, device=device, **geo)
        self._dense.plan(table, dtype=dtype, scale=scale)
        if keep is None:
            return
        counts = keep.long().cpu().repeat_interleave(heads)
        indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32)
        indptr[1:] = counts.cumsum(0).to(torch.int32)
        nnz = int(indptr[-1])
        if not self._graph:  # fresh buffers (graph mode: the fixed ones, refilled by plan)
            self._buffer = torch.zeros(nnz + 1, dtype=torch.int32, device=device)
            self._indptr = indptr.to(device)
        self._sparse.plan(PageTable(indptr=indptr, indices=self._buffer[:nnz],
                                    last_page_len=table.last_page_len, page_size=page_size),
                          dtype=dtype, scale=scale)

    def decode(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *,
               selected: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One layer's decode attention.

        Shapes:
            query ``[B, H_q, 1, D]``; k_pool, v_pool ``[B, H_kv, C, D]`` (the whole pool);
            selected: pages ``[B, H_kv, K]`` ascending and ok ``[B, H_kv, K]`` -> ``[B, H_q, 1, D]``.
        """
        b, hq, _, d = query.shape
        h = k_pool.shape[1]
        kernel = self._dense
        if selected is not None:
            scatter_selected_pages(self._buffer, self._indptr, *selected, pages_per_row=self._pages_per_row)
            kernel = self._sparse
        ps = k_pool.shape[2] // self._pages_per_row
        out, _ = kernel.run(query.reshape(b * h, hq // h, d), k_pool.reshape(-1, ps, d),
                            v_pool.reshape(-1, ps, d))
        return out.to(query.dtype).reshape(b, hq, 1, d)
