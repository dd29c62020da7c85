"""sparse_grpo with a correction: weights multiply, rejected tokens leave the loss entirely."""

import itertools

import pytest
import torch

from sparsecorr.correction import Correction
from sparsecorr.losses import AGGREGATIONS
from sparsecorr.mismatch import measure
from tests.unit.losses.helpers import grpo
from tests.unit.losses.reference import loop_grpo_loss
from tests.unit.losses.test_grpo import _batch


def fixed_correction(weights, reject):
    """A test correction with known weights and rejections (reject = True drops the token)."""

    def correct(mm) -> Correction:
        keep = mm.valid & ~reject
        return Correction(mask=keep, token_weights=torch.where(keep, weights, 0.0),
                          piece_metrics={"correction/fixed_frac": keep.sum() / mm.mask.sum()},
                          source=mm)

    return correct


def _weights(shape, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * 2, torch.rand(shape, generator=g) < 0.25


@pytest.mark.parametrize("aggregation, ratio_level", list(itertools.product(AGGREGATIONS, ["token", "sequence"])))
def test_weighted_loss_matches_loop_reference(aggregation, ratio_level):
    d = _batch(b=6, t=8, seed=1)
    w, reject = _weights(d["mask"].shape)
    lp = d["logp"].clone().requires_grad_(True)
    out = grpo(lp, d["old_logp"], d["advantages"], d["mask"], rollout_logp=d["rollout_logp"],
                      correction=fixed_correction(w, reject), aggregation=aggregation,
                      ratio_level=ratio_level, clip_high=0.28 if ratio_level == "token" else 0.05)
    out.loss.backward()
    kept = d["mask"] & ~reject
    lp_ref = d["logp"].clone().requires_grad_(True)
    ref = loop_grpo_loss(lp_ref, d["old_logp"], d["advantages"], kept, w, aggregation=aggregation,
                         ratio_level=ratio_level, clip_high=0.28 if ratio_level == "token" else 0.05)
    ref.backward()
    torch.testing.assert_close(out.loss, ref.detach())
    torch.testing.assert_close(lp.grad, torch.where(kept, lp_ref.grad, 0.0))
    assert torch.equal(out.mask, kept)
    assert out.metrics["loss/tokens"] == kept.sum()  # rejected tokens left the denominator
    assert "correction/kept_token_frac" in out.metrics


def test_precomputed_correction_equals_callable_and_weights_are_detached():
    d = _batch()
    w, reject = _weights(d["mask"].shape)
    param = torch.ones((), requires_grad=True)
    fn = fixed_correction(w * param, reject)  # weights that would carry a gradient
    corr = fn(measure(old_logp=d["old_logp"], rollout_logp=d["rollout_logp"], mask=d["mask"]))
    assert corr.token_weights.requires_grad and not corr.weights.requires_grad
    lp = d["logp"].clone().requires_grad_(True)
    a = grpo(lp, d["old_logp"], d["advantages"], d["mask"], rollout_logp=d["rollout_logp"], correction=fn)
    a.loss.backward()
    assert param.grad is None  # detached inside the loss
    b = grpo(d["logp"], d["old_logp"], d["advantages"], d["mask"], rollout_logp=d["rollout_logp"],
                    correction=corr)
    torch.testing.assert_close(a.loss, b.loss)


def test_sequence_rejected_whole_gets_no_gradient_and_no_advantage():
    from sparsecorr.losses import group_advantages

    d = _batch(b=4, t=6, seed=2)
    reject = torch.zeros_like(d["mask"])
    reject[1] = True  # sequence 1 vetoed
    corr = fixed_correction(torch.ones(d["mask"].shape), reject)(
        measure(old_logp=d["old_logp"], rollout_logp=d["rollout_logp"], mask=d["mask"]))
    adv = group_advantages(torch.tensor([1.0, 5.0, 0.0, 0.5]), group_size=4, valid=corr.sequence_mask)
    assert adv[1] == 0
    lp = d["logp"].clone().requires_grad_(True)
    out = grpo(lp, d["old_logp"], adv, d["mask"], rollout_logp=d["rollout_logp"], correction=corr,
                      aggregation="seq-mean-token-mean")
    out.loss.backward()
    assert (lp.grad[1] == 0).all()
    assert out.metrics["loss/sequences"] == (d["mask"].any(1) & corr.sequence_mask).sum()


def test_nonfinite_rollout_with_correction_is_counted_and_dropped():
    d = _batch()
    rollout = d["rollout_logp"].clone()
    rollout[0, 0] = float("nan")
    w, _ = _weights(d["mask"].shape)
    seen = {}

    def correct(inputs):
        seen["mask"] = inputs.mask
        return Correction(mask=inputs.mask.clone(), token_weights=w)  # forgets to drop NaN

    lp = d["logp"].clone().requires_grad_(True)
    out = grpo(lp, d["old_logp"], d["advantages"], d["mask"], rollout_logp=rollout, correction=correct)
    out.loss.backward()
    assert torch.equal(seen["mask"], d["mask"])  # the correction sees the caller's mask
    assert not out.mask[0, 0] and out.metrics["loss/nonfinite_rollout"] == 1
    assert torch.isfinite(out.loss) and lp.grad[0, 0] == 0


def test_bad_correction_results():
    d = _batch()
    args = (d["logp"], d["old_logp"], d["advantages"], d["mask"])
    with pytest.raises(ValueError, match="correction"):
        grpo(*args, rollout_logp=d["rollout_logp"], correction=lambda inputs: inputs.mask)
    with pytest.raises(ValueError, match="correction"):
        grpo(*args, rollout_logp=d["rollout_logp"], correction=3.0)
    bad = Correction(mask=torch.ones(2, 2, dtype=torch.bool), token_weights=torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"correction\.mask"):
        grpo(*args, rollout_logp=d["rollout_logp"], correction=bad)
    with pytest.raises(ValueError, match="token_weights"):
        Correction(mask=torch.ones(2, 2, dtype=torch.bool), token_weights=torch.ones(2, 3))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_sharding_invariance_with_correction(aggregation):
    d = _batch(b=8, t=9, seed=4)
    w, reject = _weights(d["mask"].shape)
    fn = fixed_correction(w, reject)
    whole = grpo(d["logp"], d["old_logp"], d["advantages"], d["mask"], rollout_logp=d["rollout_logp"],
                        correction=fn, aggregation=aggregation)
    kept = whole.mask
    total = 0.0
    for rows in (slice(0, 5), slice(5, 8)):
        shard_fn = fixed_correction(w[rows], reject[rows])
        part = grpo(d["logp"][rows], d["old_logp"][rows], d["advantages"][rows], d["mask"][rows],
                           rollout_logp=d["rollout_logp"][rows], correction=shard_fn, aggregation=aggregation,
                           num_tokens=kept.sum(), num_sequences=kept.any(1).sum())
        total = total + part.loss
    torch.testing.assert_close(total, whole.loss)


def test_advantages_reach_the_correction_in_any_accepted_shape():
    from sparsecorr.correction import opsm

    d = _batch(b=6, t=8, seed=7)
    adv = d["advantages"]
    outs = [grpo(d["logp"], d["old_logp"], a, d["mask"], rollout_logp=d["rollout_logp"],
                        correction=opsm(delta=0.05))
            for a in (adv, adv[:, None], adv[:, None].expand(d["mask"].shape).contiguous())]
    for out in outs[1:]:
        torch.testing.assert_close(out.loss, outs[0].loss)
        assert torch.equal(out.mask, outs[0].mask)
    assert not torch.equal(outs[0].mask, d["mask"])  # OPSM did drop something here
