r"""The sparse KV cache (a transformers cache, through [`hf`][sparsecorr.decoding.hf]) and the attention hook.

The cache writes each forward's K/V into the preallocated [`KVPool`][sparsecorr.decoding.pool.KVPool]
at the slots the engine planned (``Step``), and the attention function registered with
transformers' attention interface under the name ``"sparsecorr"`` reads the active cache from
a context variable and attends: every row's valid slots are ``[0, count_b)``, so a query at
slot \(j\) may read slots \(\le j\) (one ``[B, 1, Q, S]`` mask built once per forward and shared
by every layer; none at all for a single-token step of equal-length rows). Selection policies
pick pages from the running page summaries; a paged backend reads single-token steps through
page tables. Positions are passed explicitly, so RoPE is right after eviction.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .backends import AttentionBackend
from .hf import CacheBase, register_attention
from .policies import (
    KeepSet,
    KVPolicy,
    SelectionPlan,
    compress,
    pages_to_mask,
    rank_pages,
    select_pages,
    selection_plan,
)
from .pool import KVPool

__all__ = ["ATTN_NAME", "SparseKVCache", "Step", "active", "active_cache", "forced_keep", "gather_mask"]

ATTN_NAME = "sparsecorr"
_ACTIVE: contextvars.ContextVar[SparseKVCache | None] = contextvars.ContextVar("sparsecorr_cache", default=None)


@dataclass
class Step:
    """What one forward writes and reads (planned by the engine on the host).

    Shapes:
        slots, positions ``[B, Q]`` (device): write slot and true position of each token (padding
        goes to the scratch page); real ``[B]`` (device): real tokens per row; mask
        ``[B, 1, Q, kv_len]`` or None; query_slots, budgets ``[B, Q]`` (selection only); plan: the
        step's BlockTopK `SelectionPlan` (built once per step, shared by every sparse layer).
    """

    q_len: int
    kv_len: int
    slots: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    mask: torch.Tensor | None
    counts: torch.Tensor  # [B] device, valid slots before this forward
    pages: torch.Tensor | None = None  # [B, Q] page of each write slot (selection: the running page sums)
    select: bool = False  # selection policy in force (decode phase)
    query_slots: torch.Tensor | None = None
    budgets: torch.Tensor | None = None
    keep_max: int = 0
    paged: bool = False  # single-token step through the backend's page tables
    plan: SelectionPlan | None = None  # the selection's per-step part (once per step, not per layer)
    win_slots: torch.Tensor | None = None  # [B, Q] ring columns of the queries (eviction policies)
    bias: list | None = None  # [(mask, its additive bias)] of a single-token step (made by the first layer)
    gather: tuple | None = None  # a single-token selection's bias, k, gather offsets and mask (first sparse layer)


@dataclass(frozen=True)
class _UnitSumUpdate:
    """How a compression event brings R-KV's unit-key sums up to date (every layer it compacts).

    ``drop``: subtract the evicted keys' unit sum (gathered: about 3 reads and writes of each key)
    when that touches fewer keys than re-summing the kept ones, which runs otherwise.

    Shapes:
        counts ``[B]`` device long: the valid slots per row after the event; low: their host
        minimum; evicted: the most keys a row evicts (host).
    """

    counts: torch.Tensor
    low: int
    evicted: int
    drop: bool


class SparseKVCache(CacheBase):
    """Writes into a [`KVPool`][sparsecorr.decoding.pool.KVPool] per the engine's ``Step``."""

    def __init__(self, pool: KVPool, *, policy: KVPolicy, backend: AttentionBackend) -> None:
        super().__init__(len(pool.k))
        self.pool, self.policy, self.backend = pool, policy, backend
        self.step: Step | None = None
        if getattr(policy, "key_norms", False):  # the compression reads the keys' norms from the pool
            pool.track_norms()

    # -- the cache protocol of hf.CacheBase ---------------------------------------------------
    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():  # traced: sparsecorr::attend writes (decoding.fused)
            return key, value
        st, pool = self.step, self.pool
        if layer_idx == 0 and pool.pos is not None:  # every layer's positions, once per step
            pool.write_positions(st.slots, st.positions)
        per_layer = st.pages is not None and self._page_sums_per_layer(st)
        pool.write(layer_idx, key, value, st.slots, st.pages if per_layer else None)
        if layer_idx == self.num_layers - 1:  # every layer's new keys, once per step
            if st.pages is not None and not per_layer:
                pool.add_page_sums(st.slots, st.pages)
            if pool.norms_all is not None:
                pool.add_key_norms(st.slots)
        return self.pool.k[layer_idx][:, :, :st.kv_len], self.pool.v[layer_idx][:, :, :st.kv_len]

    def _page_sums_per_layer(self, st: Step) -> bool:
        """Whether this forward adds its keys to the page sums layer by layer (with each K write)
        instead of once for every layer after the last layer's write (`KVPool.add_page_sums`).

        Deferring is exact where no layer reads a page sum its own write changed: a prefill
        forward reads none (it attends densely), and a single-token step's write goes to the
        query's own page, which is always kept (``keep_last_pages >= 1``: its bias outranks
        every score, so its stale sum changes no selection). A multi-token selecting forward (a
        teacher-forced chunk) can complete a page that a later query of the chunk scores, and
        the per-layer K/V tensors of autograd (``grad``) have no stacked view: both per layer."""
        return (st.select and st.q_len > 1) or self.pool.k_all is None

    def seq_length(self) -> int:
        return 0 if self.step is None else self.step.kv_len

    # -- engine side --------------------------------------------------------------------------
    def attend(self, layer: int, query, key, value, scaling: float) -> torch.Tensor:
        st, pool = self.step, self.pool
        if pool.win is not None:
            pool.push_queries(layer, query, st.win_slots)
        sparse_layer = self.policy.kind == "selection" and layer >= self.policy.dense_layers
        if sparse_layer and st.select:
            return self._attend_selected(layer, query, key, value, scaling)
        if st.paged:
            return self.backend.decode(query, pool.k[layer], pool.v[layer])
        return self.backend.attend(query, key, value, self._step_mask(st.mask, query.dtype), scaling=scaling)

    def _step_mask(self, mask, dtype: torch.dtype):
        """A single-token step's bool mask as the additive bias (0 / -inf in ``dtype``) that a
        backend declaring ``additive_mask = True`` takes, so SDPA converts nothing per layer: made
        by the first layer that asks and shared by the step's other layers (``Step.bias``, keyed by
        the mask object: the step's mask and the selection's gather mask are two)."""
        st = self.step
        if (st.q_len != 1 or not getattr(self.backend, "additive_mask", False)
                or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
            return mask
        st.bias = st.bias or []
        for m, bias in st.bias:
            if m is mask:
                return bias
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)
        st.bias.append((mask, bias))
        return bias

    def _attend_selected(self, layer: int, query, key, value, scaling: float) -> torch.Tensor:
        st, pool = self.step, self.pool
        ps = pool.page_size
        if st.q_len > 1:  # a teacher-forced chunk: one page mask per query
            pages, ok = select_pages(self.policy, summaries=pool.summ[layer], query=query,
                                     slots=st.query_slots, budgets=st.budgets, k=st.keep_max, plan=st.plan)
            sel = pages_to_mask(pages, ok, page_size=ps, slots=st.kv_len)
            return self.backend.attend(query, key, value, sel & st.mask, scaling=scaling)
        # one token: the top pages in rank order, the query's own page first (`rank_pages`: three
        # ops, no fill, no sort); a row's first keep_b ranks are its selection
        b, h = pool.summ_all.shape[1:3]
        if st.gather is None:  # the step's part: the same for every sparse layer
            plan = st.plan if st.plan is not None else selection_plan(
                self.policy, slots=st.query_slots, budgets=st.budgets, k=st.keep_max, n_pages=pool.pages_per_row)
            bias = plan.bias.expand(b, h, 1, plan.n_pages).reshape(b * h, 1, plan.n_pages)
            if st.paged:  # the kernel's table counts keep_b pages per row; the ranks below it
                st.gather = (bias, plan.k, None, plan.ok[:, :, 0].expand(b, h, plan.k))
            else:  # the gathered pages' slot offsets and mask
                allowed = gather_mask(plan.keep[:, :1], st.query_slots[:, :1], k=plan.k, page_size=ps)
                st.gather = (bias, plan.k, torch.arange(ps, device=query.device), allowed[:, :, None, :])
        bias, k, offsets, mask = st.gather
        top = rank_pages(summaries=pool.summ[layer], query=query, bias=bias, k=k)  # [B, H, 1, k]
        if st.paged:  # written into the kernel's page table, the own page last (scatter_selected_pages)
            return self.backend.decode(query, pool.k[layer], pool.v[layer], selected=(top[:, :, 0], mask))
        # gather the selected pages (O(budget) attention instead of O(S)); the own page first, so
        # the slot mask is the step's, not the layer's
        slot = torch.add(offsets, top[..., None], alpha=ps).reshape(b, h, -1)  # in range: pages < P
        idx = slot[..., None].expand(-1, -1, -1, pool.k[layer].shape[-1])
        k_sel, v_sel = pool.k[layer].gather(2, idx), pool.v[layer].gather(2, idx)
        return self.backend.attend(query, k_sel, v_sel, self._step_mask(mask, query.dtype), scaling=scaling)

    def compress(self, budgets: torch.Tensor, counts: torch.Tensor, query_valid: torch.Tensor | None, *,
                 forced: torch.Tensor | None = None, due: torch.Tensor | None = None,
                 record: bool = False, order: torch.Tensor | None = None) -> torch.Tensor | None:
        """Evict every layer down to ``budgets`` (host ``[B]``; a row's own count = keep all).

        ``forced`` replaces the policy's choice on the ``due`` rows by given kept positions (a
        replay of recorded kept sets); with ``record`` the kept true positions of every layer
        are returned (-1 padded). ``order`` (``[B, W]`` device, `sparsecorr.decoding.pool.ring_order`)
        puts each layer's observation ring in time order (one gather per layer, only here; without
        it the ring's columns are read as stored: the votes do not depend on the window's order,
        but their float sums may round differently).

        Shapes:
            budgets, counts ``[B]`` CPU long (valid slots per row before); query_valid ``[B, W]``;
            forced ``[B, L, H_kv, K']`` (device, -1 padded), due ``[B]`` (device bool) ->
            ``[B, L, H_kv, K]`` or None.
        """
        pool, n = self.pool, self.num_layers
        counts_host, s = counts, int(counts.max())
        dev = pool.pos_all.device
        budgets_host, top, budgets = budgets, int(budgets.max()), budgets.to(dev, non_blocking=True)  # once, not per layer
        counts = counts.to(dev, non_blocking=True)
        # every layer in one call (the stacked pool); with grad (per-layer K/V tensors) one layer
        # at a time, so the keys are never copied into a stack
        group = n if pool.k_all is not None else 1
        after = None
        if pool.unit_sum_all is not None:  # R-KV's unit-key sums (stacked pool: one group of every layer)
            pool.sync_unit_sums(counts, low=int(counts_host.min()), high=s)  # up to this event's counts
            left = torch.minimum(counts_host, budgets_host)  # the valid slots per row after it
            # drop the evicted keys' unit sum (gathered: ~3 reads / writes of each) or sum the
            # kept keys (one read), whichever touches fewer keys
            evicted = int((counts_host - left).max())
            after = _UnitSumUpdate(counts=left.to(dev, non_blocking=True), low=int(left.min()), evicted=evicted,
                                   drop=3 * evicted < top)
        kept = [self._compress_layers(range(lo, min(lo + group, n)), s=s, top=top, budgets=budgets, counts=counts,
                                      query_valid=query_valid, forced=forced, due=due, record=record, order=order,
                                      after=after)
                for lo in range(0, n, group)]
        return torch.cat(kept, 1) if record else None

    def _compress_layers(self, layers: range, *, s: int, top: int, budgets, counts, query_valid, forced, due,
                         record: bool, order, after: _UnitSumUpdate | None = None) -> torch.Tensor | None:
        """Score, keep and compact ``layers`` in one `compress` call: the layers are stacked along
        the batch axis (``[n·B, ...]``, layer-major; each (row, head) is scored and kept on its
        own, so nothing mixes layers). Returns the kept positions ``[B, n, H_kv, K]`` if
        ``record``. ``after`` (R-KV's pool): how the pool's unit-key sums follow the event."""
        pool, n, lo, hi = self.pool, len(layers), layers.start, layers.stop
        b, h = pool.pos_all.shape[1:3]
        valid = (torch.arange(s, device=counts.device) < counts.repeat(n)[:, None])[:, None, :].expand(n * b, h, s)
        positions = pool.pos_all[lo:hi, ..., :s].reshape(n * b, h, s)
        if forced is None:
            keys = pool.keys(s, lo, hi)
            keys = keys.reshape(n * b, *keys.shape[2:])
            if pool.win is None:
                q = keys.new_zeros(n * b, h, 0, keys.shape[-1])
            else:
                q = pool.win_all[lo:hi, ..., :pool.window, :] if order is None else pool.windows_in_order(order, lo, hi)
                q = q.reshape(n * b, *q.shape[2:])
            extra = {}
            if pool.norms_all is not None:
                extra["key_norms"] = pool.norms_all[lo:hi, ..., :s].reshape(n * b, h, s)
                extra["unit_sum"] = pool.unit_sum_all[lo:hi].reshape(n * b, h, 1, -1)
            keep = compress(self.policy, keys=keys, queries=q, valid=valid, positions=positions,
                            budget=budgets.repeat(n), max_budget=top, **extra,
                            query_valid=None if query_valid is None else query_valid.repeat(n, 1))
        else:
            want = forced[:, lo:hi].transpose(0, 1).reshape(n * b, *forced.shape[2:])
            keep = forced_keep(positions, valid, want, due.repeat(n), k=min(top, s))
        kept = None
        if record:
            kept = torch.where(keep.valid, positions.gather(-1, keep.index), -1).reshape(n, b, h, -1).transpose(0, 1)
        index, kept_valid = keep.index.reshape(n, b, h, -1), keep.valid.reshape(n, b, h, -1)
        if after is not None and after.drop:
            pool.drop_unit_sums(valid.reshape(n, b, h, s), index, kept_valid, evicted=after.evicted,
                                counts=after.counts, low=after.low)
        pool.compact_all(index, lo)
        if after is not None and not after.drop:
            pool.keep_unit_sums(kept_valid, after.counts, low=after.low)
        return kept


