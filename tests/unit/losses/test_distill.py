import math

import pytest
import torch

from sparsecorr.losses import (
    distill_sparse_loss,
    kl_from_logits,
    sparse_grpo,
    sparse_kl_k3,
    topk_kl,
)


def _logits(b=3, t=5, v=11, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(b, t, v, generator=g) * 2).to(dtype)
    te = (torch.randn(b, t, v, generator=g) * 2).to(dtype)
    mask = torch.rand(b, t, generator=g) > 0.3
    return s, te, mask


def _naive_kl(s, te, mask, direction, tau):
    ls = torch.log_softmax(s.float() / tau, -1)
    lt = torch.log_softmax(te.float() / tau, -1)
    p, q = (lt, ls) if direction == "forward" else (ls, lt)
    return torch.where(mask, (p.exp() * (p - q)).sum(-1), 0.0)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("tau, chunk", [(1.0, None), (0.7, 2), (2.0, 1)])
def test_kl_from_logits_equals_naive_values_and_gradients(direction, tau, chunk):
    s, te, mask = _logits()
    s1 = s.clone().requires_grad_(True)
    s2 = s.clone().requires_grad_(True)
    gw = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    out = kl_from_logits(s1, te, mask, direction=direction, temperature=tau, chunk_size=chunk)
    ref = _naive_kl(s2, te, mask, direction, tau)
    torch.testing.assert_close(out, ref)
    (out * gw).sum().backward()
    (ref * gw).sum().backward()
    torch.testing.assert_close(s1.grad, s2.grad)
    assert (out >= -1e-6).all() and out.dtype == torch.float32


def test_kl_from_logits_masked_garbage_and_bf16():
    s, te, mask = _logits()
    s = s.clone()
    s[~mask] = float("nan")
    s = s.requires_grad_(True)
    out = kl_from_logits(s, te, mask, chunk_size=4)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(s.grad).all()
    assert (s.grad[~mask] == 0).all() and (out[~mask] == 0).all()
    sb, tb, _ = _logits(dtype=torch.bfloat16)
    sb = sb.requires_grad_(True)
    outb = kl_from_logits(sb, tb, mask)
    outb.sum().backward()
    assert sb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(outb, _naive_kl(sb.detach(), tb, mask, "forward", 1.0))


def test_kl_from_logits_identical_is_zero():
    s, _, mask = _logits()
    torch.testing.assert_close(kl_from_logits(s, s.clone(), mask), torch.zeros(mask.shape), atol=1e-6, rtol=0)


def test_kl_from_logits_errors():
    s, te, mask = _logits()
    with pytest.raises(ValueError, match="teacher_logits"):
        kl_from_logits(s, te[..., :5], mask)
    with pytest.raises(ValueError, match="direction"):
        kl_from_logits(s, te, mask, direction="both")
    with pytest.raises(ValueError, match="temperature"):
        kl_from_logits(s, te, mask, temperature=0)
    with pytest.raises(ValueError, match="mask"):
        kl_from_logits(s, te, mask.float())


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_topk_kl_with_full_support_equals_full_kl(direction):
    s, te, mask = _logits(v=6)
    full = _naive_kl(s, te, mask, direction, 1.0)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(te, -1)
    torch.testing.assert_close(topk_kl(ls, lt, mask, direction=direction), full)
    torch.testing.assert_close(topk_kl(ls, lt, mask, direction=direction, renormalize=False), full)


def test_topk_kl_renormalised_is_nonnegative_and_differentiable():
    s, te, mask = _logits(v=20)
    ls = torch.log_softmax(s, -1).topk(5, dim=-1)
    lt = torch.log_softmax(te, -1).gather(-1, ls.indices)
    student = ls.values.clone().requires_grad_(True)
    out = topk_kl(student, lt, mask)
    assert (out >= -1e-6).all()
    out.sum().backward()
    assert torch.isfinite(student.grad).all()


def test_sparse_kl_k3_values_and_gradient():
    sparse = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    dense = torch.tensor([[-1.5, -2.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    k3 = sparse_kl_k3(sparse, dense, mask)
    d = torch.tensor(-0.5)
    torch.testing.assert_close(k3, torch.stack([d.exp() - d - 1, torch.tensor(0.0), torch.tensor(0.0)])[None])
    k3.sum().backward()
    # d k3 / d sparse = 1 - e^{d}
    torch.testing.assert_close(sparse.grad, torch.tensor([[1 - d.exp(), 0.0, 0.0]]))


def test_distill_sparse_loss_is_ppo_plus_lambda_k3():
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 6, generator=g) * 3
    sparse = (rollout + 0.1 * torch.randn(4, 6, generator=g)).requires_grad_(True)
    dense = rollout + 0.3 * torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.2
    adv = torch.randn(4, generator=g)
    rollout_bad = rollout.clone()
    rollout_bad[0, 0] = float("nan")
    out = distill_sparse_loss(sparse, rollout_bad, dense, adv, mask, kl_weight=0.5)
    kept = mask.clone()
    kept[0, 0] = False
    pg = sparse_grpo(sparse, rollout, adv, kept)
    k3 = sparse_kl_k3(sparse, dense, kept)
    torch.testing.assert_close(out.loss, pg.loss + 0.5 * k3.sum() / kept.sum())
    assert out.metrics["distill/nonfinite"] == int(mask[0, 0])
    assert out.metrics["distill/kl_k3_mean"] >= 0
    out.loss.backward()
    assert torch.isfinite(sparse.grad).all()


def test_topk_kl_zero_probability_entries():
    # a support entry with probability 0 in p contributes 0 (0 log 0 = 0), not NaN
    p = torch.log(torch.tensor([[[0.5, 0.5, 0.0]]]))
    q = torch.log(torch.tensor([[[0.25, 0.25, 0.5]]]))
    mask = torch.ones(1, 1, dtype=torch.bool)
    student = q.clone().requires_grad_(True)
    out = topk_kl(student, p, mask, renormalize=False)
    torch.testing.assert_close(out, torch.tensor([[math.log(2.0)]]))
    out.sum().backward()
    assert torch.isfinite(student.grad).all()


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_kl_from_logits_with_masked_vocabulary(direction):
    # -inf logits (e.g. padded vocabulary) in both models: 0 log 0 = 0, no NaN
    s, te, mask = _logits(v=8)
    s, te = s.clone(), te.clone()
    s[..., -2:] = float("-inf")
    te[..., -2:] = float("-inf")
    student = s.clone().requires_grad_(True)
    out = kl_from_logits(student, te, mask, direction=direction, chunk_size=3)
    ref = _naive_kl(s[..., :-2], te[..., :-2], mask, direction, 1.0)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert torch.isfinite(student.grad).all() and (student.grad[..., -2:] == 0).all()
