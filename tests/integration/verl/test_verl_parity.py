"""sparsecorr against verl 0.9.1's own rollout-correction and policy-loss code, on the same
inputs: one test per correspondence docs/methods.md claims, and one per documented difference.

verl's functions are loaded unmodified through tests/verl_shim.py (verl is installed with
``--no-deps``). Names: verl's ``log_ratio`` is ``old_logp - rollout_logp``, sparsecorr's
\\(\\ell\\); verl's ``response_mask`` is the mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsecorr.correction import divergence, geo_rs, icepop, mis, sequence_is, sparse_rl, tis
from tests.verl_shim import load_verl_module, verl_available

pytestmark = pytest.mark.skipif(not verl_available(), reason="verl not installed")


@pytest.fixture(scope="module")
def rc():
    return load_verl_module("verl.trainer.ppo.rollout_corr_helper")


@pytest.fixture(scope="module")
def algos():
    return load_verl_module("verl.trainer.ppo.core_algos")


def _batch(seed: int, b: int = 8, t: int = 24, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 3 - 0.05
    old = rollout + torch.randn(b, t, generator=g) * spread
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    return old, rollout, mask


def _correct(correction, old, rollout, mask):
    """Apply a correction through the public API (a Mismatch record when the library has one)."""
    try:
        from sparsecorr.mismatch import measure
    except ImportError:  # before the Mismatch reshape
        from sparsecorr.correction import CorrectionInputs

        return correction(CorrectionInputs(old_logp=old, rollout_logp=rollout, mask=mask))
    return correction(measure(old, rollout, mask))


def _verl_weights(rc, old, rollout, mask, level, threshold, normalize=False):
    w, _ = rc.compute_rollout_correction_weights(old - rollout, mask.float(), rollout_is=level,
                                                 rollout_is_threshold=threshold,
                                                 rollout_is_batch_normalize=normalize)
    return w


def _verl_keep(rc, old, rollout, mask, option, threshold):
    keep, _ = rc.compute_rollout_rejection_mask(old - rollout, mask.float(), rollout_rs=option,
                                                rollout_rs_threshold=threshold)
    return keep.bool()


# -- importance weights -------------------------------------------------------------------------

@pytest.mark.parametrize("cap", [1.5, 2.0, 3.0])
def test_tis_equals_verl_token_is(rc, cap):
    old, rollout, mask = _batch(0)
    old[0, 0] = rollout[0, 0] + 30.0  # beyond the ±20 clamp both apply before exp
    ours = _correct(tis(cap=cap), old, rollout, mask)
    torch.testing.assert_close(ours.weights, _verl_weights(rc, old, rollout, mask, "token", cap))
    assert torch.equal(ours.mask, mask)


def test_mis_token_weights_equal_verl_lower_upper_threshold(rc):
    """verl's ``rollout_is_threshold="low_high"`` zeroes weights outside the band and keeps the
    raw ratio inside, like ``mis``; verl keeps a zeroed token in the loss mask (denominator),
    sparsecorr rejects it (leaves numerator and denominator)."""
    old, rollout, mask = _batch(1)
    ours = _correct(mis(low=0.7, high=1.4), old, rollout, mask)
    verl = _verl_weights(rc, old, rollout, mask, "token", "0.7_1.4")
    torch.testing.assert_close(ours.weights, verl)
    zeroed = mask & (verl == 0)
    assert zeroed.any() and not ours.mask[zeroed].any()


def test_sequence_is_sum_equals_verl_sequence_is_within_the_clamp(rc):
    old, rollout, mask = _batch(2, spread=0.05)  # |sum of log-ratios| well under 20
    for cap in (2.0, 5.0):
        ours = _correct(sequence_is(reduce="sum", cap=cap), old, rollout, mask)
        verl = _verl_weights(rc, old, rollout, mask, "sequence", cap)
        torch.testing.assert_close(ours.weights, verl)


def test_sequence_is_sum_clamps_each_token_where_verl_clamps_the_sum(rc):
    """The documented difference: a token past ±20 counts ±20 in sparsecorr's sum (every ratio
    here is formed from the per-token log-ratio clamped once), in full in verl's."""
    old, rollout, mask = _batch(12, spread=0.01)
    old[0, 0] = rollout[0, 0] + 25.0  # past the clamp
    old[0, 1] = rollout[0, 1] - 10.0
    ours = _correct(sequence_is(reduce="sum", cap=None), old, rollout, mask).weights
    verl = _verl_weights(rc, old, rollout, mask, "sequence", 1e30)
    others = torch.arange(mask.shape[0]) != 0
    torch.testing.assert_close(ours[others], verl[others])  # no token past the clamp: equal
    lr0 = (old[0] - rollout[0])[mask[0]]
    torch.testing.assert_close(ours[0, 0], lr0.clamp(-20, 20).sum().clamp(-20, 20).exp(), rtol=1e-5, atol=0)
    torch.testing.assert_close(verl[0, 0], lr0.sum().clamp(-20, 20).exp(), rtol=1e-5, atol=0)
    assert float(verl[0, 0] / ours[0, 0]) == pytest.approx(math.exp(5.0), rel=1e-3)  # x148


