"""sparse_grpo with the openrlhf() preset equals OpenRLHF 0.11's real PolicyLoss (value and gradient).

OpenRLHF keeps rejected tokens in its denominator (masked mean over the action mask); sparse_grpo
drops them (shared/DESIGN.md), so token-level parity is reached by passing OpenRLHF's denominator
explicitly, ``num_tokens = mask.sum()``. OpenRLHF's per-sample mode divides each row by its
unrejected length, which sparse_grpo deliberately does not offer, so it is not compared.
"""

import pytest
import torch

from sparsecorr.correction import openrlhf
from tests.openrlhf_shim import load_openrlhf_loss_module, openrlhf_available
from tests.unit.losses.helpers import grpo

pytestmark = pytest.mark.skipif(not openrlhf_available(), reason="openrlhf not installed")


def _inputs(seed=0, b=6, t=10):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    rollout = old - torch.randn(b, t, generator=g)  # ratios often outside [0.5, 5]
    logp = old + torch.randn(b, t, generator=g) * 0.3
    mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    adv = torch.randn(b, generator=g)
    return logp, old, rollout, mask, adv


@pytest.mark.parametrize("mode, threshold", [("mask", (0.5, 5.0)), ("clip", (0.5, 2.0))])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_token_level_matches_openrlhf_policy_loss(mode, threshold, dual_clip):
    PolicyLoss = load_openrlhf_loss_module().PolicyLoss
    logp, old, rollout, mask, adv = _inputs()
    peer = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip, is_correction_level="token",
                      is_correction_mode=mode, is_correction_threshold=threshold)
    lp_peer = logp.clone().requires_grad_(True)
    peer_loss, *_ = peer(lp_peer, old, adv[:, None].expand_as(logp), action_mask=mask.float(),
                         rollout_log_probs=rollout)
    peer_loss.backward()
    lp = logp.clone().requires_grad_(True)
    out = grpo(lp, old, adv, mask, rollout_logp=rollout,
                      correction=openrlhf(level="token", mode=mode, threshold=threshold),
                      clip_high=0.28, dual_clip=dual_clip, num_tokens=mask.sum())
    out.loss.backward()
    torch.testing.assert_close(out.loss, peer_loss)
    torch.testing.assert_close(lp.grad, lp_peer.grad * mask)


def test_gspo_matches_openrlhf_gspo():
    PolicyLoss = load_openrlhf_loss_module().PolicyLoss
    logp, old, _, mask, adv = _inputs(seed=3)
    peer = PolicyLoss(clip_eps_low=3e-4, clip_eps_high=4e-4, policy_loss_type="gspo")
    lp_peer = logp.clone().requires_grad_(True)
    peer_loss, *_ = peer(lp_peer, old, adv[:, None].expand_as(logp), action_mask=mask.float())
    peer_loss.backward()
    lp = logp.clone().requires_grad_(True)
    out = grpo(lp, old, adv, mask, ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                      aggregation="seq-mean-token-mean")
    out.loss.backward()
    torch.testing.assert_close(out.loss, peer_loss)
    torch.testing.assert_close(lp.grad, lp_peer.grad * mask)
