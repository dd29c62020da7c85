r"""The preallocated, paged KV pool the engine decodes into: K, V and positions, nothing of a policy.

The pool holds K and V of every layer stacked, ``[L, B, H_kv, C + page, D]`` in the model's dtype
(``k_all``, ``v_all``; ``k[i]``, ``v[i]`` are per-layer views), allocated once per ``generate``
call: ``C`` (a multiple of the page size) is the most slots a row can hold under its policy and
budget (`sparsecorr.decoding.policies.KVPolicy.capacity`), and the extra page is a scratch area
that padding tokens of a ragged chunk are written to. Row ``b``'s valid tokens always occupy
slots ``[0, count_b)``; a decode step writes each row's token at its own ``count_b`` (an indexed
write, no ``torch.cat``; K and V in one op, `sparsecorr.decoding.kernels.kv_write`), and a compression
event gathers the kept slots of every layer to the front at once (`KVPool.compact_all`: one
gather and one copy per stacked buffer). Seen as ``[B · H_kv · (C / page + 1), page, D]`` each
buffer is directly a paged-KV pool for a paged kernel (`sparsecorr.decoding.backends.paged`).

Where the policy evicts, the pool also keeps each slot's true position (``[L, B, H_kv, C + page]``:
after eviction the heads keep different tokens; one tensor, so a step writes every layer's
positions with one scatter, `write_positions`). What a policy keeps beside these (an observation
ring, page sums, key norms) is its own state (`sparsecorr.decoding.policies.state`), which reads
the pool's keys (`KVPool.new_keys`) and follows its row selection (`take_rows`). With autograd on
(``grad=True``) every K/V update is out of place, so earlier attention calls keep the tensors they
read: K and V are then separate per-layer tensors (``k_all``, ``v_all`` None; a compression
stacks the detached keys and compacts layer by layer). Positions are stacked in both modes
(written in place).
"""

from __future__ import annotations

import torch

from .kernels import write_kv

__all__ = ["EMPTY", "KVPool", "WindowRing", "ring_slots", "take_rows"]

#: the position of a ring slot that holds no token (never inside a window)
EMPTY = -(2 ** 62)


