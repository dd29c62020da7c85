"""The new engine against the previous one (``legacy_engine``: one token per forward, cat-grown
cache, left padding, float32 position-masked attention, BlockTopK by rescanning the cache):
same tokens, log-probs, top-k, budgets and attended KV; chunked prefill and chunked teacher
forcing; the CPU paged path (oracle kernel) against SDPA."""

import pytest
import torch

from sparsecorr.decoding import (
    RKV,
    BlockTopK,
    Dense,
    SnapKV,
    StreamingLLM,
    generate,
    teacher_forced_logprobs,
)
from sparsecorr.decoding.backends import PagedBackend, ReferenceDecodeKernel
from tests.models import tiny_model
from tests.unit.decoding.legacy_engine import legacy_run

POLICIES = [Dense(), StreamingLLM(sink=2), StreamingLLM(sink=1, buffer=3), SnapKV(window=4, buffer=4),
            RKV(window=4, buffer=4), BlockTopK(page_size=4, dense_layers=1)]
ids_ = {"ids": lambda p: f"{p.name}-{getattr(p, 'buffer', '')}"}


def _ragged(seed=0, b=3, p=10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (b, p), generator=g)
    am = torch.ones_like(ids)
    am[0, :3] = 0  # left padding
    am[2, 8:] = 0  # right padding
    return ids, am


def _close(new, old, n):
    mask = new.mask
    assert torch.equal(new.tokens[mask], old["tok"][mask])
    assert torch.equal(new.lengths, old["lengths"])
    torch.testing.assert_close(new.rollout_logp[mask], old["logp"][mask], atol=2e-5, rtol=0)
    torch.testing.assert_close(new.topk_logp[mask], old["tk"][mask], atol=2e-5, rtol=0)
    assert torch.equal(new.budget[mask], old["budget"][mask])
    torch.testing.assert_close(new.kv_kept[:, :n - 1], old["kept"][:, :n - 1], atol=1e-5, rtol=0)


class _Counter:
    def __init__(self, model):
        self.calls = 0
        model.model.register_forward_pre_hook(lambda *a: setattr(self, "calls", self.calls + 1))


@pytest.mark.parametrize("policy", POLICIES, **ids_)
def test_generate_equals_legacy_engine(policy):
    model = tiny_model("qwen3", num_layers=2)
    ids, am = _ragged()
    new = generate(model, ids, am, policy=policy, budget=8, max_new_tokens=24, temperature=0,
                   prefill_chunk=None, logprobs_topk=5)
    old = legacy_run(model, ids, am, policy=policy, budget=None if policy.kind == "dense" else 8,
                     steps=24, k=5)
    _close(new, old, 24)


@pytest.mark.parametrize("policy", POLICIES[1:], **ids_)
def test_schedule_budget_equals_legacy_engine(policy):
    class Steps:  # dense below 14 tokens of context, then 6, then 10
        def budget_at(self, c):
            return None if c < 14 else 6 if c < 24 else 10

    model = tiny_model("llama", num_layers=2)
    ids, am = _ragged(1)
    new = generate(model, ids, am, policy=policy, budget=Steps(), max_new_tokens=28, temperature=0,
                   prefill_chunk=None, logprobs_topk=3)
    old = legacy_run(model, ids, am, policy=policy, budget=Steps(), steps=28, k=3)
    _close(new, old, 28)
    tf = teacher_forced_logprobs(model, ids, new.tokens, policy=policy, budget=Steps(), attention_mask=am,
                                 prefill_chunk=None, logprobs_topk=3)
    _close(tf, old, 28)


