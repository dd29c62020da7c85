r"""The decoding engine: feeds chunks of tokens through the model into the KV pool.

One primitive serves the prefill, the decode steps and teacher forcing: ``feed`` writes a
``[B, Q]`` chunk (row ``b`` has ``real_b`` real tokens, the rest padding) at each row's next
free slots and runs one forward; ``compress_due`` then evicts the rows whose cache exceeds
``budget + buffer`` (host-side bookkeeping: every row's slot count and context length live on
the host, so no decision syncs the device). The per-context budget is a table looked up, not a
schedule called per step.

- **Prefill** feeds the prompt in chunks of ``prefill_chunk`` tokens and compresses between
  chunks, so an eviction policy's cache never holds more than ``budget + buffer +
  prefill_chunk`` slots; logits are computed only at each row's last prompt token.
- **Decode** feeds one token per row.
- **Teacher forcing** feeds the forced tokens in chunks that end exactly where some row's next
  compression is due (``tokens_until_compress``), so the kept set seen by every token is the one
  the one-token-per-step loop sees, with one forward per chunk instead of per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.attention.bias import causal_lower_right

from .backends import AttentionBackend
from .cache import SparseKVCache, Step
from .hf import forward, model_spec
from .policies import KVPolicy, keep_counts, selection_plan
from .pool import KVPool, ring_order, ring_slots

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Engine", "pool_capacity"]


def pool_capacity(policy: KVPolicy, table: torch.Tensor, *, longest: int, chunk: int) -> int:
    """Most slots a row can hold: the whole context for dense, selection or dense-at-some-length
    runs; else ``max budget + buffer + max(chunk, 1)`` (a chunk is fed before compressing)."""
    if not policy.evicts or bool((table[1:longest + 1] < 0).any()):
        return longest
    return min(longest, int(table[1:longest + 1].max()) + policy.buffer + max(chunk, 1))


class Engine:
    """Model + KV pool + host bookkeeping for one ``generate`` / teacher-forcing call.

    Args:
        model: the Hugging Face causal LM (its attention routed to ``"sparsecorr"``).
        policy: the KV policy.
        backend: the attention backend.
        table: budget by context length (``table[c]``, -1 = dense), CPU long.
        batch: rows.
        capacity: slots per row to allocate (see `pool_capacity`).
        grad: autograd on (every pool update out of place).
        cuda_graph: replay single-token decode steps as CUDA graphs.
        fused: run the captured step's model forward compiled (`sparsecorr.decoding.fused`).
        rows: the caller's row index of each engine row (CPU long ``[batch]``; default
            ``arange``), kept through `select_rows` (kept-set records are keyed by it).

    The engine owns the pool, the graphs and the backend's per-call state; `close` drops them
    all (``generate`` calls it in a ``finally``), and no reference cycle runs through it, so
    dropping the engine frees them at once.
    """

    def __init__(self, model: PreTrainedModel, *, policy: KVPolicy, backend: AttentionBackend, table: torch.Tensor,
                 batch: int, capacity: int, grad: bool, cuda_graph: bool = False, fused: bool = False,
                 rows: torch.Tensor | None = None) -> None:
        self.spec = spec = model_spec(model)  # refuses attention variants it would get wrong
        self.model, self.policy, self.table = model, policy, table
        self.n_layers, self.heads_q, self.heads_kv = spec.layers, spec.heads_q, spec.heads_kv
        self.head_dim = spec.head_dim
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        evicts, selects = policy.evicts, policy.kind == "selection"
        self.pool = KVPool(layers=self.n_layers, batch=batch, kv_heads=self.heads_kv, q_heads=self.heads_q,
                           head_dim=self.head_dim, capacity=capacity,
                           page_size=policy.page_size if selects else 16, dtype=self.dtype,
                           device=self.device, positions=evicts,
                           window=getattr(policy, "window", 0) if evicts else 0,
                           summaries=selects, grad=grad)
        self.cache = SparseKVCache(self.pool, policy=policy, backend=backend)
        self.count = torch.zeros(batch, dtype=torch.long)  # valid slots per row (host)
        self.ctx = torch.zeros(batch, dtype=torch.long)  # tokens fed per row (host)
        self.peak_slots = 0  # max over forwards of rows x slots read
        self.keep_cap = self._keep_cap() if selects else 0
        self.rows = torch.arange(batch) if rows is None else rows  # the caller's row of each engine row
        self.kept_events: list | None = None  # set to [] to record every compression's kept sets
        self.forced_keep: dict | None = None  # {(row, context): positions [L, H, K]}: replay these
        self.graphs = None
        if cuda_graph:
            from .fused import fused_status
            from .graphs import DecodeGraphs

            # no reference back to the engine: no cycle to collect; a fused step that failed for
            # this model state before is not attempted again
            self.graphs = DecodeGraphs(fused=fused_status(model) if fused else "off")

    def _keep_cap(self) -> int:
        """Most pages a sparse layer keeps in this run (a static size for CUDA graphs)."""
        ppr, pol = self.pool.pages_per_row, self.policy
        if bool((self.table[1:] < 0).any()):
            return ppr
        want = max(int(self.table[1:].max()) // pol.page_size, pol.keep_first_pages + pol.keep_last_pages)
        return min(ppr, want)

    # -- host-side plans -----------------------------------------------------------------
    def budget_at(self, ctx: torch.Tensor) -> torch.Tensor:
        return self.table[ctx.clamp(max=self.table.numel() - 1)]

    def tokens_until_compress(self, cap: int) -> int:
        """Largest n <= cap such that feeding n tokens to every row triggers no compression
        before the n-th (the n-th may trigger one)."""
        if not self.policy.evicts or cap <= 1:
            return max(cap, 1)
        n = torch.arange(1, cap + 1)
        budget = self.budget_at(self.ctx[:, None] + n)
        due = (budget >= 0) & (self.count[:, None] + n > budget + self.policy.buffer)
        first = torch.where(due.any(1), due.float().argmax(1) + 1, cap)
        return int(first.min())

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        """Host bookkeeping to the device without a stream sync (the host copy is staged first)."""
        return t.to(self.device, non_blocking=True)

    def _step(self, q_len: int, real: torch.Tensor, decode: bool) -> Step:
        dev = self.device
        i = torch.arange(q_len)
        slots = torch.where(i < real[:, None], self.count[:, None] + i, self.pool.scratch)
        kv_len = int((self.count + real).max())
        counts = self._dev(self.count)
        uniform = q_len == 1 and bool((self.count + 1 == kv_len).all())
        # full rows at one count: plain causal attention aligned to the end (SDPA, no mask tensor)
        aligned = (q_len > 1 and bool((real == q_len).all() and (self.count + q_len == kv_len).all())
                   and not (decode and self.policy.kind == "selection"))
        mask = None if uniform else causal_lower_right(q_len, kv_len) if aligned else (
            torch.arange(kv_len, device=dev) <= (counts[:, None] + torch.arange(q_len, device=dev))[:, :, None])[:, None]
        st = Step(q_len=q_len, kv_len=kv_len, slots=self._dev(slots), positions=self._dev(self.ctx[:, None] + i),
                  real=self._dev(real), mask=mask, counts=counts)
        if self.pool.win is not None:  # the queries' ring columns, once per step (not per layer)
            st.win_slots = self._dev(ring_slots(self.ctx, real, q_len, self.pool.window))
        if self.policy.kind == "selection":
            ps = self.pool.page_size
            st.pages = self._dev(slots // ps)  # the running page sums' index, once per step
            if decode:
                qslots = self.count[:, None] + i
                budgets = self.budget_at(self.ctx[:, None] + i + 1)
                keep = keep_counts(self.policy, slots=qslots, budgets=budgets)
                st.select, st.keep_max = True, int(keep.max())
                st.query_slots, st.budgets = self._dev(qslots), self._dev(budgets)
                st.plan = selection_plan(self.policy, slots=st.query_slots, budgets=st.budgets, k=st.keep_max,
                                         n_pages=self.pool.pages_per_row, keep=self._dev(keep))
        # a paged kernel has no backward: a grad-enabled forward stays on the autograd path
        st.paged = (bool(getattr(self.cache.backend, "paged", False)) and q_len == 1 and decode
                    and not torch.is_grad_enabled())
        return st

    def _begin_paged_step(self, *, k: int | None = None) -> None:
        """Plan a paged single-token step (one plan per step, shared by every layer). ``k``: the
        pages each sparse layer's selection lists per row (a captured step's static ``keep_cap``;
        default this step's largest keep count)."""
        keep = None
        if self.policy.kind == "selection":
            keep = keep_counts(self.policy, slots=self.count, budgets=self.budget_at(self.ctx + 1))
            k = min(int(keep.max()) if k is None else k, self.pool.pages_per_row)
        self.cache.backend.begin_step(
            lengths=self.count + 1, keep=keep, k=k, heads=self.heads_kv, group=self.heads_q // self.heads_kv,
            head_dim=self.head_dim, pages_per_row=self.pool.pages_per_row, page_size=self.pool.page_size,
            dtype=self.dtype, scale=self.spec.scaling, device=self.device)

    # -- device work ---------------------------------------------------------------------------
    def feed(self, ids: torch.Tensor, real: torch.Tensor, *, decode: bool, logits_to_keep,
             hidden: bool = False):
        """One forward over a ``[B, Q]`` chunk; returns the model output.

        Shapes:
            ids ``[B, Q]`` (device); real ``[B]`` (CPU) real tokens per row (a prefix).
        """
        out = None
        if self.graphs is not None and self.graphs.status == "on" and decode and ids.shape[1] == 1 and not hidden:
            out = self.graphs.run(self, ids)  # None if the capture failed: eager below
        if out is None:
            st = self._step(ids.shape[1], real, decode)
            if st.paged:
                self._begin_paged_step()
            self.cache.step = st
            out = forward(self.model, input_ids=ids, position_ids=st.positions, cache=self.cache,
                          logits_to_keep=logits_to_keep, output_hidden_states=hidden)
        self.peak_slots = max(self.peak_slots, ids.shape[0] * int((self.count + real).max()))
        self.count += real
        self.ctx += real
        return out

    def compress_due(self) -> None:
        """Evict the rows whose cache exceeds ``budget + buffer`` at their context length."""
        if not self.policy.evicts:
            return
        budget = self.budget_at(self.ctx)
        due = (budget >= 0) & (self.count > budget + self.policy.buffer)
        if not bool(due.any()):
            return
        eff = torch.where(due, budget, self.count)
        w = self.pool.window if self.pool.win is not None else 0
        qv = None
        if w and bool((self.ctx < w).any()):  # a row that has not seen a full window yet
            qv = (torch.arange(w) >= w - self.ctx.clamp(max=w)[:, None]).to(self.device)
        forced = None if self.forced_keep is None else self._forced(due)
        order = self._dev(ring_order(self.ctx, w)) if w and forced is None else None
        kept = self.cache.compress(eff, self.count, qv, forced=forced, due=self._dev(due),
                                   record=self.kept_events is not None, order=order)
        if kept is not None:  # the due rows' kept positions, keyed by (caller's row, context)
            self.kept_events.append((self.rows[due], self.ctx[due], kept[self._dev(due.nonzero().squeeze(1))]))
        self.count = torch.minimum(self.count, eff)

    def _forced(self, due: torch.Tensor) -> torch.Tensor:
        """The recorded kept positions of the due rows at their context (``[B, L, H, K]``)."""
        table = self.forced_keep
        rows = []
        for r, c, d in zip(self.rows.tolist(), self.ctx.tolist(), due.tolist()):
            if d and (r, c) not in table:
                raise ValueError(f"keep_sets: no kept set recorded for row {r} at context length {c} (the "
                                 "replay must use the decode's prompts, tokens, policy, budget and prefill_chunk)")
            rows.append(table[(r, c)] if d else None)
        shape = next(t for t in rows if t is not None).shape
        blank = torch.full(shape, -1, dtype=torch.long)
        return self._dev(torch.stack([blank if t is None else t for t in rows]))

    def select_rows(self, keep: torch.Tensor) -> torch.Tensor:
        """Keep the rows where ``keep`` (CPU bool ``[B]``) is True; returns their indices."""
        rows = keep.nonzero().squeeze(1)
        self.pool.select_rows(rows.to(self.device))
        self.count, self.ctx, self.rows = self.count[rows], self.ctx[rows], self.rows[rows]
        return rows

    def close(self) -> None:
        """Drop the graphs, the pool and the cache (with the backend's plans and buffers), so
        nothing this call allocated outlives it, even while a traceback still holds the engine."""
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = None
        if self.cache is not None:
            self.cache.step = None
            reset = getattr(self.cache.backend, "reset_graph", None)
            if reset is not None:
                reset()
        self.cache = self.pool = None

    def attended(self, q_len: int) -> torch.Tensor:
        """Mean KV slots attended per layer and KV head by each of the last fed queries.

        Computed on the host: dense and eviction layers read every valid slot; a selection
        policy's sparse layers read their kept pages (the current page partly). Call after
        ``feed``. Shapes: ``[B, q_len]``.
        """
        after = self.count[:, None] - q_len + torch.arange(1, q_len + 1)  # slots incl. the query
        if self.policy.kind != "selection":
            return after.float()
        ps = self.pool.page_size
        slot = after - 1
        budgets = self.budget_at(self.ctx[:, None] - q_len + torch.arange(1, q_len + 1))
        keep = keep_counts(self.policy, slots=slot, budgets=budgets)
        sparse = (keep - 1) * ps + (slot - (slot // ps) * ps + 1)
        dense = min(self.policy.dense_layers, self.n_layers)
        return (dense * after + (self.n_layers - dense) * sparse).float() / self.n_layers
