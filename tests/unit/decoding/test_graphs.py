"""The CUDA-graph decode step's static-buffer logic, run eagerly on CPU: reading the whole pool
with a mask built from device counts, a fixed page count for selection, buffers refreshed
before every replay, a new capture when the batch shrinks. (Capture itself: tests/gpu.)"""

import pytest
import torch

from sparsecorr.decoding import RKV, BlockTopK, Dense, StreamingLLM
from sparsecorr.decoding.backends import TorchBackend
from sparsecorr.decoding.cache import ATTN_NAME, active_cache
from sparsecorr.decoding.engine import Engine
from sparsecorr.decoding.hf import sparse_attention
from sparsecorr.decoding.loops import Sampling, decode_loop, prefill
from sparsecorr.decoding.runner import ModelRunner
from sparsecorr.decoding.validate import budget_table
from tests.models import tiny_model
from tests.unit.decoding.drive import decode_steps


def _decode(model, ids, policy, budget, *, graphs: bool, steps=20, eos=None):
    return decode_steps(model, ids, policy, budget, graphs=graphs, steps=steps, eos=eos)


@pytest.mark.parametrize("policy", [Dense(), StreamingLLM(sink=1, buffer=2), RKV(window=3, buffer=3),
                                    BlockTopK(page_size=4, dense_layers=1)], ids=lambda p: p.name)
def test_static_step_equals_the_eager_step(policy):
    model = tiny_model("qwen3", num_layers=3)
    ids = torch.randint(3, 128, (5, 9), generator=torch.Generator().manual_seed(0))
    for eos in (None, [11, 63]):  # with EOS, rows leave the batch: dummies, then a smaller bucket
        ref, _ = _decode(model, ids, policy, 8, graphs=False, eos=eos)
        got, engine = _decode(model, ids, policy, 8, graphs=True, eos=eos)
        assert engine.graphs.status == "on" and engine.graphs.captured
        assert torch.equal(got["tokens"], ref["tokens"]) and torch.equal(got["lengths"], ref["lengths"])
        torch.testing.assert_close(got["rollout_logp"], ref["rollout_logp"], atol=2e-5, rtol=0)
        torch.testing.assert_close(got["kv_kept"], ref["kv_kept"])


def test_capture_failure_falls_back_to_eager(monkeypatch):
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))

    class Broken:
        def __init__(self, fn, **_):
            raise RuntimeError("operation not permitted when stream is capturing")

    ref, _ = _decode(model, ids, Dense(), None, graphs=False, steps=6)
    lens = torch.full((2,), 5)
    table = budget_table(None, dense=True, longest=11)
    engine = Engine(model, policy=Dense(), backend=TorchBackend(), table=table, batch=2, capacity=11, grad=False)
    samp = Sampling(temperature=0.0, top_k=None, top_p=None, k=3, generator=None)
    with sparse_attention(model, ATTN_NAME), active_cache(engine.cache), torch.no_grad(), \
            pytest.warns(RuntimeWarning, match="capture failed"):
        logits = prefill(engine, ids, lens, 5)
        runner = ModelRunner(engine, graph_runner=Broken)
        got = decode_loop(runner, logits, prompt_len=lens, steps=6, samp=samp, eos=None, pruner=None,
                          group_size=None, bar=type("B", (), {"update": lambda self, n: None})())
    assert runner.graphs.status.startswith("failed")
    assert torch.equal(got["tokens"], ref["tokens"])


def test_graph_batches_are_bucketed_by_powers_of_two():
    """Issue 26 #9: rows that finish stay as masked dummies until the live count crosses a power of
    two, so a run captures one graph per bucket met instead of one per batch size, with the same
    tokens, log-probs and attended KV as eager decoding."""
    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (8, 5), generator=torch.Generator().manual_seed(3))
    free, _ = _decode(model, ids, Dense(), None, graphs=False, steps=12)
    # an EOS set that ends the rows at many different steps
    eos = sorted({int(free["tokens"][r, 1 + r]) for r in range(8)})
    ref, _ = _decode(model, ids, Dense(), None, graphs=False, steps=12, eos=eos)
    got, engine = _decode(model, ids, Dense(), None, graphs=True, steps=12, eos=eos)
    assert torch.equal(got["tokens"], ref["tokens"]) and torch.equal(got["lengths"], ref["lengths"])
    torch.testing.assert_close(got["rollout_logp"], ref["rollout_logp"], atol=2e-5, rtol=0)
    torch.testing.assert_close(got["kv_kept"], ref["kv_kept"])
    lengths = ref["lengths"]
    live_counts = [int((lengths > t).sum()) for t in range(1, int(lengths.max()))]
    batch, expected = 8, 1
    for n in live_counts:
        if n and 1 << (n - 1).bit_length() < batch:
            batch, expected = 1 << (n - 1).bit_length(), expected + 1
    assert engine.graphs.captures == expected < len(set(live_counts) - {0})


def test_rows_to_keep_pads_to_the_bucket():
    from sparsecorr.decoding.runner import bucket, rows_to_keep

    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    live = torch.tensor([True, False, True, True, False, False])
    assert torch.equal(rows_to_keep(live, padded=False), live)
    assert torch.equal(rows_to_keep(live, padded=True), torch.tensor([True, True, True, True, False, False]))
    assert rows_to_keep(torch.tensor([True] * 5 + [False]), padded=True).all()  # 5 -> bucket 8 >= 6
