"""One compression event compresses every layer in one batched call (the pool's stacked
``[L, B, ...]`` buffers seen as ``[L·B, ...]``): each layer's kept set, recorded positions and
compacted K/V/positions equal those of the per-layer call (`policies.compress` on that layer's
slice, then `KVPool.compact`) on the same inputs: ragged counts, per-row budgets, windows not
yet full, forced (replayed) kept sets, with and without autograd; R-KV reads the key norms its
state keeps (`RKVState.add_key_norms`) where the per-layer call computes them from the keys."""

import pytest
import torch

from sparsecorr.decoding import RKV, SnapKV, StreamingLLM
from sparsecorr.decoding.backends import TorchBackend
from sparsecorr.decoding.cache import SparseKVCache, forced_keep
from sparsecorr.decoding.policies import compress, ring_order
from sparsecorr.decoding.pool import KVPool

L, B, H, G, D, W = 3, 3, 2, 2, 8, 4


class _Filled(KVPool):
    """The pool with its policy's state (``state``)."""


def _filled(policy, *, grad: bool, seed: int = 0) -> tuple[KVPool, torch.Tensor]:
    """A pool whose layers, rows and heads all hold different keys, windows and positions (the
    windows: the policy's observation ring where it keeps one, random queries otherwise)."""
    g = torch.Generator().manual_seed(seed)
    pool = _Filled(layers=L, batch=B, kv_heads=H, head_dim=D, capacity=40, page_size=4,
                   dtype=torch.bfloat16, device=torch.device("cpu"), positions=True, grad=grad)
    pool.state = policy.new_state(pool, q_heads=H * G, table=torch.full((64,), 20))
    win = getattr(pool.state, "win", None) or [torch.zeros(B, H * G, W + 1, D, dtype=torch.bfloat16)
                                              for _ in range(L)]
    pool.win = win
    counts = torch.tensor([37, 29, 40])
    for i in range(L):
        with torch.no_grad():
            pool.k[i].copy_(torch.randn(pool.k[i].shape, generator=g))
            pool.v[i].copy_(torch.randn(pool.v[i].shape, generator=g))
        win[i].copy_(torch.randn(win[i].shape, generator=g))
        # increasing positions with gaps that differ per layer, row and head (earlier evictions)
        steps = torch.randint(1, 4, pool.pos[i].shape, generator=g)
        pool.pos[i].copy_(steps.cumsum(-1))
    if policy.key_norms and not grad:  # R-KV reads the norms its state keeps as keys are written
        pool.state.add_key_norms(torch.arange(pool.k[0].shape[2]).expand(B, -1))
    return pool, counts


def _per_layer(policy, pool, counts, budgets, qv, order):
    """Today's event: one `compress` per layer on that layer's slice, then its compaction."""
    s = int(counts.max())
    valid = (torch.arange(s) < counts[:, None])[:, None, :].expand(B, H, s)
    kept = []
    for i in range(L):
        keys, pos = pool.k[i][:, :, :s].detach(), pool.pos[i][:, :, :s]
        q = torch.stack(pool.win)[:, :, :, :W].gather(
            3, order[None, :, None, :, None].expand(L, B, H * G, W, D))[i]  # the window, oldest first
        keep = compress(policy, keys=keys, queries=q, valid=valid, positions=pos, budget=budgets,
                        query_valid=qv, max_budget=int(budgets.max()))
        kept.append(torch.where(keep.valid, pos.gather(-1, keep.index), -1))
        pool.compact(i, keep.index)
    return torch.stack(kept, 1)


def _cache(pool, policy):
    return SparseKVCache(pool, policy=policy, state=pool.state, backend=TorchBackend())


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("policy", [RKV(window=W, buffer=2), SnapKV(window=W, buffer=2, sink=1),
                                    StreamingLLM(sink=2, buffer=2)], ids=lambda p: p.name)
def test_batched_event_equals_the_per_layer_calls(policy, grad):
    budgets = torch.tensor([20, 29, 11])  # row 1 keeps all of its 29 (not due)
    ctx = torch.tensor([50, 2, 41])  # row 1 has seen 2 < W tokens: half its window votes
    qv = torch.arange(W) >= W - ctx.clamp(max=W)[:, None]
    order = ring_order(ctx, W)
    ref_pool, counts = _filled(policy, grad=grad)
    want = _per_layer(policy, ref_pool, counts, budgets, qv, order)
    pool, _ = _filled(policy, grad=grad)
    got = _cache(pool, policy).compress(budgets, counts, ctx, record=True)
    assert torch.equal(got, want)
    # the layers keep different sets (so a batching that mixed layers could not pass)
    assert not torch.equal(want[:, 0], want[:, 1]) or policy.name == "streaming_llm"
    for i in range(L):
        assert torch.equal(pool.k[i], ref_pool.k[i]) and torch.equal(pool.v[i], ref_pool.v[i])
        assert torch.equal(pool.pos[i], ref_pool.pos[i])
    # the scored keys are views of the pool: of the stacked keys, or with grad of one layer's keys
    # (the event then runs layer by layer, so no stacked copy of every layer's keys is made)
    assert pool.keys(5, 1, 2).data_ptr() == pool.k[1].data_ptr()
    assert (pool.k_all is None) == grad


def test_batched_replay_equals_the_per_layer_replay():
    policy = RKV(window=W, buffer=2)
    budgets, ctx = torch.tensor([20, 29, 11]), torch.tensor([50, 60, 41])
    pool, counts = _filled(policy, grad=False, seed=1)
    recorded = _cache(pool, policy).compress(budgets, counts, ctx, record=True)
    due = torch.tensor([True, False, True])
    # replay the recorded sets on a fresh copy, batched and per layer
    a, _ = _filled(policy, grad=False, seed=1)
    got = _cache(a, policy).compress(budgets, counts, ctx, forced=recorded, due=due, record=True)
    b, _ = _filled(policy, grad=False, seed=1)
    s = int(counts.max())
    valid = (torch.arange(s) < counts[:, None])[:, None, :].expand(B, H, s)
    want = []
    for i in range(L):
        pos = b.pos[i][:, :, :s]
        keep = forced_keep(pos, valid, recorded[:, i], due, k=min(int(budgets.max()), s))
        want.append(torch.where(keep.valid, pos.gather(-1, keep.index), -1))
        b.compact(i, keep.index)
    assert torch.equal(got, torch.stack(want, 1))
    assert torch.equal(got[0], recorded[0]) and torch.equal(got[2], recorded[2])  # the due rows replay
    for i in range(L):
        assert torch.equal(a.k[i], b.k[i]) and torch.equal(a.pos[i], b.pos[i])
