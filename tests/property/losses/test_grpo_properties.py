"""Hypothesis properties of sparse_grpo and the distillation losses."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsecorr.losses import AGGREGATIONS, kl_from_logits, sparse_kl_k3
from tests.strategies import logp_batches
from tests.unit.losses.helpers import grpo

AGG = st.sampled_from(AGGREGATIONS)
LEVEL = st.sampled_from(["token", "sequence"])


def _adv(batch, seed=0):
    return torch.randn(batch.mask.shape[0], generator=torch.Generator().manual_seed(seed))


def _run(batch, adv, **kw):
    lp = batch.logp.clone().requires_grad_(True)
    out = grpo(lp, batch.old_logp, adv, batch.mask, **kw)
    out.loss.backward()
    return out, lp.grad


@given(logp_batches(nonfinite=True), AGG, LEVEL)
def test_nonfinite_rollout_never_reaches_loss(batch, aggregation, ratio_level):
    out, grad = _run(batch, _adv(batch), rollout_logp=batch.rollout_logp, aggregation=aggregation,
                     ratio_level=ratio_level)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert torch.isfinite(out.token_loss).all()
    bad = batch.mask & ~torch.isfinite(batch.rollout_logp)
    assert out.metrics["loss/nonfinite_rollout"] == bad.sum()
    assert not (out.mask & bad).any() and (grad[bad] == 0).all()


@given(logp_batches(zero_mismatch=True), AGG, LEVEL)
def test_zero_mismatch_rollout_is_identity(batch, aggregation, ratio_level):
    adv = _adv(batch)
    with_rollout, g1 = _run(batch, adv, rollout_logp=batch.rollout_logp, aggregation=aggregation,
                            ratio_level=ratio_level)
    plain, g2 = _run(batch, adv, aggregation=aggregation, ratio_level=ratio_level)
    torch.testing.assert_close(with_rollout.loss, plain.loss)
    torch.testing.assert_close(g1, g2)
    assert with_rollout.metrics["mismatch/kl_k3_mean"] == 0


@given(logp_batches(), AGG, LEVEL, st.integers(1, 5))
def test_padding_invariance(batch, aggregation, ratio_level, extra):
    """Extra padded columns (holding garbage) change neither the loss nor the gradient."""
    adv = _adv(batch)
    if aggregation == "seq-mean-token-sum-norm":
        kw = dict(norm_length=float(batch.mask.shape[1]))  # L fixed, not the padded width
    else:
        kw = {}
    base, g = _run(batch, adv, aggregation=aggregation, ratio_level=ratio_level, **kw)
    b = batch.mask.shape[0]
    junk = torch.full((b, extra), float("nan"), dtype=batch.logp.dtype)

    def pad(x):
        return torch.cat([x, junk], dim=1)

    lp = pad(batch.logp).clone().requires_grad_(True)
    mask = torch.cat([batch.mask, torch.zeros(b, extra, dtype=torch.bool)], dim=1)
    out = grpo(lp, pad(batch.old_logp), adv, mask, aggregation=aggregation, ratio_level=ratio_level,
                      rollout_logp=pad(batch.rollout_logp), **kw)
    out.loss.backward()
    ref = grpo(batch.logp, batch.old_logp, adv, batch.mask, aggregation=aggregation,
                      ratio_level=ratio_level, rollout_logp=batch.rollout_logp, **kw)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.loss, base.loss)
    torch.testing.assert_close(lp.grad[:, :-extra], g)
    assert (lp.grad[:, -extra:] == 0).all()


@given(logp_batches(dtypes=(torch.float32,), extreme=False, scale=0.1), AGG, LEVEL)
def test_bf16_matches_fp32(batch, aggregation, ratio_level):
    adv = _adv(batch)
    lp32 = batch.logp.bfloat16().float().requires_grad_(True)
    old32 = batch.old_logp.bfloat16().float()
    out32 = grpo(lp32, old32, adv, batch.mask, aggregation=aggregation, ratio_level=ratio_level)
    out32.loss.backward()
    lp16 = batch.logp.bfloat16().requires_grad_(True)
    out16 = grpo(lp16, batch.old_logp.bfloat16(), adv, batch.mask, aggregation=aggregation,
                        ratio_level=ratio_level)
    out16.loss.backward()
    assert out16.loss.dtype == torch.float32 and lp16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out16.loss, out32.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp16.grad.float(), lp32.grad, atol=1e-2, rtol=1e-2)


@given(logp_batches(), st.integers(0, 2**16))
def test_row_permutation_equivariance(batch, seed):
    perm = torch.randperm(batch.mask.shape[0], generator=torch.Generator().manual_seed(seed))
    adv = _adv(batch)
    out, g = _run(batch, adv, aggregation="seq-mean-token-mean")
    lp = batch.logp[perm].clone().requires_grad_(True)
    outp = grpo(lp, batch.old_logp[perm], adv[perm], batch.mask[perm], aggregation="seq-mean-token-mean")
    outp.loss.backward()
    torch.testing.assert_close(outp.loss, out.loss)
    torch.testing.assert_close(lp.grad, g[perm])


@given(logp_batches(nonfinite=True))
def test_sparse_k3_nonnegative_and_finite(batch):
    k3 = sparse_kl_k3(batch.rollout_logp, batch.old_logp, batch.mask)
    assert torch.isfinite(k3).all() and (k3 >= 0).all()
    assert (k3[~batch.mask] == 0).all()


@given(st.integers(1, 3), st.integers(1, 6), st.integers(2, 9), st.integers(0, 2**16),
       st.sampled_from(["forward", "reverse"]), st.sampled_from([0.5, 1.0, 3.0]))
def test_kl_from_logits_nonnegative(b, t, v, seed, direction, tau):
    g = torch.Generator().manual_seed(seed)
    s, te = torch.randn(b, t, v, generator=g) * 5, torch.randn(b, t, v, generator=g) * 5
    mask = torch.rand(b, t, generator=g) > 0.3
    kl = kl_from_logits(s, te, mask, direction=direction, temperature=tau, chunk_size=2)
    assert (kl >= -1e-5).all() and torch.isfinite(kl).all()
