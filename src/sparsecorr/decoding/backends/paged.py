r"""Paged decode: single-token steps read the engine's KV pool through page tables.

The engine's pool for one layer is ``[B, H_kv, C, D]`` with ``C`` a multiple of the page size,
so seen as ``[B · H_kv · C / page, page, D]`` it is already a paged KV pool in FlashInfer's NHD
layout with one KV head per request (request ``r = b · H_kv + h``, its GQA group's query heads
are the request's query heads). Per decode step the backend builds **one** table of every row's
valid pages (shared by every dense layer, every eviction-policy layer: all layers hold the same
number of slots) and, for a selection policy, **one** table layout for the selected pages
(every sparse layer keeps the same number of pages per row), planned once; each sparse layer
then writes its own page ids into that table's index buffer before its kernel runs.

Soft-capping (Gemma 2) is planned: the kernel's ``plan`` takes ``softcap`` (FlashInfer's
``logits_soft_cap``, \(c \tanh(\ell / c)\) on the scaled logits), so ``begin_step`` takes it too.
Learned sinks (GPT-OSS) need no kernel support: a kernel that returns the log-sum-exp
\(\mathrm{lse} = \log \sum_j e^{\ell_j}\) of a request's logits gives the sink-normalised output
as a per-head rescale, \(o \cdot \sigma(\mathrm{lse} - s_h)\) (`apply_sinks`), with the LSE and the
sink logit both in natural-log units.

The kernel is pluggable: `FlashInferDecode` on a GPU, [`ReferenceDecodeKernel`][sparsecorr.decoding.backends.paged.ReferenceDecodeKernel]
(the float32 oracle, CPU) in the CPU tests, which therefore run the same tables, plans and index
writes the GPU path runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from .paging import (
    PageTable,
    SelectionOffsets,
    dense_page_table,
    paged_attention_reference,
    scatter_selected_pages,
    selection_offsets,
)
from .torch_ref import TorchBackend, check_sinks, check_softcap

__all__ = ["DecodeKernel", "PagedBackend", "ReferenceDecodeKernel", "apply_sinks"]


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *, heads: int) -> torch.Tensor:
    r"""Fold per-query-head sink logits into a paged kernel's output through its log-sum-exp.

    With \(S = \sum_j e^{\ell_j} = e^{\mathrm{lse}}\), attention with a sink \(s_h\) in the
    denominator is \(\sum_j e^{\ell_j} v_j / (S + e^{s_h}) = o \cdot S / (S + e^{s_h}) =
    o \cdot \sigma(\mathrm{lse} - s_h)\): a per-(request, head) scale, no change to the kernel.
    ``lse`` must be in natural-log units (FlashInfer's base-2 LSE is converted by
    `FlashInferDecode.run`). Device ops only (no host sync), so it runs inside a CUDA graph.

    Shapes:
        out ``[R, G, D]`` with ``R = B · heads`` requests (request ``b · heads + h``, query head
        ``h · G + g``); lse ``[R, G]``; sinks ``[heads · G]`` -> ``[R, G, D]`` float32.
    """
    r, g, d = out.shape
    w = torch.sigmoid(lse.float().reshape(-1, heads, g) - sinks.float().reshape(1, heads, g))
    return (out.float().reshape(-1, heads, g, d) * w[..., None]).reshape(r, g, d)


class DecodeKernel(Protocol):
    """A paged decode-attention kernel: plan once per step, run once per layer.

    ``plan`` takes the table's ``indptr`` and ``last_page_len`` on the host (CPU int32) and its
    ``indices`` on the device; with ``graph_buffers`` (CUDA-graph mode) it copies the tables into
    those fixed buffers and ``run`` reads them there, for a fixed number of requests. ``run``
    has no backward (FlashInfer's kernels have none): a grad-enabled forward must not use it.
    """

    def plan(self, table: PageTable, *, dtype: torch.dtype, scale: float | None = None,
             softcap: float | None = None) -> None: ...

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *,
            return_lse: bool = True): ...


class ReferenceDecodeKernel:
    """[`paged_attention_reference`][sparsecorr.decoding.backends.paging.paged_attention_reference]
    behind the kernel interface (float32, any device; slow, for tests). It keeps FlashInfer's
    contract, so the CPU tests exercise what the GPU kernel relies on: with ``graph_buffers``,
    ``plan`` copies the tables into them (and refuses a different number of requests) and
    ``run`` reads them at run time; the output carries no gradient."""

    def __init__(self, *, graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 **_: object) -> None:
        self.table: PageTable | None = None
        self.scale: float | None = None
        self.softcap: float | None = None
        self.buffers = graph_buffers

    def plan(self, table: PageTable, *, dtype: torch.dtype, scale: float | None = None,
             softcap: float | None = None) -> None:
        self.scale, self.softcap = scale, softcap
        if self.buffers is None:
            self.table = table
            return
        indptr, indices, last = self.buffers
        if table.num_requests != last.numel():
            raise ValueError(f"table: the batch size should be fixed in cuda-graph mode: expected "
                             f"{last.numel()} requests, got {table.num_requests}")
        nnz = table.indices.numel()
        indptr.copy_(table.indptr)
        if indices.data_ptr() != table.indices.data_ptr():
            indices[:nnz].copy_(table.indices)
        last.copy_(table.last_page_len)
        self.table = PageTable(indptr=indptr, indices=indices, last_page_len=last, page_size=table.page_size)

    def run(self, q, k_pool, v_pool, *, return_lse: bool = True):
        with torch.no_grad():
            out, lse = paged_attention_reference(q, k_pool, v_pool, self.table, scale=self.scale,
                                                 softcap=self.softcap)
        return (out, lse) if return_lse else out


class PagedBackend:
    """Decode steps through a paged kernel; prefill and multi-token chunks through SDPA.

    Args:
        kernel_factory: ``(device=..., group_size=..., head_dim=..., graph_buffers=None) ->
            DecodeKernel``.
        name: recorded in ``RolloutBatch.meta["backend"]``.
    """

    paged = True
    additive_mask = False  # prefill chunks go to SDPA with the boolean mask

    def __init__(self, kernel_factory: Callable[..., DecodeKernel], *, name: str) -> None:
        self.name = name
        self._factory = kernel_factory
        self._chunks = TorchBackend()
        self._softcap: float | None = None  # the model's soft-cap, as last planned
        self.reset_graph()

    def reset_graph(self) -> None:
        """Back to eager kernels (planned for any batch size); called when a capture fails."""
        self._dense: DecodeKernel | None = None
        self._sparse: DecodeKernel | None = None
        self._buffer: torch.Tensor | None = None
        self._indptr: torch.Tensor | None = None
        self._offsets: SelectionOffsets | None = None  # the step's write positions
        self._static_offsets: SelectionOffsets | None = None  # their fixed buffers (graph mode)
        self._graph = False
        self._plans: list[tuple[DecodeKernel, PageTable, torch.dtype, float]] = []  # this step's plans

    def attend(self, query, key, value, allowed, *, scaling, softcap=None, sinks=None):
        return self._chunks.attend(query, key, value, allowed, scaling=scaling, softcap=softcap, sinks=sinks)

    def _plan(self, kernel: DecodeKernel, table: PageTable, *, dtype: torch.dtype, scale: float) -> None:
        cap = {} if self._softcap is None else {"softcap": self._softcap}  # kernels without soft-cap keep working
        kernel.plan(table, dtype=dtype, scale=scale, **cap)
        self._plans.append((kernel, table, dtype, scale))

    def enable_graph(self, *, batch: int, heads: int, pages_per_row: int, keep_cap: int, group: int,
                     head_dim: int, device: torch.device) -> None:
        """Kernels with fixed table buffers for ``batch`` rows (CUDA graphs): ``plan`` copies each
        step's table into them, and a captured step reads them at fixed addresses. A selection
        kernel (``keep_cap > 0``) gets its own buffers; the backend writes its ``indptr``."""
        r = batch * heads
        i32 = dict(dtype=torch.int32, device=device)
        self._graph = True
        self._dense = self._factory(device=device, group_size=group, head_dim=head_dim, graph_buffers=(
            torch.zeros(r + 1, **i32), torch.zeros(r * pages_per_row, **i32), torch.zeros(r, **i32)))
        self._sparse = self._indptr = self._buffer = self._offsets = self._static_offsets = None
        if keep_cap > 0:
            self._indptr, self._buffer = torch.zeros(r + 1, **i32), torch.zeros(r * keep_cap + 1, **i32)
            i64 = dict(dtype=torch.long, device=device)
            self._static_offsets = SelectionOffsets(pos=torch.zeros(r * keep_cap, **i64),
                                                    base=torch.arange(r, **i64)[:, None] * pages_per_row)
            self._sparse = self._factory(device=device, group_size=group, head_dim=head_dim,
                                         graph_buffers=(self._indptr, self._buffer, torch.zeros(r, **i32)))

    def begin_step(self, *, lengths: torch.Tensor, keep: torch.Tensor | None, heads: int,
                   group: int, head_dim: int, pages_per_row: int, page_size: int,
                   dtype: torch.dtype, scale: float, device: torch.device, k: int = 0,
                   softcap: float | None = None) -> None:
        """Plan one decode step (host work; no per-layer planning, no blocking copy: the kernel
        gets ``indptr`` / ``last_page_len`` on the host, the rest moves with non-blocking copies).
        For a selection (``keep`` given) the CSR write positions of every sparse layer's ``k``
        selected pages per row are built here too, once per step, on the host
        ([`selection_offsets`][sparsecorr.decoding.backends.paging.selection_offsets]; in graph
        mode into fixed buffers), and each layer's `decode` only scatters its page ids.
        ``softcap`` (the model's attention logit soft-cap, or None) is planned into the kernels;
        without it the step is planned with the soft-cap the last `decode` asked for.

        Shapes:
            lengths: ``[B]`` CPU, slots each row attends after this step's write; keep: ``[B]``
            CPU pages each sparse layer keeps per row (selection policies) or None; ``k``: entries
            per row of each layer's selection (``>= keep.max()``; default ``keep.max()``).
        """
        if softcap is not None:
            check_softcap(softcap)
            self._softcap = softcap
        self._plans = []
        if self._dense is None:
            self._dense = self._factory(device=device, group_size=group, head_dim=head_dim)
        geo = dict(heads=heads, pages_per_row=pages_per_row, page_size=page_size)
        self._pages_per_row = pages_per_row
        table = dense_page_table(lengths, device=device, **geo)
        self._plan(self._dense, table, dtype=dtype, scale=scale)
        if keep is None:
            return
        if self._sparse is None:  # only selection policies plan a second (sparse) table
            self._sparse = self._factory(device=device, group_size=group, head_dim=head_dim)
        counts = keep.long().cpu().repeat_interleave(heads)
        indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32)
        indptr[1:] = counts.cumsum(0).to(torch.int32)
        nnz = int(indptr[-1])
        k = k or int(keep.max())
        if self._graph:  # the fixed buffers: written here, not left to the kernel's plan
            self._indptr.copy_(indptr, non_blocking=True)
            offsets = selection_offsets(indptr, k=k, pages_per_row=pages_per_row, dump=self._buffer.numel() - 1)
            pos = self._static_offsets.pos[:offsets.pos.numel()]  # all of it at the captured k
            pos.copy_(offsets.pos, non_blocking=True)
            self._offsets = SelectionOffsets(pos=pos, base=self._static_offsets.base)
        else:
            self._buffer = torch.zeros(nnz + 1, dtype=torch.int32, device=device)
            self._indptr = indptr.to(device, non_blocking=True)
            offsets = selection_offsets(indptr, k=k, pages_per_row=pages_per_row, dump=nnz)
            self._offsets = SelectionOffsets(pos=offsets.pos.to(device, non_blocking=True),
                                             base=offsets.base.to(device, non_blocking=True))
        self._plan(self._sparse, PageTable(indptr=indptr, indices=self._buffer[:nnz],
                                           last_page_len=table.last_page_len, page_size=page_size),
                   dtype=dtype, scale=scale)

    def _replan(self, softcap: float | None) -> None:
        """A `decode` asked for another soft-cap than the step was planned with: plan the step's
        tables again with it and keep it for the next steps. Host work once, on the first decode
        of a run whose caller did not pass the soft-cap to `begin_step`; in CUDA-graph mode the
        warm-up before a capture does it (the plan copies into the fixed table buffers), a capture
        itself cannot."""
        if self._graph and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"softcap: this CUDA-graph step was planned with softcap={self._softcap!r} and a "
                             f"layer asked for {softcap!r} during the capture; pass the model's softcap to "
                             "begin_step")
        self._softcap = softcap
        plans, self._plans = self._plans, []
        for kernel, table, dtype, scale in plans:
            self._plan(kernel, table, dtype=dtype, scale=scale)

    def decode(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *,
               selected: tuple[torch.Tensor, torch.Tensor] | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One layer's decode attention (no backward: the engine never routes a grad-enabled
        forward here). ``softcap`` must be what the step was planned with (else the step is
        planned again, eagerly: `_replan`); ``sinks`` (per query head, natural-log units) asks the
        kernel for its LSE and rescales the output (`apply_sinks`).

        Shapes:
            query ``[B, H_q, 1, D]``; k_pool, v_pool ``[B, H_kv, C, D]`` (the whole pool);
            selected: pages ``[B, H_kv, K]`` ascending and ok ``[B, H_kv, K]``; sinks ``[H_q]``
            -> ``[B, H_q, 1, D]``.
        """
        b, hq, _, d = query.shape
        h = k_pool.shape[1]
        if softcap != self._softcap:
            check_softcap(softcap)
            self._replan(softcap)
        check_sinks(sinks, hq)
        kernel = self._dense
        if selected is not None:
            scatter_selected_pages(self._buffer, self._indptr, *selected, pages_per_row=self._pages_per_row,
                                   offsets=self._offsets)
            kernel = self._sparse
        ps = k_pool.shape[2] // self._pages_per_row
        args = (query.reshape(b * h, hq // h, d), k_pool.reshape(-1, ps, d), v_pool.reshape(-1, ps, d))
        if sinks is None:
            out = kernel.run(*args, return_lse=False)
        else:
            out = apply_sinks(*kernel.run(*args, return_lse=True), sinks, heads=h)
        return out.to(query.dtype).reshape(b, hq, 1, d)
