"""generate / teacher_forced_logprobs on tiny in-process models (CPU, seeded)."""

import pytest
import torch

from sparsecorr.decoding import (
    RKV,
    BlockTopK,
    Dense,
    RolloutBatch,
    SnapKV,
    StreamingLLM,
    generate,
    teacher_forced_logprobs,
)
from sparsecorr.mismatch import acceptance_rate_topk, binned_quantile
from tests.models import tiny_model

POLICIES = [StreamingLLM(sink=2), SnapKV(window=4, buffer=4), RKV(window=4, buffer=4),
            BlockTopK(page_size=4, dense_layers=1)]


def _full_forward_logp(model, ids, tokens):
    full = torch.cat([ids, tokens], 1)
    with torch.no_grad():
        logits = model(full).logits[:, ids.shape[1] - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_dense_equals_full_forward_and_model_generate(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=12, temperature=0,
                   eos_token_id=2)
    ref = _full_forward_logp(model, ids, out.tokens)
    torch.testing.assert_close(out.rollout_logp[out.mask], ref[out.mask], atol=1e-5, rtol=0)
    hf = model.generate(ids, max_new_tokens=12, do_sample=False)[:, 7:]
    for row, n in zip(range(2), out.lengths.tolist()):
        assert torch.equal(hf[row, :n], out.tokens[row, :n])


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_budget_above_length_equals_dense(policy):
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    dense = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=10, temperature=0)
    sparse = generate(model, ids, policy=policy, budget=64, max_new_tokens=10, temperature=0)
    assert torch.equal(dense.tokens, sparse.tokens)
    torch.testing.assert_close(dense.rollout_logp, sparse.rollout_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy", [Dense(), *POLICIES], ids=lambda p: p.name)
def test_ragged_batch_equals_per_sequence_and_teacher_forcing(policy):
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (3, 9), generator=g)
    am = torch.ones_like(ids)
    am[0, :4] = 0  # left padding
    am[2, 6:] = 0  # right padding
    batch = generate(model, ids, am, policy=policy, budget=8, max_new_tokens=14, temperature=0)
    for r in range(3):
        single = generate(model, ids[r:r + 1][:, am[r].bool()], policy=policy, budget=8,
                          max_new_tokens=14, temperature=0)
        assert torch.equal(single.tokens[0], batch.tokens[r])
        torch.testing.assert_close(single.rollout_logp[0], batch.rollout_logp[r], atol=1e-5, rtol=0)
    tf = teacher_forced_logprobs(model, ids, batch.tokens, policy=policy, budget=8, attention_mask=am)
    torch.testing.assert_close(tf.rollout_logp, batch.rollout_logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(tf.topk_logp, batch.topk_logp)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_sampled_teacher_forcing_reproduces_logprobs(policy):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (4, 5), generator=torch.Generator().manual_seed(3))
    out = generate(model, ids, policy=policy, budget=8, max_new_tokens=24, temperature=0.8,
                   top_p=0.9, generator=torch.Generator().manual_seed(0))
    tf = teacher_forced_logprobs(model, ids, out.tokens, policy=policy, budget=8, temperature=0.8,
                                 top_p=0.9)
    torch.testing.assert_close(tf.rollout_logp, out.rollout_logp, atol=1e-6, rtol=0)
    assert out.meta["top_p"] == 0.9 and torch.isfinite(out.rollout_logp[out.mask]).all()


@pytest.mark.parametrize("policy", [StreamingLLM(sink=2), SnapKV(window=4, buffer=4),
                                    RKV(window=4, buffer=4)], ids=lambda p: p.name)
def test_eviction_really_drops_kv(policy):
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(4))
    budget, new = 8, 40
    out = generate(model, ids, policy=policy, budget=budget, max_new_tokens=new, temperature=0)
    dense = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=new, temperature=0)
    cfg = model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 2  # K+V, B=2
    assert out.peak_kv_bytes <= (budget + policy.buffer + 1) * per_token
    assert dense.peak_kv_bytes >= (4 + new - 1) * per_token
    assert (out.kv_kept[:, :-1] <= budget + policy.buffer + 1).all()


def test_selection_attends_to_budget_but_keeps_everything():
    model = tiny_model("qwen3", num_layers=3)
    ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(5))
    out = generate(model, ids, policy=BlockTopK(page_size=4, dense_layers=1), budget=8,
                   max_new_tokens=40, temperature=0)
    dense = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=40, temperature=0)
    assert out.peak_kv_bytes == dense.peak_kv_bytes  # selection keeps the full cache
    # 1 dense layer reads everything, 2 sparse layers read <= 8 (+ partial page) slots
    late = out.kv_kept[0, 30:38]
    assert (late < dense.kv_kept[0, 30:38]).all()


