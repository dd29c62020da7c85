"""``LossOutput.kl``: the penalty term the loss used, so the glue logs it instead of recomputing it."""

from __future__ import annotations

import pytest
import torch

from sparsecorr.correction import sparse_rl
from sparsecorr.losses import KLPenalty, sparse_grpo


def _batch(seed: int = 0, b: int = 6, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    roll = old - 0.2 * torch.randn(b, t, generator=g)
    roll[2, 3] = old[2, 3] + 12.0  # ratio e^-12 < 1e-4: sparse_rl()'s veto drops row 2
    logp = (old + 0.05 * torch.randn(b, t, generator=g)).requires_grad_()
    ref = old + 0.1 * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    return logp, old, roll, ref, torch.randn(b, generator=g), mask


def _k3(ref, logp, mask):
    d = torch.where(mask, ref - logp.detach(), 0.0).clamp(-20, 20)
    return torch.where(mask, torch.expm1(d) - d, 0.0)


@pytest.mark.parametrize("bias", [False, True])
def test_kl_is_the_k3_term_on_the_loss_tokens(bias):
    logp, old, roll, ref, adv, mask = _batch()
    out = sparse_grpo(logp, old, adv, mask, rollout_logp=roll, correction=sparse_rl(), ref_logp=ref,
                      kl=KLPenalty(0.1, bias_correction=bias))
    assert not out.mask[2].any()  # the veto dropped row 2: no token, no KL term there
    want = _k3(ref, logp, out.mask) * (out.ratio if bias else 1.0)
    torch.testing.assert_close(out.kl, want, rtol=1e-6, atol=1e-7)
    assert not out.kl.requires_grad
    # the loss is the policy loss plus beta times the token mean of that term
    pg = sparse_grpo(logp, old, adv, mask, rollout_logp=roll, correction=sparse_rl()).loss
    torch.testing.assert_close(out.loss, pg + 0.1 * out.kl.sum() / out.mask.sum(), rtol=1e-5, atol=1e-7)


def test_no_penalty_no_kl():
    logp, old, _, ref, adv, mask = _batch()
    assert sparse_grpo(logp, old, adv, mask, ref_logp=ref).kl is None
    assert sparse_grpo(logp, old, adv, mask, ref_logp=ref, kl=0.1, metrics="none").kl is not None
