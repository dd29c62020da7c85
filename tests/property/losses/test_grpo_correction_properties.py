"""Hypothesis properties of sparse_grpo with the public correction presets."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsecorr.correction import icepop, mis, sparrow, sparse_rl, tis
from sparsecorr.losses import AGGREGATIONS
from tests.strategies import logp_batches
from tests.unit.losses.helpers import grpo

PRESETS = {"sparse_rl": sparse_rl, "tis": tis, "sparrow": sparrow, "icepop": icepop, "mis": mis}
PRESET = st.sampled_from(sorted(PRESETS))
AGG = st.sampled_from(AGGREGATIONS)


def _adv(batch):
    return torch.randn(batch.mask.shape[0], generator=torch.Generator().manual_seed(1))


def _loss(batch, preset, aggregation, *, logp=None, **kw):
    lp = (batch.logp if logp is None else logp).clone().requires_grad_(True)
    out = grpo(lp, batch.old_logp, _adv(batch), batch.mask, rollout_logp=batch.rollout_logp,
                      correction=PRESETS[preset](), aggregation=aggregation, **kw)
    out.loss.backward()
    return out, lp.grad


@given(logp_batches(nonfinite=True), PRESET, AGG)
def test_nan_rollout_never_reaches_loss_with_any_preset(batch, preset, aggregation):
    out, grad = _loss(batch, preset, aggregation)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and torch.isfinite(out.token_loss).all()
    bad = batch.mask & ~torch.isfinite(batch.rollout_logp)
    assert not (out.mask & bad).any() and (grad[bad] == 0).all()
    assert all(torch.isfinite(v) | torch.isnan(v) for v in out.metrics.values())


@given(logp_batches(zero_mismatch=True), PRESET, AGG)
def test_zero_mismatch_correction_is_identity(batch, preset, aggregation):
    out, grad = _loss(batch, preset, aggregation)
    lp = batch.logp.clone().requires_grad_(True)
    plain = grpo(lp, batch.old_logp, _adv(batch), batch.mask, aggregation=aggregation)
    plain.loss.backward()
    torch.testing.assert_close(out.loss, plain.loss)
    torch.testing.assert_close(grad, lp.grad)
    assert torch.equal(out.mask, batch.mask)


@given(logp_batches(dtypes=(torch.float32,), extreme=False, scale=0.1), PRESET, AGG)
def test_bf16_matches_fp32_with_correction(batch, preset, aggregation):
    b16 = type(batch)(old_logp=batch.old_logp.bfloat16(), rollout_logp=batch.rollout_logp.bfloat16(),
                      logp=batch.logp.bfloat16(), mask=batch.mask, seed=batch.seed)
    b32 = type(batch)(old_logp=b16.old_logp.float(), rollout_logp=b16.rollout_logp.float(),
                      logp=b16.logp.float(), mask=batch.mask, seed=batch.seed)
    o16, g16 = _loss(b16, preset, aggregation)
    o32, g32 = _loss(b32, preset, aggregation)
    assert o16.loss.dtype == torch.float32 and g16.dtype == torch.bfloat16
    torch.testing.assert_close(o16.loss, o32.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g16.float(), g32, atol=1e-2, rtol=1e-2)