def test_token_batch_normalisation_equals_verl_without_rejection(rc):
    """verl ``rollout_is=token`` + ``rollout_is_batch_normalize``: mean weight over the valid
    tokens is 1; with no rejection, the kept tokens are all valid tokens and the two agree."""
    old, rollout, mask = _batch(3)
    ours = _correct(sparse_rl(cap=2.0, low=1e-3, high=1e3, veto_threshold=1e-9), old, rollout, mask)
    assert torch.equal(ours.mask, mask)  # nothing rejected at these bounds
    verl = _verl_weights(rc, old, rollout, mask, "token", 2.0, normalize=True)
    torch.testing.assert_close(ours.weights, verl)
    assert abs(float(ours.weights[mask].mean()) - 1.0) < 1e-5


# -- rejection ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("low", "high"), [(0.5, 1.5), (0.8, 1.25), (0.6, 1.2)])
def test_token_k1_bounds_the_reciprocal_ratio(rc, low, high):
    """verl's ``token_k1`` band ``low_high`` bounds pi_rollout/pi_old: the same tokens survive as
    sparsecorr's band on r = pi_old/pi_rollout over [1/high, 1/low]."""
    old, rollout, mask = _batch(4)
    verl = _verl_keep(rc, old, rollout, mask, "token_k1", f"{low}_{high}")
    ours = _correct(icepop(low=1 / high, high=1 / low), old, rollout, mask)
    assert torch.equal(ours.mask, verl & mask)
    if not math.isclose(low * high, 1.0):  # an asymmetric band: the direction matters
        direct = _correct(icepop(low=low, high=high), old, rollout, mask)
        assert not torch.equal(direct.mask, verl & mask)


@pytest.mark.parametrize(("low", "high"), [(0.97, 1.02), (0.98, 1.05)])
def test_seq_mean_k1_equals_geo_rs_on_the_reciprocal_band(rc, low, high):
    old, rollout, mask = _batch(5, spread=0.15)
    verl = _verl_keep(rc, old, rollout, mask, "seq_mean_k1", f"{low}_{high}")
    ours = _correct(geo_rs(low=1 / high, high=1 / low), old, rollout, mask)
    assert torch.equal(ours.mask, verl & mask)
    assert 0 < int(ours.mask.any(-1).sum()) < mask.shape[0]  # the band really splits the batch


@pytest.mark.parametrize("option", ["seq_max_k3", "seq_max_k2", "seq_mean_k3", "seq_mean_k2"])
@pytest.mark.parametrize("threshold", [0.05, 0.3])
def test_divergence_equals_verl_sequence_rejection(rc, option, threshold):
    old, rollout, mask = _batch(6)
    _, reduce, estimator = option.split("_")
    verl = _verl_keep(rc, old, rollout, mask, option, threshold)
    ours = _correct(divergence(threshold, estimator=estimator, reduce=reduce), old, rollout, mask)
    assert torch.equal(ours.mask, verl & mask)


# -- sparse_rl() vs verl's nearest configuration (documented differences) ------------------------

def _verl_sparse_rl(rc, old, rollout, mask):
    """verl's closest setting to sparse_rl(): token IS cap 1.5 + token_k1 on the reciprocal of
    sparsecorr's [0.5, 1.5] band + batch normalisation."""
    weights = _verl_weights(rc, old, rollout, mask, "token", 1.5, normalize=True)
    keep = _verl_keep(rc, old, rollout, mask, "token_k1", f"{1 / 1.5}_{1 / 0.5}")
    raw = _verl_weights(rc, old, rollout, mask, "token", 1.5)
    return weights, keep & mask, raw


