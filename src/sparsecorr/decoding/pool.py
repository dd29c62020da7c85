r"""The preallocated, paged KV pool the engine decodes into.

The pool holds K and V of every layer stacked, ``[L, B, H_kv, C + page, D]`` in the model's dtype
(``k_all``, ``v_all``; ``k[i]``, ``v[i]`` are per-layer views), allocated once per ``generate``
call: ``C`` (a multiple of the page size) is the most slots a row can hold under its policy and
budget (the engine works it out), and the extra page is a scratch area
that padding tokens of a ragged chunk are written to. Row ``b``'s valid tokens always occupy
slots ``[0, count_b)``; a decode step writes each row's token at its own ``count_b`` (an indexed
write, no ``torch.cat``; K and V in one op, `sparsecorr.decoding.kernels.kv_write`), and a compression
event gathers the kept slots of every layer to the front at once (`KVPool.compact_all`: one
gather and one copy per stacked buffer). Seen as ``[B · H_kv · (C / page + 1), page, D]`` each
buffer is directly a paged-KV pool for a paged kernel (`sparsecorr.decoding.backends.paged`).

Eviction policies also keep each slot's true position (``[B, H_kv, C + page]``: after eviction
the heads keep different tokens; one ``[L, B, H_kv, C + page]`` tensor, so a step writes every
layer's positions with one scatter, `write_positions`) and the last ``window`` queries of every layer (a copy, so no
layer's prefill query tensor stays alive) in a **ring**: the query at position \(p\) lives in
column \(p \bmod W\), so a step writes each layer's queries with one scatter at indices built
once per step (`ring_slots`; a dump column ``W`` takes padding and queries older than the
window), and the window is put in order (oldest first, `ring_order`) only when a compression
reads it. Selection policies keep the running float32 **sum** of the keys of every page (the
page summaries): every layer's new keys are added to their pages once per step, after the last
layer's write (`KVPool.add_page_sums`: one gather, one cast, one ``scatter_add_`` at page indices
built once per step; per layer in `KVPool.write` where the cache asks for it), so no summary is
ever recomputed from the cache. R-KV's compressions read every key's norm, which the pool keeps
the same way (`KVPool.track_norms`, `KVPool.add_key_norms`), and their sum of unit keys, brought
up to date at each compression over the slots written since the last one and the evicted ones
only (`KVPool.sync_unit_sums`, `KVPool.drop_unit_sums`). With autograd on (``grad=True``) every K/V update
is out of place, so earlier attention calls keep the tensors they read: K and V are then separate
per-layer tensors (``k_all``, ``v_all`` None; a compression stacks the detached keys and compacts
layer by layer). Windows, positions and page sums are stacked in both modes (written in place,
detached).
"""

from __future__ import annotations

import torch

from .kernels import write_kv
from .policies.rkv import unit_weights, weighted_key_sum

__all__ = ["KVPool", "ring_order", "ring_slots"]