def gather_mask(keep: torch.Tensor, query_slot: torch.Tensor, *, k: int, page_size: int) -> torch.Tensor:
    r"""Which of a single-token step's ``k · page_size`` gathered slots the query reads, the same
    in every sparse layer: entry \(i\) of a row's page list from
    [`rank_pages`][sparsecorr.decoding.policies.block_topk.rank_pages] holds a kept page while
    \(i < \mathrm{keep}\), and entry 0 is the query's own page (ranked first), so slot \(j\)
    of entry \(i\) is read iff \(0 < i < \mathrm{keep}\), or \(i = 0\) and
    \(j \le s \bmod p\) (the query's slot \(s\)).

    Shapes:
        keep, query_slot ``[B, 1]`` -> ``[B, 1, k · page_size]`` bool.
    """
    n = torch.arange(k * page_size, device=keep.device)
    entry, j = n // page_size, n % page_size
    return (((entry > 0) & (entry < keep)) | ((entry == 0) & (j <= query_slot % page_size)))[:, None, :]


def forced_keep(positions: torch.Tensor, valid: torch.Tensor, want: torch.Tensor, due: torch.Tensor, *,
                k: int) -> KeepSet:
    """The kept set that keeps exactly the positions ``want`` on the ``due`` rows (every valid
    slot elsewhere), sorted by position as `compress` sorts it.

    Shapes:
        positions, valid ``[B, H, S]``; want ``[B, H, K']`` (-1 padded); due ``[B]`` -> ``K = k``.
    """
    hit = (positions[..., None] == want[:, :, None, :]).any(-1) & valid
    kept = torch.where(due[:, None, None], hit, valid)
    order = torch.where(kept, positions, torch.iinfo(torch.long).max).argsort(dim=-1)[..., :k]
    return KeepSet(index=order, valid=kept.gather(-1, order))


@contextlib.contextmanager
def active_cache(cache: SparseKVCache) -> Iterator[SparseKVCache]:
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def active() -> SparseKVCache:
    """The cache of the enclosing `active_cache` block."""
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError("sparsecorr attention used outside sparsecorr.decoding.generate")
    return cache


def sparsecorr_attention(layer: int, query, key, value, scaling: float) -> torch.Tensor:
    """The attention function: attention over the active cache's kept / selected slots. Traced
    by ``torch.compile`` (the fused step), it is the opaque op ``sparsecorr::attend``
    (`sparsecorr.decoding.fused`), which writes the K/V and attends at run time."""
    if torch.compiler.is_compiling():
        return torch.ops.sparsecorr.attend(query, key, value, layer, scaling)
    return active().attend(layer, query, key, value, scaling)


register_attention(ATTN_NAME, sparsecorr_attention)
