"""The invariant ``compress`` relies on (issue 36): in the engine's pool, a row's valid slots hold
strictly increasing positions -- before every compression (new tokens are written after the
kept ones) and after it (compaction keeps the kept slots in position order) -- on every path:
chunked and one-shot prefill, ragged rows, decode, teacher forcing, per-row budgets."""

import pytest
import torch

from sparsecorr.decoding import RKV, SnapKV, StreamingLLM, generate, teacher_forced_logprobs
from sparsecorr.decoding.cache import SparseKVCache
from tests.models import tiny_model


def _check(pool, counts, where):
    for i, pos in enumerate(pool.pos):
        for b, n in enumerate(counts.tolist()):
            p = pos[b, :, :n]
            assert bool((p[:, 1:] > p[:, :-1]).all()), f"{where}: layer {i} row {b} positions {p.tolist()}"


@pytest.fixture
def checked(monkeypatch):
    events = []
    original = SparseKVCache.compress

    def compress(self, budgets, counts, query_valid, **kw):
        _check(self.pool, counts, "before compression")
        kept = original(self, budgets, counts, query_valid, **kw)
        _check(self.pool, torch.minimum(counts, budgets), "after compression")
        events.append(int(counts.max()))
        return kept

    monkeypatch.setattr(SparseKVCache, "compress", compress)
    return events


class Steps:  # per-row budgets that change with the context
    def budget_at(self, c):
        return None if c < 10 else 5 if c < 20 else 8


@pytest.mark.parametrize("policy", [StreamingLLM(sink=2, buffer=2), SnapKV(window=3, buffer=3, sink=1),
                                    RKV(window=3, buffer=2)], ids=lambda p: p.name)
@pytest.mark.parametrize("budget", [6, Steps()], ids=["int", "schedule"])
def test_slot_order_is_position_order_on_every_path(checked, policy, budget):
    model = tiny_model("qwen3", num_layers=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (3, 14), generator=g)
    am = torch.ones_like(ids)
    am[0, :5] = 0  # left padding
    am[2, 11:] = 0  # right padding
    for chunk in (None, 4):
        out = generate(model, ids, am, policy=policy, budget=budget, max_new_tokens=20, temperature=1.0,
                       generator=torch.Generator().manual_seed(1), prefill_chunk=chunk, logprobs_topk=0)
        teacher_forced_logprobs(model, ids, out.tokens, policy=policy, budget=budget, attention_mask=am,
                                response_mask=out.mask, prefill_chunk=chunk, chunk_size=7, logprobs_topk=0)
    assert len(checked) >= 8  # compressions did happen, on every path


def test_the_check_catches_a_pool_out_of_position_order(checked):
    """The check above fails when a compaction does not keep position order."""
    from sparsecorr.decoding.pool import KVPool

    pool = KVPool(layers=1, batch=1, kv_heads=1, head_dim=2, capacity=8, page_size=4,
                  dtype=torch.float32, device=torch.device("cpu"), positions=True,
                  grad=False)
    pool.pos[0][0, 0, :4] = torch.tensor([0, 1, 2, 3])
    pool.compact(0, torch.tensor([[[3, 0, 1]]]))  # a kept set not sorted by slot
    with pytest.raises(AssertionError, match="positions"):
        _check(pool, torch.tensor([3]), "after compression")