@pytest.mark.parametrize("policy", POLICIES, **ids_)
def test_chunked_teacher_forcing_equals_per_token_loop(policy):
    model = tiny_model("qwen3", num_layers=2)
    ids, am = _ragged(2)
    out = generate(model, ids, am, policy=policy, budget=8, max_new_tokens=32, temperature=1.0,
                   top_p=0.95, generator=torch.Generator().manual_seed(0), prefill_chunk=None)
    rmask = out.mask.clone()
    rmask[1, 25:] = False  # a shorter response
    count = _Counter(model)
    tf = teacher_forced_logprobs(model, ids, out.tokens, policy=policy, budget=8, attention_mask=am,
                                 response_mask=rmask, temperature=1.0, top_p=0.95, prefill_chunk=None)
    forwards = count.calls
    old = legacy_run(model, ids, am, policy=policy, budget=None if policy.kind == "dense" else 8, steps=32,
                     temperature=1.0, top_p=0.95, forced=out.tokens, forced_len=rmask.sum(1))
    _close(tf, old, 32)
    torch.testing.assert_close(tf.rollout_logp[rmask], out.rollout_logp[rmask], atol=2e-5, rtol=0)
    # one forward per chunk: dense / selection replay everything at once; an eviction policy's
    # chunk ends at the next compression of any row (every buffer + 1 tokens per row; the rows
    # of a ragged batch compress out of step); StreamingLLM(buffer=0) compresses every token
    buffer = getattr(policy, "buffer", None)
    expect = 2 if buffer is None else 2 + ids.shape[0] * -(-31 // (buffer + 1))
    assert forwards <= expect, (forwards, expect)


@pytest.mark.parametrize("policy", [Dense(), BlockTopK(page_size=4, dense_layers=1)], ids=lambda p: p.name)
def test_prefill_chunks_do_not_change_dense_or_selection(policy):
    model = tiny_model("qwen2", num_layers=2)
    ids, am = _ragged(3, p=23)
    ref = generate(model, ids, am, policy=policy, budget=8, max_new_tokens=12, temperature=0, prefill_chunk=None)
    for chunk in (1, 5, 16):
        out = generate(model, ids, am, policy=policy, budget=8, max_new_tokens=12, temperature=0,
                       prefill_chunk=chunk)
        assert torch.equal(out.tokens, ref.tokens)
        torch.testing.assert_close(out.rollout_logp, ref.rollout_logp, atol=2e-5, rtol=0)


@pytest.mark.parametrize("policy", POLICIES[1:5], **ids_)
def test_chunked_prefill_bounds_the_cache_and_streams_the_prompt(policy):
    model = tiny_model("qwen3", num_layers=2)
    ids, am = _ragged(4, p=40)
    budget, chunk = 8, 4
    out = generate(model, ids, am, policy=policy, budget=budget, max_new_tokens=10, temperature=0,
                   prefill_chunk=chunk)
    dense = generate(model, ids, am, policy=Dense(), budget=None, max_new_tokens=10, temperature=0)
    assert out.peak_kv_bytes <= 3 * (budget + policy.buffer + chunk) * dense.peak_kv_bytes // (3 * 49)
    # one token per chunk = the prompt streamed through the decoder: teacher forcing of the
    # prompt's tail from its first token gives the same log-probs for the generated tokens
    one = generate(model, ids[:, 3:4], policy=policy, budget=budget, max_new_tokens=1, temperature=0)
    assert one.lengths.tolist() == [1, 1, 1]
    lens = am.sum(1)
    row = 1  # a row without padding
    streamed = generate(model, ids[row:row + 1], policy=policy, budget=budget, max_new_tokens=10,
                        temperature=0, prefill_chunk=1)
    tf = teacher_forced_logprobs(model, ids[row:row + 1, :1],
                                 torch.cat([ids[row:row + 1, 1:lens[row]], streamed.tokens], 1),
                                 policy=policy, budget=budget, prefill_chunk=1)
    torch.testing.assert_close(tf.rollout_logp[0, lens[row] - 1:], streamed.rollout_logp[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("policy", POLICIES, **ids_)
def test_paged_backend_equals_sdpa(policy):
    """The FlashInfer code path (page tables, one plan per step, per-layer page ids) with the
    float32 paged oracle as its kernel, on CPU."""
    model = tiny_model("qwen3", num_layers=2)
    ids, am = _ragged(5)
    ref = generate(model, ids, am, policy=policy, budget=8, max_new_tokens=20, temperature=0)
    paged = PagedBackend(ReferenceDecodeKernel, name="paged-oracle")
    out = generate(model, ids, am, policy=policy, budget=8, max_new_tokens=20, temperature=0, backend=paged)
    assert out.meta["backend"] == "paged-oracle"
    assert torch.equal(out.tokens, ref.tokens)
    torch.testing.assert_close(out.rollout_logp, ref.rollout_logp, atol=2e-5, rtol=0)
