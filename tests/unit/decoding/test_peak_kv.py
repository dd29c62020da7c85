"""Issue 52: the peak KV of a hybrid model with R-KV at a budget below the full layers' context.

A forward reads, per row, the full layers' slots before it plus its own tokens, and on every
sliding layer the union of its queries' windows: ``min(ctx + q, window + q - 1)`` positions (a
chunk's first query reads ``window - 1`` positions before the chunk). With R-KV at budget ``b``,
buffer ``u``, prefill chunks of ``C`` tokens and a prompt long enough that a row reaches ``b + u``
slots right before a chunk, the largest forward is that chunk::

    peak slots per row = L_sliding · (W + C - 1) + L_full · (b + u + C)

(the issue's ``L_sliding · W`` holds for a decode step, ``C = 1``). ``peak_kv_bytes`` is that
times the rows and one slot's K + V bytes per layer; ``meta["peak_kv"]`` splits it by group;
the pool holds the full layers at R-KV's capacity and a ring of ``W + C - 1`` slots per sliding
layer.
"""

from __future__ import annotations

import pytest
import torch

from sparsecorr.decoding import RKV, generate
from sparsecorr.decoding.hf import model_spec
from sparsecorr.decoding.memory import row_bytes
from sparsecorr.decoding.validate import budget_table
from tests.unit.decoding.test_sliding import hybrid

W, B_KV, BUF, C, P, T = 6, 8, 4, 4, 24, 8


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_peak_kv_is_both_groups_at_the_largest_forward(name):
    model = hybrid(name, window=W)
    spec = model_spec(model)
    ids = torch.randint(3, 96, (2, P), generator=torch.Generator().manual_seed(0))
    policy = RKV(window=3, buffer=BUF)
    out = generate(model, ids, policy=policy, budget=B_KV, max_new_tokens=T, temperature=0.0, backend="torch",
                   prefill_chunk=C)
    assert B_KV < P + T  # the budget is below the full layers' context
    slot = 2 * spec.heads_kv * spec.head_dim * torch.finfo(torch.float32).bits // 8  # K + V of one layer
    n_full, n_sliding = len(spec.full), len(spec.sliding)
    assert n_full and n_sliding
    full = 2 * n_full * (B_KV + BUF + C) * slot
    sliding = 2 * n_sliding * (W + C - 1) * slot
    assert out.meta["peak_kv"] == {"full_bytes": full, "sliding_bytes": sliding}
    assert out.peak_kv_bytes == full + sliding
    # the decode steps read less: W per sliding layer, at most b + u + 1 per full layer
    assert 2 * (n_sliding * W + n_full * (B_KV + BUF + 1)) * slot < out.peak_kv_bytes
    assert out.meta["kv_layers"]["ring_slots"] == W + C - 1
    # the memory plan's row bytes are the engine's allocation per row (pool + ring + R-KV's state)
    table = budget_table(B_KV, dense=False, longest=P + T)
    per, _ = row_bytes(model, policy, table, policy.capacity(table, longest=P + T, chunk=C), chunk=C)
    one = generate(model, ids[:1], policy=policy, budget=B_KV, max_new_tokens=T, temperature=0.0, backend="torch",
                   prefill_chunk=C)
    assert out.meta["kv_pool_bytes"] - one.meta["kv_pool_bytes"] == per
