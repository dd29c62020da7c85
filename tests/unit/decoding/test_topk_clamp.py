"""``logprobs_topk`` above the vocabulary is clamped to it and recorded in ``meta`` (issue 30).

It used to crash inside torch (the record had k columns, ``topk`` returned V), so a trainer with
the default k = 20 failed at its first generation on a model with fewer than 20 tokens.
"""

import pytest
import torch

from sparsecorr.decoding import StreamingLLM, generate, teacher_forced_logprobs
from tests.models import tiny_model

V = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", vocab_size=V)


def _ids():
    return torch.randint(3, V, (2, 4), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("k", [V + 1, 20, 10**6])
def test_generate_and_teacher_forcing_clamp_topk_to_the_vocabulary(model, k):
    policy = StreamingLLM(sink=1)
    out = generate(model, _ids(), policy=policy, budget=4, max_new_tokens=5, logprobs_topk=k,
                   generator=torch.Generator().manual_seed(0))
    assert out.topk_logp.shape == out.topk_ids.shape == (2, 5, V)
    assert out.meta["logprobs_topk"] == V and out.meta["logprobs_topk_requested"] == k
    # all V columns: the whole distribution, every id once
    top = out.topk_logp[out.mask]
    torch.testing.assert_close(top.exp().sum(-1), torch.ones(top.shape[0]))
    assert torch.equal(out.topk_ids[out.mask].sort(-1).values, torch.arange(V).expand(top.shape[0], V))
    forced = teacher_forced_logprobs(model, _ids(), out.tokens, policy=policy, budget=4,
                                     response_mask=out.mask, logprobs_topk=k)
    assert forced.topk_logp.shape == (2, 5, V) and forced.meta["logprobs_topk"] == V
    assert forced.meta["logprobs_topk_requested"] == k
    torch.testing.assert_close(forced.topk_logp[out.mask], top, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [0, 3, V])
def test_topk_within_the_vocabulary_is_kept(model, k):
    out = generate(model, _ids(), policy=StreamingLLM(sink=1), budget=4, max_new_tokens=3,
                   logprobs_topk=k, generator=torch.Generator().manual_seed(0))
    assert out.topk_logp.shape[-1] == k
    assert out.meta["logprobs_topk"] == out.meta["logprobs_topk_requested"] == k


def test_an_empty_batch_records_the_clamp_too(model):
    out = generate(model, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                   policy=StreamingLLM(sink=1), budget=4, max_new_tokens=2, logprobs_topk=20)
    assert out.topk_logp.shape == (2, 2, V) and out.meta["logprobs_topk"] == V