class KVPool:
    """Stacked K/V buffers plus positions, observation windows and page summaries, with
    per-layer views (``k[i]`` is ``k_all[i]``; likewise ``v``, ``pos``, ``win``, ``summ``).

    Shapes:
        k_all, v_all: ``[L, B, H_kv, C + page, D]`` (None with grad); k[i], v[i]:
        ``[B, H_kv, C + page, D]``; pos_all ``[L, B, H_kv, C + page]`` long;
        win_all: ``[L, B, H_q, W + 1, D]`` (a ring: position p in column p mod W, column W a dump);
        summ_all: ``[L, B, H_kv, C / page + 1, D]`` float32 (the sum of each page's keys; the
        scratch page's entry collects padding and is never read).
    """

    def __init__(self, *, layers: int, batch: int, kv_heads: int, q_heads: int, head_dim: int,
                 capacity: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 positions: bool, window: int, summaries: bool, grad: bool) -> None:
        self.page_size = page_size
        self.capacity = -(-max(capacity, 1) // page_size) * page_size
        self.scratch = self.capacity  # first slot of the scratch page
        self.pages_per_row = self.capacity // page_size + 1
        self.grad = grad
        total = self.capacity + page_size
        shape = (layers, batch, kv_heads, total, head_dim)
        # stacked [L, ...] buffers, per-layer views; with grad the K/V writes are out of place, so
        # each layer's K and V are separate tensors (k_all / v_all None) and a compression stacks them
        self.k_all = None if grad else torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = None if grad else torch.zeros(shape, dtype=dtype, device=device)
        self.k = [torch.zeros(shape[1:], dtype=dtype, device=device) for _ in range(layers)] if grad \
            else list(self.k_all.unbind(0))
        self.v = [torch.zeros(shape[1:], dtype=dtype, device=device) for _ in range(layers)] if grad \
            else list(self.v_all.unbind(0))
        self.pos_all = torch.zeros(shape[:4], dtype=torch.long, device=device) if positions else None
        self.window = window
        self.win_all = torch.zeros(layers, batch, q_heads, window + 1, head_dim, dtype=dtype, device=device) \
            if window > 0 else None
        self.summ_all = torch.zeros(layers, batch, kv_heads, self.pages_per_row, head_dim, dtype=torch.float32,
                                    device=device) if summaries else None
        self.norms_all = None  # [L, B, H_kv, C + page] float32 key norms, once `track_norms` is called
        self.unit_sum_all = None  # [L, B, H_kv, D] float32 sum of the unit keys of slots [0, unit_upto_b)
        self.unit_upto = None  # [B] device long: the slots the unit sums cover
        self.unit_lo = 0  # host: a lower bound of unit_upto (the first slot a catch-up reads)
        self._views()

    def track_norms(self) -> None:
        r"""Keep every written key's norm (float32 accumulation) in ``norms_all``, updated once
        per step for every layer (`add_key_norms`) and compacted with the keys, so a compression
        that needs them (R-KV's redundancy) does not re-read the keys for them; and R-KV's sum of
        unit keys \(s = \sum_j k_j / \max(\lVert k_j\rVert, 10^{-12})\) over each row's valid slots
        (``unit_sum_all``, `sync_unit_sums`, `keep_unit_sums`). Not with grad."""
        if self.k_all is not None and self.norms_all is None:
            dev = self.k_all.device
            n, b, h, _, d = self.k_all.shape
            self.norms_all = torch.zeros(self.k_all.shape[:4], dtype=torch.float32, device=dev)
            self.unit_sum_all = torch.zeros(n, b, h, d, dtype=torch.float32, device=dev)
            self.unit_upto = torch.zeros(b, dtype=torch.long, device=dev)
            self.unit_lo = 0

    def _views(self) -> None:
        """Per-layer views of the stacked buffers (after allocation or `select_rows`)."""
        if self.k_all is not None:
            self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        self.pos = None if self.pos_all is None else list(self.pos_all.unbind(0))
        self.win = None if self.win_all is None else list(self.win_all.unbind(0))
        self.summ = None if self.summ_all is None else list(self.summ_all.unbind(0))

    def allocated_bytes(self) -> int:
        """Bytes of every buffer the pool holds (K, V, positions, windows, summaries)."""
        groups = [self.k, self.v, self.pos or [], self.win or [], self.summ or [],
                  [] if self.norms_all is None else [self.norms_all, self.unit_sum_all]]
        return sum(t.numel() * t.element_size() for g in groups for t in g)

    def slot_bytes(self) -> int:
        """K + V bytes of one slot of one row over all layers and KV heads."""
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[3] * k.element_size()

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
              pages: torch.Tensor | None = None) -> None:
        """Write a chunk's K/V at per-row ``slots``; with page summaries, add the
        keys to the running sums of their ``pages`` (``slots // page``, built once per step).
        A slot must be written once (the sums are not recomputed; graph warm-ups restore them).

        Shapes:
            key, value ``[B, H_kv, Q, D]``; slots, pages ``[B, Q]`` (device, long).
        """
        b, h, q, d = key.shape
        if self.grad:  # out of place: earlier attention calls keep what they read
            idx = slots[:, None, :, None].expand(b, h, q, d)
            self.k[layer] = self.k[layer].scatter(2, idx, key)
            self.v[layer] = self.v[layer].scatter(2, idx, value)
        else:  # sparsecorr::write_kv: two scatters, one kernel on CUDA
            write_kv(self.k[layer], self.v[layer], key, value, slots)
        if self.summ is not None and pages is not None:
            self.summ[layer].scatter_add_(2, pages[:, None, :, None].expand(b, h, q, d), key.detach().float())

    def _new_keys(self, slots: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Every layer's keys at ``slots`` (``[B, Q]``), one gather: ``[L, B, H_kv, Q, D]``."""
        n, b, h, _, d = self.k_all.shape
        shape = (n, b, h, slots.shape[1], d)
        return self.k_all.gather(3, slots[None, :, None, :, None].expand(shape)), shape

    def add_page_sums(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Add a forward's keys of every layer (already written at ``slots``) to the running
        float32 sums of their ``pages``: a gather, a cast and one ``scatter_add_`` for all layers,
        once per step (instead of a cast and a scatter per layer in `write`; needs the stacked
        keys, so not with grad).

        Shapes:
            slots, pages ``[B, Q]`` (device, long).
        """
        new, shape = self._new_keys(slots)
        self.summ_all.scatter_add_(3, pages[None, :, None, :, None].expand(shape), new.float())

    def add_key_norms(self, slots: torch.Tensor) -> None:
        """Store the norms of a forward's keys of every layer (already written at ``slots``):
        a gather, one ``vector_norm`` (float32 accumulation) and one scatter for all layers,
        once per step (`track_norms`).

        Shapes:
            slots ``[B, Q]`` (device, long).
        """
        new, shape = self._new_keys(slots)
        norms = torch.linalg.vector_norm(new, dim=-1, dtype=torch.float32)
        self.norms_all.scatter_(3, slots[None, :, None, :].expand(shape[:4]), norms)

    def _unit_weighted_sum(self, w: torch.Tensor, lo: int) -> torch.Tensor:
        r"""\(\sum_j w_j k_j\) over slots ``lo .. lo + m - 1`` of every layer (`weighted_key_sum`).

        Shapes:
            w ``[L, B, H_kv, m]`` float32 -> ``[L, B, H_kv, D]`` float32.
        """
        return weighted_key_sum(w, self.k_all[:, :, :, lo:lo + w.shape[-1]])[..., 0, :]

    def sync_unit_sums(self, counts: torch.Tensor, *, low: int, high: int) -> None:
        r"""Add the unit keys of the slots written since the sums were last brought up to date,
        \(s \mathrel{+}= \sum_{\mathrm{upto}_b \le j < \mathrm{count}_b} k_j / \max(n_j, 10^{-12})\)
        with the stored norms \(n_j\), for every layer: one GEMV over slots
        ``[unit_lo, high)`` only (in steady state the ``buffer`` tokens decoded since the last
        compression), at the compression that reads them, not in the decode step (so a CUDA
        graph's warm-up step adds nothing twice, and padding, written past ``count_b`` to the
        scratch page, is never summed). ``low`` / ``high``: host min / max of ``counts``.

        Shapes:
            counts ``[B]`` (device long, valid slots per row).
        """
        lo = self.unit_lo
        if high > lo:
            j = torch.arange(lo, high, device=counts.device)
            new = (j >= self.unit_upto[:, None]) & (j < counts[:, None])  # [B, m]
            w = unit_weights(new[None, :, None, :], self.norms_all[:, :, :, lo:high])
            self.unit_sum_all += self._unit_weighted_sum(w, lo)
        self.unit_upto, self.unit_lo = counts, low

    def drop_unit_sums(self, valid: torch.Tensor, index: torch.Tensor, kept: torch.Tensor, *, evicted: int,
                       counts: torch.Tensor, low: int) -> None:
        r"""Before a compaction (`compact_all`), take the evicted keys out of the unit sums:
        \(s \mathrel{-}= \sum_{j\ \mathrm{valid},\ j \notin \mathrm{kept}} k_j / \max(n_j, 10^{-12})\),
        gathering only the (at most ``evicted`` per row and head) evicted keys: a decode's
        compression evicts about ``buffer`` keys of ``budget + buffer``, so this touches a few
        percent of the keys (the engine takes `keep_unit_sums` instead where the kept set is
        the smaller). The sums then drift from a recomputation by float rounding only.

        Shapes:
            valid ``[L, B, H_kv, S]`` (valid before); index, kept ``[L, B, H_kv, K]`` (the kept
            set: slots and valid entries); counts ``[B]`` (device long, valid slots per row after
            the compaction); ``low``: their host minimum.
        """
        s = valid.shape[-1]  # the kept slots marked True (dropped entries into a dump column s)
        in_kept = torch.zeros(*valid.shape[:-1], s + 1, dtype=torch.bool, device=valid.device)
        in_kept.scatter_(-1, torch.where(kept, index, s), True)
        gone = valid & ~in_kept[..., :s]  # evicted: valid and not kept
        ev = gone.to(torch.uint8).topk(evicted, dim=-1).indices  # [L, B, H, E]: the evicted slots first
        w = unit_weights(gone.gather(-1, ev), self.norms_all[..., :s].gather(-1, ev))
        keys = self.k_all.gather(3, ev[..., None].expand(*ev.shape, self.k_all.shape[-1]))
        self.unit_sum_all -= weighted_key_sum(w, keys)[..., 0, :]
        self.unit_upto, self.unit_lo = counts, low

    def keep_unit_sums(self, valid: torch.Tensor, counts: torch.Tensor, *, low: int) -> None:
        r"""After a compaction (`compact_all`), the unit sums of the kept keys:
        \(s = \sum_{j < K} \mathrm{valid}_j\, k_j / \max(n_j, 10^{-12})\) over the compacted front
        (one GEMV over the ``K`` kept slots, not the evicted ones nor the rest of the pool).

        Shapes:
            valid ``[L, B, H_kv, K]`` (the kept set's valid entries); counts ``[B]`` (device long,
            valid slots per row after the compaction); ``low``: their host minimum.
        """
        w = unit_weights(valid, self.norms_all[:, :, :, :valid.shape[-1]])
        self.unit_sum_all.copy_(self._unit_weighted_sum(w, 0))
        self.unit_upto, self.unit_lo = counts, low

    def write_positions(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Write a chunk's true positions at per-row ``slots`` in every layer at once (one scatter
        per step; every layer writes a step's tokens at the same slots).

        Shapes:
            slots, positions ``[B, Q]`` (device, long).
        """
        n, b, h, _ = self.pos_all.shape
        shape = (n, b, h, slots.shape[1])
        self.pos_all.scatter_(3, slots[None, :, None, :].expand(shape), positions[None, :, None, :].expand(shape))

    def push_queries(self, layer: int, query: torch.Tensor, slots: torch.Tensor) -> None:
        """Write a chunk's queries into the observation ring at ``slots`` (from `ring_slots`,
        built once per step): one scatter per layer, nothing shifted.

        Shapes:
            query ``[B, H_q, Q, D]``; slots ``[B, Q]`` (device long, in ``[0, W]``).
        """
        win = self.win[layer]
        b, hq, _, d = win.shape
        idx = slots[:, None, :, None].expand(b, hq, slots.shape[1], d)
        win.scatter_(2, idx, query.detach().to(win.dtype))

    def compact(self, layer: int, index: torch.Tensor) -> None:
        """Move the kept slots ``index`` (``[B, H_kv, K]``, sorted by position) of one layer to the front."""
        kk = index.shape[-1]
        idx4 = index[..., None].expand(-1, -1, -1, self.k[layer].shape[-1])
        for buf in (self.k, self.v):
            kept = buf[layer].gather(2, idx4)
            if self.grad:
                buf[layer] = torch.cat([kept, buf[layer][:, :, kk:]], dim=2)
            else:
                buf[layer][:, :, :kk] = kept
        if self.pos is not None:
            self.pos[layer][:, :, :kk] = self.pos[layer].gather(2, index)

    def compact_all(self, index: torch.Tensor, first: int = 0) -> None:
        """Move the kept slots ``index`` (``[n, B, H_kv, K]``, sorted by position) of layers
        ``first .. first + n - 1`` to the front: one gather and one copy per stacked buffer (K, V,
        positions, key norms) for all of them; with grad, layer by layer out of place (`compact`).
        """
        n = index.shape[0]
        if self.k_all is None:
            for i in range(n):
                self.compact(first + i, index[i])
            return
        kk, layers = index.shape[-1], slice(first, first + n)
        idx5 = index[..., None].expand(*index.shape, self.k_all.shape[-1])
        for buf in (self.k_all[layers], self.v_all[layers]):
            buf[:, :, :, :kk] = buf.gather(3, idx5)
        for buf in (self.pos_all, self.norms_all):
            if buf is not None:
                buf[layers, :, :, :kk] = buf[layers].gather(3, index)

    def keys(self, s: int, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """Layers ``first .. stop - 1``'s first ``s`` key slots, detached: ``[n, B, H_kv, s, D]``
        (a view of the stacked keys; with grad, of one layer's keys, or a stacked copy of several)."""
        stop = len(self.k) if stop is None else stop
        if self.k_all is None:
            if stop - first == 1:
                return self.k[first][None, :, :, :s].detach()
            return torch.stack([k[:, :, :s].detach() for k in self.k[first:stop]])
        return self.k_all[first:stop, :, :, :s].detach()

    def windows_in_order(self, order: torch.Tensor, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """Layers ``first .. stop - 1``'s observation windows, oldest query first (one gather).

        Shapes:
            order ``[B, W]`` (device long) -> ``[n, B, H_q, W, D]``.
        """
        win = self.win_all[first:stop]
        n, b, hq, _, d = win.shape
        return win.gather(3, order[None, :, None, :, None].expand(n, b, hq, order.shape[1], d))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (device, long) in every buffer. A stacked buffer is
        rewritten in its own storage, one layer at a time (`_take_rows`), so the transient extra
        memory is one layer's selected rows, as with per-layer buffers; with grad the per-layer
        K/V are selected one layer at a time."""
        for name in ("k_all", "v_all", "pos_all", "win_all", "summ_all", "norms_all", "unit_sum_all"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, _take_rows(t, rows))
        if self.k_all is None:
            for group in (self.k, self.v):
                for i, t in enumerate(group):
                    group[i] = t.index_select(0, rows)
        if self.unit_upto is not None:  # unit_lo stays a lower bound
            self.unit_upto = self.unit_upto.index_select(0, rows)
        self._views()


def _take_rows(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of every layer of a contiguous stacked buffer, as a contiguous ``[L, n, ...]``
    view of the front of its own storage: layer ``i``'s selected rows (one ``index_select``, a
    temporary of one layer) are written at ``[i·n, (i+1)·n)`` rows, which only overlaps layers
    already read (``n <= B``). With more rows than the buffer has (repeated rows), a new tensor.

    Shapes:
        buf ``[L, B, ...]``; rows ``[n]`` (device long) -> ``[L, n, ...]``.
    """
    n_layers, b, n = buf.shape[0], buf.shape[1], rows.shape[0]
    if n > b or not buf.is_contiguous():
        return buf.index_select(1, rows)
    per = buf[0].numel() // b if b else 0
    flat = buf.view(-1)
    for i in range(n_layers):
        kept = buf[i].index_select(0, rows)
        flat[i * n * per:(i + 1) * n * per].view(kept.shape).copy_(kept)
    return flat[:n_layers * n * per].view(n_layers, n, *buf.shape[2:])


def ring_slots(ctx: torch.Tensor, real: torch.Tensor, q_len: int, window: int) -> torch.Tensor:
    """Ring columns of a chunk's queries (host, once per step): token ``i`` of row ``b`` (position
    ``ctx_b + i``) goes to ``(ctx_b + i) mod W`` if it is one of the row's last ``W`` real tokens
    of the chunk, else to the dump column ``W`` (padding, or overwritten within the chunk).

    Shapes:
        ctx, real ``[B]`` (CPU long: tokens fed before the chunk, real tokens in it) -> ``[B, Q]``.
    """
    i = torch.arange(q_len)
    keep = (i < real[:, None]) & (i >= real[:, None] - window)
    return torch.where(keep, (ctx[:, None] + i) % window, window)


def ring_order(ctx: torch.Tensor, window: int) -> torch.Tensor:
    """Ring columns in time order (oldest first) after ``ctx_b`` tokens: column
    ``(ctx_b + t) mod W`` holds the ``t``-th oldest of the last ``W`` positions
    (``ctx_b - W + t``; an unseen one while ``ctx_b < W``).

    Shapes:
        ctx ``[B]`` (CPU long) -> ``[B, W]``.
    """
    return (ctx[:, None] + torch.arange(window)) % window
