"""Each surrogate object equals its formula written out with plain autograd (value and
gradient), and the KL penalty's bias correction multiplies k3 by the PPO ratio."""

import pytest
import torch

from sparsecorr.correction import sparse_rl
from sparsecorr.losses import CISPO, GSPO, SAPO, SURROGATES, VESPO, KLPenalty, PPOClip, sparse_grpo


def _batch(seed=0, b=5, t=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + 0.3 * torch.randn(b, t, generator=g)
    ref = old + 0.2 * torch.randn(b, t, generator=g)
    mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    adv = torch.randn(b, generator=g)
    return logp, old, ref, mask, adv


def _token_mean(token_loss, mask):
    return (token_loss * mask).sum() / mask.sum()


def _cispo(logp, old, adv, mask, cap):
    # TRL 1.16 loss_type="cispo": -clamp(coef_1, max=eps_high).detach() * A * logp
    coef = torch.exp(logp - old).clamp(max=cap).detach()
    return _token_mean(-coef * adv[:, None] * logp, mask)


def _sapo(logp, old, adv, mask, tp, tn):
    # TRL 1.16 loss_type="sapo": -(sigmoid(tau (rho - 1)) * 4 / tau) * A
    rho = torch.exp(logp - old)
    a = adv[:, None].expand_as(rho)
    tau = torch.where(a > 0, tp, tn)
    return _token_mean(-(torch.sigmoid(tau * (rho - 1)) * 4 / tau) * a, mask)


@pytest.mark.parametrize("surrogate, reference", [
    (CISPO(cap=1.2), lambda *x: _cispo(*x, cap=1.2)),
    (SAPO(temperature_pos=1.0, temperature_neg=1.05), lambda *x: _sapo(*x, tp=1.0, tn=1.05)),
])
def test_surrogate_matches_its_formula(surrogate, reference):
    logp, old, _, mask, adv = _batch()
    lp = logp.clone().requires_grad_()
    out = sparse_grpo(lp, old, adv, mask, surrogate=surrogate)
    out.loss.backward()
    lp2 = logp.clone().requires_grad_()
    want = reference(lp2, old, adv, mask)
    want.backward()
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(lp.grad, torch.where(mask, lp2.grad, 0.0))


def test_gspo_default_is_the_tight_clip_and_registry_names_build_defaults():
    assert GSPO() == GSPO(clip_low=3e-4, clip_high=4e-4)
    assert {k: type(v()) for k, v in SURROGATES.items()} == {
        "ppo": PPOClip, "gspo": GSPO, "cispo": CISPO, "sapo": SAPO, "vespo": VESPO}
    logp, old, _, mask, adv = _batch(1)
    a = sparse_grpo(logp, old, adv, mask, surrogate="gspo").loss
    b = sparse_grpo(logp, old, adv, mask, surrogate=GSPO()).loss
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_penalty_with_and_without_bias_correction(bias_correction):
    logp, old, ref, mask, adv = _batch(2)
    beta = 0.05
    lp = logp.clone().requires_grad_()
    out = sparse_grpo(lp, old, adv, mask, ref_logp=ref, kl=KLPenalty(beta, bias_correction=bias_correction))
    out.loss.backward()
    lp2 = logp.clone().requires_grad_()
    base = sparse_grpo(lp2, old, adv, mask).loss
    d = ref - lp2
    k3 = torch.exp(d) - d - 1
    if bias_correction:
        k3 = k3 * torch.exp(lp2 - old)
    want = base + beta * _token_mean(k3, mask)
    want.backward()
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(lp.grad, torch.where(mask, lp2.grad, 0.0))
    assert "loss/kl_ref_k3_mean" in out.metrics


def test_gspo_bias_corrected_kl_uses_the_sequence_ratio():
    logp, old, ref, mask, adv = _batch(3)
    beta = 0.05
    lp = logp.clone().requires_grad_()
    out = sparse_grpo(lp, old, adv, mask, surrogate=GSPO(), ref_logp=ref,
                      kl=KLPenalty(beta, bias_correction=True))
    out.loss.backward()
    lp2 = logp.clone().requires_grad_()
    base = sparse_grpo(lp2, old, adv, mask, surrogate=GSPO()).loss
    d = ref - lp2
    k3 = torch.exp(d) - d - 1
    seq = torch.exp(((lp2 - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
    want = base + beta * _token_mean(k3 * seq, mask)
    want.backward()
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(lp.grad, torch.where(mask, lp2.grad, 0.0))


@pytest.mark.parametrize("surrogate", sorted(SURROGATES))
@pytest.mark.parametrize("metrics", ["default", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_metric_is_a_detached_0d_float32(surrogate, metrics, dtype):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 5, generator=g)
    logp = (old + 0.1 * torch.randn(3, 5, generator=g)).to(dtype).requires_grad_()
    out = sparse_grpo(logp, old, torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 5, dtype=torch.bool),
                      rollout_logp=old - 0.05, correction=sparse_rl(), surrogate=surrogate,
                      ref_logp=old, kl=0.01, metrics=metrics)
    for name, v in out.metrics.items():
        assert v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad, name
