"""Issue 34: the decode's kept sets are recorded (``generate(..., record_keep=True)``) and
replayed by teacher forcing (``teacher_forced_logprobs(..., keep_sets=...)``), so a parity test
measures numerics apart from the agreement of the selection.

The setting is ENGINE-READING-2026-11-26 §4's: a tiny Qwen3 (4 layers, 8/2 heads, head_dim 32),
a ragged batch of 4 x 300, budget 64, buffer 16, prefill_chunk 128, 96 greedy tokens; decoded
with the ``torch`` backend in the model's dtype, replayed with the float32 ``reference``. In
float32 the two runs keep identical sets and agree to 1e-6 (R-KV's own thresholded rule, the
default since issue 51: all but a near-tie, and to 1e-5 with the sets replayed). In bf16 a near-tied SnapKV / R-KV
score flips the kept set (reproduced here: without the replay SnapKV's MAD is about 0.02 on the
CPU, twice the 1e-2 target); with the decode's sets replayed the MAD is the dense level (~0.002).
"""

from __future__ import annotations

import pytest
import torch

import sparsecorr.decoding.graphs as graphs_mod
from sparsecorr.decoding import (
    RKV,
    KeptSets,
    SnapKV,
    StreamingLLM,
    generate,
    teacher_forced_logprobs,
)
from tests.models import tiny_model

#: R-KV's identity of free kept sets in float32 is the earlier scoring's (``scoring="minmax"``);
#: R-KV's own rule (the default) is tested apart (`test_float32_rkv_default_replays_its_kept_sets`)
EVICTION = [SnapKV(buffer=16), RKV(buffer=16, scoring="minmax"), StreamingLLM(buffer=16)]


def _setup(dtype, seed=0):
    model = tiny_model("qwen3", num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=256,
                       vocab_size=512, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (4, 300), generator=g)
    am = torch.ones_like(ids)
    am[1, :40] = 0
    am[3, :7] = 0
    return model, ids, am


def _decode_and_replays(policy, dtype, seed=0, **gen_kw):
    model, ids, am = _setup(dtype, seed)
    out = generate(model, ids, am, policy=policy, budget=64, max_new_tokens=96, temperature=0, backend="torch",
                   prefill_chunk=128, record_keep=True, logprobs_topk=0, **gen_kw)
    kw = dict(policy=policy, budget=64, attention_mask=am, response_mask=out.mask, backend="reference",
              prefill_chunk=128, logprobs_topk=0)
    free = teacher_forced_logprobs(model, ids, out.tokens, record_keep=True, **kw)
    replayed = teacher_forced_logprobs(model, ids, out.tokens, keep_sets=out.kept_sets, record_keep=True, **kw)
    return out, free, replayed


def _mad(a, b, mask):
    return float((a.rollout_logp - b.rollout_logp)[mask].abs().mean())


@pytest.mark.parametrize("policy", EVICTION, ids=lambda p: p.name)
def test_float32_kept_sets_are_identical_and_the_replay_exact(policy):
    out, free, replayed = _decode_and_replays(policy, torch.float32)
    ks = out.kept_sets
    assert isinstance(ks, KeptSets) and ks.rows.numel() > 0
    assert ks.positions.shape[1:3] == (4, 2) and ks.positions.shape[-1] >= 64
    assert bool(((ks.positions >= 0).sum(-1) == 64).all())  # budget 64 kept per layer and head
    agree = ks.agreement(free.kept_sets)
    assert agree.events == ks.rows.numel() and agree.identical == 1.0 and agree.jaccard == 1.0
    assert _mad(out, free, out.mask) < 1e-5
    # forcing identical sets changes nothing, and the forced replay keeps what it was given
    torch.testing.assert_close(replayed.rollout_logp, free.rollout_logp, atol=0, rtol=0)
    assert ks.agreement(replayed.kept_sets).identical == 1.0