def test_sparse_rl_rejects_like_verl_but_normalises_over_kept_tokens(rc):
    old, rollout, mask = _batch(7, spread=0.4)
    verl_w, verl_keep, raw = _verl_sparse_rl(rc, old, rollout, mask)
    ours = _correct(sparse_rl(), old, rollout, mask)
    assert torch.equal(ours.mask, verl_keep)  # no token below 1e-4: no veto, same rejection
    assert (mask & ~verl_keep).any()
    # same truncated weights on kept tokens, different normaliser: sparsecorr divides by the
    # mean over kept tokens, verl by the mean over every response token (rejected ones included)
    kept_mean, all_mean = raw[verl_keep].mean(), raw[mask].mean()
    torch.testing.assert_close(ours.weights[verl_keep], raw[verl_keep] / kept_mean)
    torch.testing.assert_close(verl_w[verl_keep], raw[verl_keep] / all_mean)
    assert abs(float(ours.weights[verl_keep].mean()) - 1.0) < 1e-5
    assert abs(float(verl_w[verl_keep].mean()) - 1.0) > 1e-3


def test_sparse_rl_vetoes_the_sequence_where_verl_rejects_one_token(rc):
    old, rollout, mask = _batch(8, spread=0.05)
    old[2, 3] = rollout[2, 3] + math.log(1e-5)  # r = 1e-5 < 1e-4: Sparse-RL's veto
    _, verl_keep, _ = _verl_sparse_rl(rc, old, rollout, mask)
    ours = _correct(sparse_rl(), old, rollout, mask)
    assert not verl_keep[2, 3] and verl_keep[2][mask[2]].sum() == mask[2].sum() - 1
    assert not ours.mask[2].any()  # the whole sequence leaves the loss
    others = torch.arange(mask.shape[0]) != 2
    assert torch.equal(ours.mask[others], verl_keep[others])


def test_sequence_batch_normalisation_weights_tokens_where_verl_weights_sequences(rc):
    """verl ``rollout_is=sequence`` normalises the mean of one weight per sequence; sparsecorr's
    batch normalisation is always the mean over kept tokens, so long sequences count more."""
    from sparsecorr.correction import batch_normalize

    old, rollout, mask = _batch(9, spread=0.05)
    raw = _correct(sequence_is(reduce="sum", cap=5.0), old, rollout, mask).weights
    ours = batch_normalize(raw, mask)
    verl = _verl_weights(rc, old, rollout, mask, "sequence", 5.0, normalize=True)
    seq = raw.amax(-1)
    torch.testing.assert_close(ours, raw / raw[mask].mean())
    torch.testing.assert_close(verl, raw / seq.mean())


# -- the policy loss ----------------------------------------------------------------------------

class _ActorConfig(dict):
    """The fields of verl's ActorConfig that ``compute_policy_loss_vanilla`` reads."""

    def __init__(self, clip_low: float, clip_high: float, clip_ratio_c: float, **batch_info):
        super().__init__(clip_ratio_c=clip_ratio_c)
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = clip_low, clip_low, clip_high
        self.global_batch_info = batch_info


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean",
                                         "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dual_clip", [3.0, 10.0])
def test_policy_loss_with_tis_equals_verl_vanilla(algos, rc, aggregation, dual_clip):
    from sparsecorr.losses import Aggregation, PPOClip, sparse_grpo

    old, rollout, mask = _batch(10)
    g = torch.Generator().manual_seed(11)
    logp = old + torch.randn(old.shape, generator=g) * 0.3
    adv = torch.randn(old.shape[0], generator=g)
    adv_bt = adv[:, None].expand_as(old).contiguous()
    weights = _verl_weights(rc, old, rollout, mask, "token", 2.0)

    x = logp.clone().requires_grad_(True)
    cfg = _ActorConfig(0.2, 0.28, dual_clip)
    verl_loss, verl_metrics = algos.compute_policy_loss_vanilla(
        old, x, adv_bt, mask.float(), loss_agg_mode=aggregation, config=cfg,
        rollout_is_weights=weights)
    verl_loss.backward()
    verl_grad, x.grad = x.grad.clone(), None

    out = sparse_grpo(x, old, adv, mask, rollout_logp=rollout, correction=tis(cap=2.0),
                      surrogate=PPOClip(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip),
                      aggregation=Aggregation(aggregation))
    out.loss.backward()
    torch.testing.assert_close(out.loss, verl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, verl_grad, rtol=1e-5, atol=1e-7)
    assert verl_metrics["actor/pg_clipfrac"] > 0  # the clip really acts on these inputs