class KVPool:
    """Stacked K/V buffers plus positions, with per-layer views (``k[i]`` is ``k_all[i]``;
    likewise ``v``, ``pos``).

    Shapes:
        k_all, v_all: ``[L, B, H_kv, C + page, D]`` (None with grad); k[i], v[i]:
        ``[B, H_kv, C + page, D]``; pos_all ``[L, B, H_kv, C + page]`` long (``positions``).
    """

    def __init__(self, *, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, positions: bool, grad: bool) -> None:
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
        self._views()

    def _views(self) -> None:
        """Per-layer views of the stacked buffers (after allocation or `select_rows`)."""
        if self.k_all is not None:
            self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        self.pos = None if self.pos_all is None else list(self.pos_all.unbind(0))

    def allocated_bytes(self) -> int:
        """Bytes of every buffer the pool holds (K, V, positions)."""
        return sum(t.numel() * t.element_size() for g in (self.k, self.v, self.pos or []) for t in g)

    def slot_bytes(self) -> int:
        """K + V bytes of one slot of one row over all layers and KV heads (0 without layers)."""
        if not self.k:
            return 0
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[3] * k.element_size()

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Write a chunk's K/V at per-row ``slots``.

        Shapes:
            key, value ``[B, H_kv, Q, D]``; slots ``[B, Q]`` (device, long).
        """
        if self.grad:  # out of place: earlier attention calls keep what they read
            b, h, q, d = key.shape
            idx = slots[:, None, :, None].expand(b, h, q, d)
            self.k[layer] = self.k[layer].scatter(2, idx, key)
            self.v[layer] = self.v[layer].scatter(2, idx, value)
        else:  # sparsecorr::write_kv: two scatters, one kernel on CUDA
            write_kv(self.k[layer], self.v[layer], key, value, slots)

    def new_keys(self, slots: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Every layer's keys at ``slots`` (``[B, Q]``), one gather: ``[L, B, H_kv, Q, D]`` and its
        shape (needs the stacked keys, so not with grad)."""
        n, b, h, _, d = self.k_all.shape
        shape = (n, b, h, slots.shape[1], d)
        return self.k_all.gather(3, slots[None, :, None, :, None].expand(shape)), shape

    def write_positions(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Write a chunk's true positions at per-row ``slots`` in every layer at once (one scatter
        per step; every layer writes a step's tokens at the same slots).

        Shapes:
            slots, positions ``[B, Q]`` (device, long).
        """
        n, b, h, _ = self.pos_all.shape
        shape = (n, b, h, slots.shape[1])
        self.pos_all.scatter_(3, slots[None, :, None, :].expand(shape), positions[None, :, None, :].expand(shape))

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
        positions) for all of them; with grad, layer by layer out of place (`compact`).
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
        if self.pos_all is not None:
            self.pos_all[layers, :, :, :kk] = self.pos_all[layers].gather(3, index)

    def keys(self, s: int, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """Layers ``first .. stop - 1``'s first ``s`` key slots, detached: ``[n, B, H_kv, s, D]``
        (a view of the stacked keys; with grad, of one layer's keys, or a stacked copy of several)."""
        stop = len(self.k) if stop is None else stop
        if self.k_all is None:
            if stop - first == 1:
                return self.k[first][None, :, :, :s].detach()
            return torch.stack([k[:, :, :s].detach() for k in self.k[first:stop]])
        return self.k_all[first:stop, :, :, :s].detach()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (device, long) in every buffer. A stacked buffer is
        rewritten in its own storage, one layer at a time (`take_rows`), so the transient extra
        memory is one layer's selected rows, as with per-layer buffers; with grad the per-layer
        K/V are selected one layer at a time."""
        for name in ("k_all", "v_all", "pos_all"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, take_rows(t, rows))
        if self.k_all is None:
            for group in (self.k, self.v):
                for i, t in enumerate(group):
                    group[i] = t.index_select(0, rows)
        self._views()


def take_rows(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of every layer of a contiguous stacked buffer, as a contiguous ``[L, n, ...]``
    view of the front of its own storage: layer ``i``'s selected rows (one ``index_select``, a
    temporary of one layer) are written at ``[i·n, (i+1)·n)`` rows. Shrinking (``n <= B``) goes
    from the first layer up: a layer's new place only overlaps layers already read. Growing
    (``n > B``, repeated rows) stays in place too when the storage has room for ``n`` rows (the
    buffer was shrunk from a larger batch: a scheduler's batch grows back into the pool it
    allocated once) and goes from the last layer down: layer ``i``'s new place starts at row
    ``i·n >= i·B``, past the old places of the layers before it, and ends before the new places of
    the layers after it (written already). Without room, a new tensor.

    Shapes:
        buf ``[L, B, ...]``; rows ``[n]`` (device long) -> ``[L, n, ...]``.
    """
    n_layers, b, n = buf.shape[0], buf.shape[1], rows.shape[0]
    if n_layers == 0:
        return buf.index_select(1, rows)
    per = buf[0].numel() // b if b else 0
    need = n_layers * n * per * buf.element_size()
    in_place = buf.is_contiguous() and b > 0 and (
        n <= b or (buf.storage_offset() == 0 and buf.untyped_storage().nbytes() >= need))
    if not in_place:
        return buf.index_select(1, rows)
    flat = torch.empty(0, dtype=buf.dtype, device=buf.device).set_(
        buf.untyped_storage(), buf.storage_offset(), (max(n, b) * n_layers * per,))
    for i in (range(n_layers) if n <= b else reversed(range(n_layers))):
        kept = buf[i].index_select(0, rows)
        flat[i * n * per:(i + 1) * n * per].view(kept.shape).copy_(kept)
    return flat[:n_layers * n * per].view(n_layers, n, *buf.shape[2:])


def ring_slots(window: int, *, chunk: int, longest: int) -> int:
    """Slots a sliding-window layer's ring needs per row: ``min(window + chunk - 1, longest)``.

    A forward of ``q`` tokens at positions ``p0 .. p0 + q - 1`` writes them all before its first
    query attends, and that query still reads positions down to ``p0 - window + 1``: ``window +
    q - 1`` positions live at once, so a ring of ``window + chunk - 1`` slots (``chunk``: the most
    tokens a forward feeds) never overwrites a position a query of the forward reads. A decode
    step (``q = 1``) reads exactly ``window``. A ring as long as the longest context never wraps.
    """
    return max(1, min(window + max(chunk, 1) - 1, longest))


class WindowRing:
    r"""The K/V of the sliding-window layers: a ring of ``R`` slots per row (`ring_slots`).

    Position \(p\) of row \(b\) lives at slot \(p \bmod R\); the ring keeps each slot's position
    (``pos [B, R + 1]``, one for all its layers and heads: nothing is evicted per head) and a
    scratch slot ``R`` that padding tokens write to (position `EMPTY`). A query at position
    \(q\) attends the slots with \(q - W < p \le q\) (`mask`), exactly HF's sliding-window mask
    (``transformers/masking_utils.py`` ``sliding_window_overlay``: ``kv_idx > q_idx -
    sliding_window`` and causal, the same in 5.9.0 and 5.24.0).

    Shapes:
        k[i], v[i]: ``[B, H_kv, R + 1, D]`` (a `KVPool` of ``R`` slots, pages of one slot);
        pos ``[B, R + 1]`` long.
    """

    def __init__(self, *, layers: int, batch: int, kv_heads: int, head_dim: int, window: int, slots: int,
                 dtype: torch.dtype, device: torch.device, grad: bool) -> None:
        self.window, self.slots = window, slots
        self.kv = KVPool(layers=layers, batch=batch, kv_heads=kv_heads, head_dim=head_dim, capacity=slots,
                         page_size=1, dtype=dtype, device=device, positions=False, grad=grad)
        self.pos = torch.full((batch, slots + 1), EMPTY, dtype=torch.long, device=device)

    @property
    def k(self) -> list[torch.Tensor]:
        return self.kv.k

    @property
    def v(self) -> list[torch.Tensor]:
        return self.kv.v

    def plan(self, ctx: torch.Tensor, real: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write slots and ring positions of a chunk (host): row ``b``'s token ``i < real_b`` at
        position ``ctx_b + i`` goes to slot ``(ctx_b + i) mod R``, padding to the scratch slot
        with position `EMPTY`.

        Shapes:
            ctx, real ``[B]``; offsets ``[Q]`` -> slots, positions ``[B, Q]``.
        """
        is_real = offsets < real[:, None]
        p = ctx[:, None] + offsets
        return torch.where(is_real, p % self.slots, self.slots), torch.where(is_real, p, EMPTY)

    def write_positions(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Record the positions a chunk writes (``[B, Q]`` each), once per forward."""
        self.pos.scatter_(1, slots, positions)

    def mask(self, queries: torch.Tensor) -> torch.Tensor:
        """Which slots each query attends: ``q - W < p <= q`` (a query with no such slot, a
        padding query far past its row's tokens, attends every slot instead, so no softmax row is
        empty; its output is never read).

        Shapes:
            queries ``[B, Q]`` (true positions) -> ``[B, 1, Q, R + 1]`` bool.
        """
        p, q = self.pos[:, None, :], queries[:, :, None]
        inside = (p <= q) & (p > q - self.window)
        return (inside | ~inside.any(-1, keepdim=True))[:, None]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        self.kv.write(layer, key, value, slots)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (device long) of the K/V and the positions."""
        self.kv.select_rows(rows)
        self.pos = self.pos.index_select(0, rows)

    def reset_rows(self, dst: torch.Tensor, source: int) -> None:
        """Rows ``dst`` (device long) become copies of row ``source`` (the pristine row)."""
        for buf in (self.kv.k_all, self.kv.v_all):
            buf[:, dst] = buf[:, source].unsqueeze(1).clone()  # a copy: the source row is in buf
        self.pos[dst] = self.pos[source].clone()  # [R + 1] longs: no overlap with the rows written

    def allocated_bytes(self) -> int:
        return self.kv.allocated_bytes() + self.pos.numel() * self.pos.element_size()

    def slot_bytes(self) -> int:
        """K + V bytes of one slot of one row over the ring's layers and KV heads."""
        return self.kv.slot_bytes()
