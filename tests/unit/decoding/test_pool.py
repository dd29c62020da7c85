"""The preallocated KV pool: indexed writes (padding to the scratch page), compaction of kept
slots, row selection, out-of-place updates with autograd; capacity. And what the policies keep
beside it (their states): the observation ring, the page sums, the key norms, through the same
writes, compactions and row selections."""

from types import SimpleNamespace

import pytest
import torch

from sparsecorr.decoding import RKV, BlockTopK, Dense, SnapKV, StreamingLLM
from sparsecorr.decoding.engine import pool_capacity
from sparsecorr.decoding.policies import ring_order, ring_slots
from sparsecorr.decoding.policies.snapkv import RingColumns
from sparsecorr.decoding.pool import KVPool

TABLE = torch.full((64,), 8)


def _pool(grad=False, dtype=torch.float32, batch=2, head_dim=3, capacity=10, layers=2):
    return KVPool(layers=layers, batch=batch, kv_heads=2, head_dim=head_dim, capacity=capacity, page_size=4,
                  dtype=dtype, device=torch.device("cpu"), positions=True, grad=grad)


def _ring(window, grad=False):
    pool = _pool(grad=grad)
    return pool, SnapKV(window=window).new_state(pool, q_heads=4, table=TABLE)


def test_layout_and_writes_at_per_row_slots():
    pool = _pool()
    assert pool.capacity == 12 and pool.scratch == 12 and pool.pages_per_row == 4
    summ = BlockTopK(page_size=4).new_state(pool, q_heads=4, table=TABLE).summ
    assert pool.k[0].shape == (2, 2, 16, 3) and summ[0].shape == (2, 2, 4, 3)
    key = torch.arange(2 * 2 * 3 * 3, dtype=torch.float32).reshape(2, 2, 3, 3)
    slots = torch.tensor([[0, 1, 2], [5, 6, 12]])  # row 1: 2 real tokens, padding -> scratch
    pool.write(0, key, -key, slots)
    pool.write_positions(slots, torch.tensor([[0, 1, 2], [7, 8, 9]]))  # every layer's, in one scatter
    assert torch.equal(pool.k[0][0, :, :3], key[0]) and torch.equal(pool.v[0][1, :, 5:7], -key[1, :, :2])
    assert torch.equal(pool.pos[0][1, 0, 5:7], torch.tensor([7, 8])) and torch.equal(pool.pos[1], pool.pos[0])
    assert (pool.k[0][1, :, :5] == 0).all() and (pool.k[1] == 0).all()  # other slots / layers untouched
    assert pool.slot_bytes() == 2 * 2 * 2 * 3 * 4


def test_compact_moves_kept_slots_to_the_front():
    pool = _pool()
    pool.k[0][:, :, :6] = torch.arange(6, dtype=torch.float32)[None, None, :, None]
    pool.pos[0][:, :, :6] = torch.arange(6) + 100
    index = torch.tensor([[[0, 3, 5], [1, 2, 4]], [[2, 3, 4], [0, 1, 5]]])
    pool.compact(0, index)
    assert torch.equal(pool.k[0][..., :3, 0], index.float())
    assert torch.equal(pool.pos[0][..., :3], index + 100)


def _push(ring, q, ctx, real):
    step = SimpleNamespace(part=RingColumns(slots=ring_slots(ctx, real, q.shape[2], ring.window)))
    ring.observe(0, q, step)
    return ctx + real


def _in_order(ring, ctx):
    return ring.windows_in_order(ring_order(ctx, ring.window))[0]


def test_windows_keep_each_rows_last_real_queries():
    _, pool = _ring(3)
    q = torch.arange(4, dtype=torch.float32)[None, None, :, None].expand(2, 4, 4, 3) + 1
    ctx = _push(pool, q, torch.tensor([0, 0]), torch.tensor([4, 2]))  # row 1: 2 real queries then padding
    assert _in_order(pool, ctx)[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0]
    assert _in_order(pool, ctx)[1, 0, :, 0].tolist() == [0.0, 1.0, 2.0]  # 0 = not seen yet
    assert pool.win[0][0, 0, :3, 0].tolist() == [4.0, 2.0, 3.0]  # the ring: position p in column p mod 3
    ctx = _push(pool, q[:, :, :1] + 10, ctx, torch.tensor([1, 1]))  # a decode step
    assert _in_order(pool, ctx)[1, 0, :, 0].tolist() == [1.0, 2.0, 11.0]
    assert _in_order(pool, ctx)[0, 0, :, 0].tolist() == [3.0, 4.0, 11.0]


def _shift_window(win, query, real):
    """The observation window before the ring (oldest first, shifted by cat + gather)."""
    b, hq, w, d = win.shape
    both = torch.cat([win, query], dim=2)
    idx = real[:, None] + torch.arange(w)
    return both.gather(2, idx[:, None, :, None].expand(b, hq, w, d))


@pytest.mark.parametrize("window", [1, 3, 8])
def test_ring_window_equals_the_shift_window(window):
    """Ragged chunks of every length (shorter and longer than the window, padding, rows that
    feed nothing) and single tokens: the ring read in order equals the shifted window."""
    g = torch.Generator().manual_seed(window)
    _, pool = _ring(window)
    b, hq, d = 2, 4, 3
    shift = torch.zeros(b, hq, window, d)
    ctx = torch.zeros(b, dtype=torch.long)
    for q_len in (5, 1, 1, 12, 2, 1, 3, 1):
        q = torch.randn(b, hq, q_len, d, generator=g)
        real = torch.randint(0, q_len + 1, (b,), generator=g)
        shift = _shift_window(shift, q, real)
        ctx = _push(pool, q, ctx, real)
        assert torch.equal(_in_order(pool, ctx), shift)