def test_float32_rkv_default_replays_its_kept_sets():
    """R-KV's own rule (the default scoring) thresholds the key cosines at 0.5 (its
    most-recent-near-duplicate rule): float32 rounding between the decode's ``torch`` backend and
    the replay's ``reference`` backend can move a key pair across the threshold and flip a near-tie
    (one set of 248 here), so the free replay keeps almost the same sets; with the decode's sets
    replayed the replay keeps exactly them and its log-probs are the decode's to float32 rounding."""
    out, free, replayed = _decode_and_replays(RKV(buffer=16), torch.float32)
    ks = out.kept_sets
    assert isinstance(ks, KeptSets) and ks.rows.numel() > 0
    assert bool(((ks.positions >= 0).sum(-1) == 64).all())  # budget 64 kept per layer and head
    agree = ks.agreement(free.kept_sets)
    assert agree.events == ks.rows.numel() and agree.jaccard > 0.999
    assert ks.agreement(replayed.kept_sets).identical == 1.0
    assert _mad(out, replayed, out.mask) < 1e-5


@pytest.mark.parametrize("policy", [*EVICTION[:2], RKV(buffer=16)], ids=["snapkv", "rkv-minmax", "rkv"])
def test_bf16_log_probs_under_the_replayed_kept_sets(policy, capsys):
    """Numerics (MAD < 1e-2 with the decode's kept sets replayed) reported apart from the
    agreement of the selection (printed: it is not a numerical property in bf16)."""
    out, free, replayed = _decode_and_replays(policy, torch.bfloat16)
    mad_free, mad_replayed = _mad(out, free, out.mask), _mad(out, replayed, out.mask)
    agree = out.kept_sets.agreement(free.kept_sets)
    with capsys.disabled():
        print(f"\n[bf16 {policy.name}] MAD free {mad_free:.4f}, with the decode's kept sets {mad_replayed:.4f}; "
              f"kept sets identical {agree.identical:.3f}, Jaccard {agree.jaccard:.3f} over {agree.events} events")
    assert mad_replayed < 1e-2
    assert mad_replayed <= mad_free
    assert out.kept_sets.agreement(replayed.kept_sets).identical == 1.0  # the replay kept what it was given


@pytest.mark.slow  # ~15 s idle; make test-slow (CI) runs it; the eager record/replay tests stay in the default run
def test_graph_steps_record_the_eager_kept_sets(monkeypatch):
    monkeypatch.setattr(graphs_mod, "CudaGraphRunner", graphs_mod.EagerRunner)
    monkeypatch.setattr(graphs_mod, "check_graph_device", lambda device: None)
    model, ids, am = _setup(torch.float32)
    kw = dict(policy=SnapKV(buffer=16), budget=64, max_new_tokens=40, temperature=0, prefill_chunk=128,
              record_keep=True, logprobs_topk=0)
    eager = generate(model, ids, am, **kw)
    graph = generate(model, ids, am, cuda_graph=True, **kw)
    assert graph.meta["cuda_graph"] == "on"
    assert eager.kept_sets.agreement(graph.kept_sets).identical == 1.0
    assert torch.equal(eager.kept_sets.rows, graph.kept_sets.rows)


def test_kept_sets_are_off_by_default_and_checked():
    model, ids, am = _setup(torch.float32)
    ids, am = ids[:2, :40], am[:2, :40]
    kw = dict(policy=StreamingLLM(buffer=2), budget=8, prefill_chunk=16, logprobs_topk=0)
    out = generate(model, ids, am, max_new_tokens=6, temperature=0, **kw)
    assert out.kept_sets is None
    with pytest.raises(ValueError, match="record_keep: expected a bool"):
        generate(model, ids, am, max_new_tokens=2, record_keep=1, **kw)
    with pytest.raises(ValueError, match="keep_sets: expected a KeptSets"):
        teacher_forced_logprobs(model, ids, out.tokens, attention_mask=am, keep_sets={}, **kw)
    rec = generate(model, ids, am, max_new_tokens=6, temperature=0, record_keep=True, **kw)
    other = dict(kw, prefill_chunk=8)  # another chunking compresses at other context lengths
    with pytest.raises(ValueError, match="keep_sets: no kept set recorded for row"):
        teacher_forced_logprobs(model, ids, rec.tokens, attention_mask=am, keep_sets=rec.kept_sets, **other)
