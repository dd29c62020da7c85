"""The loss path at its edges (issue #14): non-finite inputs are masked and counted, empty
batches give a zero loss with a zero gradient, bad hyperparameters are refused by name, and the
metrics stay exact where float32 cancellation used to bite."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecorr.correction import PRESETS as REGISTRY
from sparsecorr.losses import (
    CISPO,
    GSPO,
    SAPO,
    Aggregation,
    KLPenalty,
    PPOClip,
    distill_sparse_loss,
    group_advantages,
    sparse_grpo,
)
from sparsecorr.mismatch import measure, mismatch_metrics
from tests.property.correction.presets_table import PRESETS as ROWS
from tests.strategies import logp_batches

NAN, INF = float("nan"), float("inf")
SURROGATES = [PPOClip(), PPOClip(clip_high=0.28, dual_clip=3.0), GSPO(), CISPO(cap=2.0), SAPO()]
SUR_IDS = ["ppo", "ppo_dual", "gspo", "cispo", "sapo"]


def _context(row, b, t, g):
    acc = torch.rand(b, t, generator=g) if row.needs_acceptance else None
    adv = torch.randn(b, generator=g) if row.needs_advantages else None
    return acc, adv


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)], ids=["B0", "T0", "B0T0"])
@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_every_correction_accepts_an_empty_batch(row, shape):
    b, t = shape
    g = torch.Generator().manual_seed(0)
    acc, adv = _context(row, b, t, g)
    mm = measure(torch.zeros(b, t), torch.zeros(b, t), torch.ones(b, t, dtype=torch.bool),
                 acceptance=acc, advantages=adv)
    c = row.loose()(mm)
    assert c.mask.shape == (b, t) and c.weights.shape == (b, t)
    assert not any(v.isnan() for k, v in c.metrics.items() if not k.endswith(("weight_min", "weight_max")))
    assert float(c.metrics["correction/kept_token_frac"]) == 0.0


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)], ids=["B0", "T0"])
@pytest.mark.parametrize("surrogate", SURROGATES, ids=SUR_IDS)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_empty_batch_gives_zero_loss_and_zero_gradient(shape, surrogate, aggregation):
    b, t = shape
    logp = torch.zeros(b, t, requires_grad=True)
    out = sparse_grpo(logp, torch.zeros(b, t), torch.zeros(b), torch.ones(b, t, dtype=torch.bool),
                      rollout_logp=torch.zeros(b, t), correction=REGISTRY["sparse_rl"](),
                      surrogate=surrogate, aggregation=aggregation, ref_logp=torch.zeros(b, t),
                      kl=0.1, metrics="full")
    out.loss.backward()
    assert float(out.loss) == 0.0 and logp.grad.shape == (b, t)
    assert out.metrics["loss/tokens"] == 0
    for name, value in out.metrics.items():
        if name.endswith(("ratio_min", "ratio_max", "weight_min", "weight_max")) or "_q" in name:
            continue  # extremes and quantiles of nothing are NaN by definition
        assert torch.isfinite(value), name


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
def test_mismatch_metrics_and_distill_on_empty_batches(shape):
    b, t = shape
    z, m = torch.zeros(b, t), torch.ones(b, t, dtype=torch.bool)
    metrics = mismatch_metrics(z, z, m, acceptance=z)
    assert metrics["mismatch/tokens"] == 0 and metrics["mismatch/kl_k3_mean"] == 0
    assert metrics["mismatch/log_ratio_abs_max"] == 0
    sp = torch.zeros(b, t, requires_grad=True)
    out = distill_sparse_loss(sp, z, z, torch.zeros(b), m)
    out.loss.backward()
    assert float(out.loss) == 0.0 and torch.equal(sp.grad, torch.zeros(b, t))
    assert group_advantages(torch.zeros(0), group_size=4).shape == (0,)


def _finite_batch(b=6, t=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(b, t, generator=g) * 3
    old = roll + 0.2 * torch.randn(b, t, generator=g)
    logp = old + 0.1 * torch.randn(b, t, generator=g)
    ref = old + 0.1 * torch.randn(b, t, generator=g)
    mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    return logp, old, roll, ref, torch.randn(b, generator=g), mask


@pytest.mark.parametrize("which", ["logp", "old_logp", "ref_logp"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_learner_dense_or_reference_token_is_dropped_and_counted(which, bad):
    logp, old, _, ref, adv, mask = _finite_batch()
    mask[0, 0] = True
    tensors = dict(logp=logp, old_logp=old, ref_logp=ref)
    tensors[which] = tensors[which].clone()
    tensors[which][0, 0] = bad
    lp = tensors["logp"].clone().requires_grad_()
    out = sparse_grpo(lp, tensors["old_logp"], adv, mask, ref_logp=tensors["ref_logp"], kl=0.05)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert not out.mask[0, 0] and lp.grad[0, 0] == 0
    assert out.metrics["loss/nonfinite_tokens"] == 1
    clean = mask.clone()
    clean[0, 0] = False
    want = sparse_grpo(logp, old, adv, clean, ref_logp=ref, kl=0.05)
    torch.testing.assert_close(out.loss, want.loss)


def test_nonfinite_advantage_drops_the_row_and_is_counted():
    logp, old, _, _, adv, mask = _finite_batch()
    adv = adv.clone()
    adv[2] = NAN
    lp = logp.clone().requires_grad_()
    out = sparse_grpo(lp, old, adv, mask, aggregation="seq-mean-token-mean")
    out.loss.backward()
    assert torch.isfinite(out.loss) and (lp.grad[2] == 0).all()
    assert out.metrics["loss/nonfinite_advantage_seqs"] == 1
    keep = mask.clone()
    keep[2] = False
    torch.testing.assert_close(out.loss, sparse_grpo(logp, old, adv.nan_to_num(), keep,
                                                     aggregation="seq-mean-token-mean").loss)


def test_one_nan_reward_leaves_its_group_and_the_loss_not_the_whole_group():
    rewards = torch.tensor([1.0, NAN, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4)
    assert adv[1].isnan() and torch.isfinite(adv[[0, 2, 3]]).all()
    want = group_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=3)
    torch.testing.assert_close(adv[[0, 2, 3]], want)
    torch.testing.assert_close(adv[4:], group_advantages(rewards[4:], group_size=4))
    logp, old, _, _, _, mask = _finite_batch(b=8)
    out = sparse_grpo(logp, old, adv, mask)
    assert torch.isfinite(out.loss) and out.metrics["loss/nonfinite_advantage_seqs"] == 1


@pytest.mark.parametrize("make, match", [
    (lambda: dict(aggregation=Aggregation("token-mean", num_tokens=NAN)), "num_tokens"),
    (lambda: dict(aggregation=Aggregation("token-mean", num_tokens=INF)), "num_tokens"),
    (lambda: dict(aggregation=Aggregation("seq-mean-token-mean", num_sequences=-1)), "num_sequences"),
    (lambda: dict(aggregation=Aggregation("seq-mean-token-sum-norm", norm_length=NAN)), "norm_length"),
    (lambda: dict(aggregation=Aggregation("seq-mean-token-sum-norm", norm_length=0)), "norm_length"),
    (lambda: dict(kl=NAN), "kl"),
    (lambda: dict(kl=-1.0), "kl"),
    (lambda: dict(surrogate=PPOClip(clip_high=NAN)), "clip_high"),
    (lambda: dict(surrogate=PPOClip(dual_clip=0.5)), "dual_clip"),
    (lambda: dict(surrogate=CISPO(cap=0.0)), "cap"),
], ids=["nan_tokens", "inf_tokens", "neg_seqs", "nan_length", "zero_length", "nan_kl", "neg_kl",
        "nan_clip", "dual_below_1", "cispo_cap"])
def test_normalisers_and_coefficients_that_would_poison_the_loss_are_refused(make, match):
    logp, old, _, ref, adv, mask = _finite_batch()
    with pytest.raises(ValueError, match=match):
        sparse_grpo(logp, old, adv, mask, ref_logp=ref, **make())


def test_a_nonfinite_tensor_normaliser_falls_back_to_the_local_count_and_says_so():
    logp, old, _, _, adv, mask = _finite_batch()
    out = sparse_grpo(logp, old, adv, mask, aggregation=Aggregation("token-mean", num_tokens=torch.tensor(NAN)))
    want = sparse_grpo(logp, old, adv, mask)
    torch.testing.assert_close(out.loss, want.loss)
    assert out.metrics["loss/normalizer_fallback"] == 1


def test_ratio_mean_is_exact_for_a_few_kept_tokens_in_a_large_batch():
    # 5 kept tokens in a 1000 x 10000 batch: float32 "sum of all ratios minus the padding" gave
    # 1.40 for a true 1.4918 (issue #14)
    b, t = 1000, 10000
    old = torch.zeros(b, t)
    logp = torch.zeros(b, t)
    mask = torch.zeros(b, t, dtype=torch.bool)
    vals = torch.log(torch.tensor([1.1, 1.3, 1.5, 1.7, 1.859]))
    mask[0, :5] = True
    logp[0, :5] = vals
    out = sparse_grpo(logp, old, torch.ones(b), mask, surrogate=PPOClip(clip_high=10.0), metrics="full")
    true = vals.exp().mean()
    assert abs(float(out.metrics["loss/ratio_mean"]) - float(true)) < 1e-6
    assert abs(float(out.metrics["loss/ratio_min"]) - 1.1) < 1e-6
    assert abs(float(out.metrics["loss/ratio_max"]) - 1.859) < 1e-6


def _mixed(batch, draw_mask):
    """Sprinkle NaN/±inf into every tensor of a batch at drawn positions."""
    out = {}
    g = torch.Generator().manual_seed(batch.seed + 7)
    b, t = batch.mask.shape
    vals = torch.tensor([NAN, INF, -INF])
    for name, x in (("logp", batch.logp), ("old_logp", batch.old_logp),
                    ("rollout_logp", batch.rollout_logp), ("ref_logp", batch.old_logp + 0.1)):
        x = x.float().clone()
        if draw_mask[name]:
            where = torch.rand(b, t, generator=g) < 0.2
            x[where] = vals[torch.randint(0, 3, (int(where.sum()),), generator=g)]
        out[name] = x
    adv = torch.randn(b, generator=g)
    if draw_mask["advantages"]:
        adv[torch.rand(b, generator=g) < 0.3] = NAN
    out["advantages"] = adv
    return out


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
@given(batch=logp_batches(nonfinite=True, dtypes=(torch.float32,)),
       flags=st.fixed_dictionaries({k: st.booleans() for k in
                                    ("logp", "old_logp", "rollout_logp", "ref_logp", "advantages")}),
       surrogate=st.sampled_from(SURROGATES))
@settings(max_examples=12)
def test_loss_and_gradient_are_finite_for_any_mix_of_nonfinite_inputs(row, batch, flags, surrogate):
    x = _mixed(batch, flags)
    b, t = batch.mask.shape
    g = torch.Generator().manual_seed(batch.seed)
    acc, _ = _context(row, b, t, g)
    mm = measure(x["old_logp"], x["rollout_logp"], batch.mask, acceptance=acc)
    lp = x["logp"].clone().requires_grad_()
    out = sparse_grpo(lp, x["old_logp"], x["advantages"], batch.mask, mismatch=mm,
                      correction=row.loose(), surrogate=surrogate, ref_logp=x["ref_logp"],
                      kl=KLPenalty(0.01, bias_correction=True))
    out.loss.backward()
    assert torch.isfinite(out.loss), out.metrics
    assert torch.isfinite(lp.grad).all()
    assert not (out.mask & ~torch.isfinite(lp.detach())).any()
    assert math.isfinite(float(out.metrics["loss/tokens"]))