def test_sparse_logprobs_differ_and_acceptance_decays_with_context():
    """Small budgets change the distribution more as the context outgrows the budget."""
    model = tiny_model("qwen3", hidden_size=64, num_layers=2)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 128, (8, 4), generator=g)
    out = generate(model, ids, policy=StreamingLLM(sink=1), budget=6, max_new_tokens=60,
                   temperature=1.0, generator=torch.Generator().manual_seed(1), logprobs_topk=128)
    dense = teacher_forced_logprobs(model, ids, out.tokens, policy=Dense(), budget=None,
                                    logprobs_topk=128)  # full vocabulary: exact acceptance
    assert (dense.rollout_logp - out.rollout_logp)[out.mask].abs().max() > 1e-3
    acc = acceptance_rate_topk(dense.topk_logp, dense.topk_ids, out.topk_logp, out.topk_ids)
    tail, counts = binned_quantile(acc, out.mask, 0.05, bin_size=20, offset=out.prompt_lengths)
    assert counts.min() > 0
    # the first bin is mostly within the budget (acceptance ~1); the tail drops after it
    assert tail[0] > tail[1:].max() + 0.01, tail
    early = acc[:, :2][out.mask[:, :2]]
    assert (early > 0.999).all()  # context still within the budget: identical distributions


def test_rollout_batch_save_load_roundtrip(tmp_path):
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    out = generate(model, ids, policy=RKV(window=4, buffer=4), budget=8, max_new_tokens=6,
                   generator=torch.Generator().manual_seed(0))
    path = out.save(tmp_path / "batch.safetensors")
    back = RolloutBatch.load(path)
    for name in ("tokens", "mask", "rollout_logp", "topk_ids", "budget", "kv_kept", "pruned"):
        assert torch.equal(getattr(out, name), getattr(back, name))
    assert back.finish_reason == out.finish_reason and back.meta == out.meta
    with pytest.raises(ValueError, match="path"):
        RolloutBatch.load(tmp_path / "missing.safetensors")


def test_schedule_budget_is_evaluated_per_context_length():
    class Steps:
        def budget_at(self, context_len):
            return None if context_len < 10 else 6

    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(8))
    out = generate(model, ids, policy=StreamingLLM(sink=1), budget=Steps(), max_new_tokens=12,
                   temperature=0)
    # step t decodes with context 4 + t: dense (-1) until the context reaches 10
    assert out.budget[0, :6].tolist() == [-1] * 6 and out.budget[0, 6:].tolist() == [6] * 6


def test_bad_arguments():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 4))
    with pytest.raises(ValueError, match="policy"):
        generate(model, ids, policy="rkv", budget=8, max_new_tokens=4)
    with pytest.raises(ValueError, match="budget"):
        generate(model, ids, policy=RKV(), budget=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, policy=RKV(), budget=8, max_new_tokens=0)
    with pytest.raises(ValueError, match="backend"):
        generate(model, ids, policy=RKV(), budget=8, max_new_tokens=2, backend="cuda")
    with pytest.raises(ValueError, match="group_size"):
        generate(model, ids, policy=RKV(), budget=8, max_new_tokens=2, pruner=object())


def test_teacher_forcing_with_grad_matches_full_forward_gradient():
    torch.manual_seed(0)
    model = tiny_model("qwen3", vocab_size=64)
    prompts, resp = torch.randint(4, 60, (2, 6)), torch.randint(4, 60, (2, 10))
    out = teacher_forced_logprobs(model, prompts, resp, policy=Dense(), budget=None, grad=True)
    out.rollout_logp.sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=torch.cat([prompts, resp], 1)).logits[:, 5:-1].float()
    want_logp = logits.log_softmax(-1).gather(-1, resp[..., None]).squeeze(-1)
    want_logp.sum().backward()
    torch.testing.assert_close(out.rollout_logp.detach(), want_logp.detach(), atol=1e-5, rtol=0)
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-4, rtol=1e-4)
    # an evicting policy: the gradient flows through the kept entries and differs from dense
    model.zero_grad()
    sparse = teacher_forced_logprobs(model, prompts, resp, policy=StreamingLLM(sink=1), budget=4,
                                     grad=True)
    sparse.rollout_logp.sum().backward()
    assert any(not torch.allclose(g, p.grad) for g, p in zip(got, model.parameters()))
    with torch.no_grad():
        again = teacher_forced_logprobs(model, prompts, resp, policy=StreamingLLM(sink=1), budget=4)
    assert not again.rollout_logp.requires_grad
    torch.testing.assert_close(again.rollout_logp, sparse.rollout_logp.detach())