def test_select_rows_and_out_of_place_updates_with_grad():
    pool, ring = _ring(2, grad=True)
    summ = BlockTopK(page_size=4).new_state(pool, q_heads=4, table=TABLE)
    key = torch.ones(2, 2, 1, 3, requires_grad=True)
    before = pool.k[0]
    pool.write(0, key * 2, key, torch.tensor([[0], [0]]))
    assert pool.k[0] is not before and (before == 0).all()  # earlier readers keep their tensor
    pool.k[0].sum().backward()
    assert torch.equal(key.grad, torch.full_like(key, 2.0))
    pool.write_positions(torch.tensor([[3], [4]]), torch.tensor([[30], [40]]))
    for holder in (pool, ring, summ):
        holder.select_rows(torch.tensor([1]))
    assert all(t.shape[0] == 1 for t in (*pool.k, *pool.v, *pool.pos, *ring.win, *summ.summ))
    assert pool.pos[1][0, :, 4].tolist() == [40, 40] and pool.pos[1].data_ptr() != pool.pos[0].data_ptr()
    pool.write_positions(torch.tensor([[5]]), torch.tensor([[50]]))  # the views follow the selected rows
    assert pool.pos[0][0, :, 5].tolist() == [50, 50] and pool.pos[1][0, :, 5].tolist() == [50, 50]


def test_capacity_is_bounded_by_budget_plus_buffer_plus_chunk():
    table = torch.full((1001,), 64, dtype=torch.long)
    assert pool_capacity(RKV(buffer=32), table, longest=1000, chunk=128) == 64 + 32 + 128
    assert pool_capacity(StreamingLLM(), table, longest=1000, chunk=1) == 65
    assert pool_capacity(RKV(), table, longest=100, chunk=512) == 100  # never above the context
    assert pool_capacity(Dense(), table, longest=1000, chunk=1) == 1000
    assert pool_capacity(BlockTopK(), table, longest=1000, chunk=1) == 1000  # selection keeps all
    table[:300] = -1  # dense below 300 tokens of context
    assert pool_capacity(RKV(), table, longest=1000, chunk=1) == 1000


def test_key_norms_follow_writes_compaction_and_row_selection():
    """R-KV's state: every valid slot's stored norm is the norm of the key it holds, after
    chunked writes (padding to the scratch page), a compaction of every layer and a row selection."""
    g = torch.Generator().manual_seed(0)
    pool = _pool(dtype=torch.bfloat16, batch=3, head_dim=5, capacity=12)
    state = RKV(window=2).new_state(pool, q_heads=4, table=TABLE)
    count = torch.zeros(3, dtype=torch.long)

    def check():
        for b in range(pool.k_all.shape[1]):
            n = int(count[b])
            want = torch.linalg.vector_norm(pool.k_all[:, b, :, :n], dim=-1, dtype=torch.float32)
            assert torch.equal(state.norms_all[:, b, :, :n], want)

    for q_len in (5, 1, 3):
        real = torch.randint(0, q_len + 1, (3,), generator=g) if q_len < 5 else torch.full((3,), 5)
        i = torch.arange(q_len)
        slots = torch.where(i < real[:, None], count[:, None] + i, pool.scratch)
        for layer in range(2):
            key = torch.randn(3, 2, q_len, 5, generator=g).to(torch.bfloat16)
            pool.write(layer, key, key, slots)
        state.all_written(SimpleNamespace(slots=slots))
        count += real
        check()
    k = 3  # of at least 5 slots per row
    index = torch.stack([torch.randperm(5, generator=g)[:k].sort().values for _ in range(12)]).reshape(2, 3, 2, k)
    pool.compact_all(index)
    state.compacted((None, None), index, torch.ones(index.shape, dtype=torch.bool), 0)
    count.fill_(k)
    check()
    for holder in (pool, state):
        holder.select_rows(torch.tensor([2, 0]))
    count = count[:2]
    check()
    assert state.norms_all.shape[1] == 2


def test_select_rows_rewrites_the_stacked_buffers_in_place():
    """Row selection of the stacked buffers keeps every layer's selected rows (in the given
    order), in the buffers' own storage (no second pool), with contiguous [L, n, ...] results."""
    g = torch.Generator().manual_seed(1)
    pool = _pool()
    rkv = RKV(window=2).new_state(pool, q_heads=4, table=TABLE)
    sel = BlockTopK(page_size=4).new_state(pool, q_heads=4, table=TABLE)
    holders = {"k_all": pool, "v_all": pool, "pos_all": pool, "win_all": rkv, "summ_all": sel, "norms_all": rkv,
               "unit_sum_all": rkv}
    for name, holder in holders.items():
        t = getattr(holder, name)
        t.copy_(torch.randint(0, 100, t.shape, generator=g).to(t.dtype))
    before = {name: getattr(holder, name).clone() for name, holder in holders.items()}
    ptr = pool.k_all.data_ptr()
    for holder in (pool, rkv, sel):
        holder.select_rows(torch.tensor([1]))
    for name, old in before.items():
        got = getattr(holders[name], name)
        assert got.is_contiguous() and torch.equal(got, old[:, [1]]), name
    assert pool.k_all.data_ptr() == ptr and torch.equal(pool.k[1], before["k_all"][1, [1]])
    big = _pool(batch=4, capacity=8, layers=3)
    big.k_all.copy_(torch.randn(big.k_all.shape, generator=g))
    old = big.k_all.clone()
    for rows in (torch.tensor([0, 2, 3]), torch.tensor([2, 0])):  # ascending, then reordered
        big.select_rows(rows)
        old = old[:, rows]
        assert torch.equal(big.k_all, old) and torch.equal(big.k[2], old[2])
