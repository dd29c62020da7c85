import pytest
import torch

from sparsecorr.mismatch import (
    acceptance_rate,
    acceptance_rate_topk,
    token_logprobs,
    token_logprobs_and_entropy,
    topk_logprobs,
    truncated_token_logprobs,
)


def _data(seed=0, b=2, t=5, v=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, v, (b, t), generator=g)
    return logits, tokens


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_token_logprobs_equals_naive_with_gradient(temperature, chunk):
    logits, tokens = _data()
    logits.requires_grad_(True)
    ours = token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk)
    naive = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(ours, naive, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(ours)
    (g1,) = torch.autograd.grad((ours * w).sum(), logits)
    (g2,) = torch.autograd.grad((naive * w).sum(), logits)
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)


def test_token_logprobs_bf16_input_float32_output():
    logits, tokens = _data(dtype=torch.bfloat16)
    ours = token_logprobs(logits, tokens, chunk_size=2)
    naive = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, naive, atol=1e-5, rtol=1e-5)
    logits.requires_grad_(True)
    (g,) = torch.autograd.grad(token_logprobs(logits, tokens).sum(), logits)
    assert g.dtype == torch.bfloat16


def test_entropy_matches_definition():
    logits, tokens = _data(1)
    _, ent = token_logprobs_and_entropy(logits, tokens, chunk_size=3)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)


def test_topk_logprobs():
    logits, _ = _data(2)
    vals, idx = topk_logprobs(logits, k=5, chunk_size=4)
    ref = torch.log_softmax(logits, -1).topk(5, -1)
    torch.testing.assert_close(vals, ref.values)
    assert torch.equal(idx, ref.indices)
    with pytest.raises(ValueError, match="k: expected"):
        topk_logprobs(logits, k=0)


def test_truncated_logprobs_top_k_and_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    tok = torch.tensor([[1]])
    # top_k=2: support {0, 1}, p(1) = 0.3 / 0.8
    assert float(truncated_token_logprobs(logits, tok, top_k=2)) == pytest.approx(
        torch.tensor(0.3 / 0.8).log().item(), abs=1e-6)
    # top_p=0.7: keep 0.5 then 0.3 (mass before 0.3 is 0.5 < 0.7), drop 0.15 (0.8 >= 0.7)
    assert float(truncated_token_logprobs(logits, tok, top_p=0.7)) == pytest.approx(
        torch.tensor(0.3 / 0.8).log().item(), abs=1e-6)
    out = truncated_token_logprobs(logits, torch.tensor([[3]]), top_p=0.7)
    assert out.item() == float("-inf")
    full = truncated_token_logprobs(logits, tok)
    assert float(full) == pytest.approx(torch.tensor(0.3).log().item(), abs=1e-6)


def test_truncated_logprobs_match_transformers_processors():
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    logits, tokens = _data(3, t=6)
    z = logits.reshape(-1, logits.shape[-1]) / 0.8
    z = TopKLogitsWarper(10)(None, z)
    z = TopPLogitsWarper(0.9)(None, z)
    ref = torch.log_softmax(z, -1).gather(-1, tokens.reshape(-1, 1)).reshape(tokens.shape)
    ours = truncated_token_logprobs(logits, tokens, top_k=10, top_p=0.9, temperature=0.8)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(ours))
    torch.testing.assert_close(ours[finite], ref[finite], atol=1e-5, rtol=1e-5)


def test_acceptance_exact_and_topk_bound():
    p_logits, _ = _data(4)
    q_logits = p_logits + torch.randn_like(p_logits)
    acc = acceptance_rate(p_logits, q_logits, chunk_size=3)
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    torch.testing.assert_close(acc, torch.minimum(p, q).sum(-1))
    torch.testing.assert_close(acceptance_rate(p_logits, p_logits), torch.ones(2, 5))
    pv, pi = topk_logprobs(p_logits, k=8)
    qv, qi = topk_logprobs(q_logits, k=8)
    bound = acceptance_rate_topk(pv, pi, qv, qi)
    assert (bound <= acc + 1e-6).all() and (bound >= 0).all()
    fv, fi = topk_logprobs(p_logits, k=40)
    gv, gi = topk_logprobs(q_logits, k=40)
    torch.testing.assert_close(acceptance_rate_topk(fv, fi, gv, gi), acc, atol=1e-5, rtol=1e-5)


def test_errors():
    logits, tokens = _data()
    with pytest.raises(ValueError, match=r"tokens: expected shape \(2, 5\)"):
        token_logprobs(logits, tokens[:, :3])
    with pytest.raises(ValueError, match="tokens: expected an integer tensor"):
        token_logprobs(logits, tokens.float())
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, temperature=0)
    with pytest.raises(ValueError, match="q_logits"):
        acceptance_rate(logits, logits[:, :2])


def test_chunk_size_and_vocabulary_are_checked_before_any_work():
    """Issue #14: chunk_size <= 0 returned uninitialised memory; an out-of-vocabulary id failed
    inside torch without naming the argument."""
    import pytest

    from sparsecorr.mismatch import acceptance_rate, token_logprobs, topk_logprobs

    g = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match=r"^chunk_size: expected an int >= 1 or None"):
            token_logprobs(logits, tokens, chunk_size=bad)
        with pytest.raises(ValueError, match=r"^chunk_size"):
            topk_logprobs(logits, k=2, chunk_size=bad)
        with pytest.raises(ValueError, match=r"^chunk_size"):
            acceptance_rate(logits, logits, chunk_size=bad)
    with pytest.raises(ValueError, match=r"^tokens: expected ids in \[0, 6\].*got values in \[0, 9\]"):
        token_logprobs(logits, torch.where(tokens == tokens.max(), 9, tokens))
    ref = token_logprobs(logits, tokens)
    for chunk in (1, 3, 10):
        torch.testing.assert_close(token_logprobs(logits, tokens, chunk_size=chunk, validate=False), ref)
