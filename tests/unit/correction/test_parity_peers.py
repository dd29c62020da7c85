"""Parity of the peer presets with the peers' own code, on the same random inputs.

- TRL 1.16 computes its vLLM importance-sampling correction inline in
  ``GRPOTrainer._generate_and_score_completions``; the test extracts that block from the
  installed source and executes TRL's own lines on the inputs.
- OpenRLHF 0.11's ``PolicyLoss`` (loaded through ``tests/openrlhf_shim.py``) is run at policy
  ratio 1 with advantages -1, where each token's loss is exactly its correction coefficient:
  the gradient with respect to ``log_probs`` times the token count recovers the per-token
  weights.
"""

import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

from sparsecorr.correction import openrlhf, trl
from sparsecorr.mismatch import measure
from tests.openrlhf_shim import load_openrlhf_loss_module, openrlhf_available


def _random_inputs(seed, b=6, t=40, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 3 - 0.01
    old = rollout + torch.randn(b, t, generator=g) * scale
    old = old.clamp(max=-1e-3)  # valid log-probs (OpenRLHF's binary KL reads exp(logp) < 1)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    return old, rollout, mask


def _trl_block():
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    src = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions)
    start = src.index("            if self.use_vllm and self.vllm_importance_sampling_correction:\n"
                      "                mask = completion_mask")
    end = src.index("            # Compute the per-token log probabilities for the reference model")
    return textwrap.dedent(src[start:end])


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip", [(None, 3.0), (0.5, 2.0), (0.1, None)])
@pytest.mark.parametrize("seed", [0, 1])
def test_trl_presets_equal_trl_code(mode, clip, seed):
    block = _trl_block()
    old, rollout, mask = _random_inputs(seed, scale=0.2 if mode.startswith("sequence") else 0.6)
    clip_min, clip_max = clip
    ns = {
        "self": SimpleNamespace(
            use_vllm=True, vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
            vllm_importance_sampling_clip_max=clip_max),
        "completion_mask": mask.float(), "tool_mask": None,
        "old_per_token_logps": old, "sampling_per_token_logps": rollout,
        "torch": torch, "math": math,
    }
    exec(compile(block, "trl_grpo_is_block", "exec"), ns)
    trl_ratio = ns["vllm_importance_sampling_ratio"].expand_as(old)
    ours = trl(mode, clip_min=clip_min, clip_max=clip_max)(measure(old, rollout, mask))
    # TRL's ratio is defined at padded positions too (1 for token modes); compare where it counts
    torch.testing.assert_close(ours.weights[mask], trl_ratio[mask].float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.mask, mask)  # TRL keeps rejected tokens in the denominator


OPENRLHF_SETTINGS = [
    ("token", "mask", "ratio", (0.5, 5.0)),
    ("token", "mask", "ratio", (0.8, 1.25)),
    ("token", "clip", "ratio", (0.5, 5.0)),
    ("token", "clip", "ratio", (0.8, 1.25)),
    ("seq", "mask", "ratio", (0.5, 5.0)),
    ("seq", "mask", "ratio", (0.9, 1.1)),
    ("token", "mask", "binary_kl", (0.0, 0.01)),
    ("seq", "mask", "binary_kl", (0.0, 0.005)),
    ("token", "mask", "tv", (0.0, 0.05)),
    ("seq", "mask", "tv", (0.0, 0.03)),
]


@pytest.mark.skipif(not openrlhf_available(), reason="openrlhf not installed")
@pytest.mark.parametrize("setting", OPENRLHF_SETTINGS)
@pytest.mark.parametrize("seed", [0, 3])
def test_openrlhf_presets_equal_policy_loss_weights(setting, seed):
    loss_mod = load_openrlhf_loss_module()
    level, mode, gating, threshold = setting
    old, rollout, mask = _random_inputs(seed)
    policy = loss_mod.PolicyLoss(is_correction_level=level, is_correction_mode=mode,
                                 is_correction_gating=gating, is_correction_threshold=threshold)
    log_probs = old.clone().requires_grad_(True)  # policy ratio exactly 1
    advantages = -torch.ones_like(old)  # per-token loss = coefficient * 1
    loss, *_ = policy(log_probs, old, advantages, action_mask=mask.float(), rollout_log_probs=rollout)
    loss.backward()
    peer_weights = log_probs.grad * mask.sum()  # token-level mean: d loss / d logp_t = coef_t / N
    ours = openrlhf(level, mode, gating, threshold)(measure(old, rollout, mask))
    torch.testing.assert_close(ours.weights, torch.where(mask, peer_weights, 0.0), rtol=1e-4, atol=1e-6)
    assert torch.equal(ours.mask, mask)
    # the aggregated loss agrees too: mean of the weights over valid tokens
    torch.testing.assert_close(loss.detach(), ours.weights[mask].mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not openrlhf_available(), reason="openrlhf not installed")
def test_openrlhf_off_is_identity():
    loss_mod = load_openrlhf_loss_module()
    old, rollout, mask = _random_inputs(5)
    policy = loss_mod.PolicyLoss(is_correction_level="off")
    log_probs = old.clone().requires_grad_(True)
    loss, *_ = policy(log_probs, old, -torch.ones_like(old), action_mask=mask.float(),
                      rollout_log_probs=rollout)
    ours = openrlhf("off")(measure(old, rollout, mask))
    assert float(loss.detach()) == pytest.approx(1.0)
    assert (ours.weights[mask] == 1).all()
