import itertools

import pytest
import torch

from sparsecorr.losses import AGGREGATIONS, sparse_grpo
from tests.unit.losses.helpers import grpo
from tests.unit.losses.reference import loop_grpo_loss


def _batch(b=5, t=7, seed=0, spread=0.5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 4
    logp = old + torch.randn(b, t, generator=g) * spread
    rollout = old - torch.randn(b, t, generator=g) * 0.2
    ref = old + torch.randn(b, t, generator=g) * 0.3
    mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]
    mask[-1] = False  # an empty row
    adv = torch.randn(b, generator=g)
    pad = ~mask  # garbage in padding must not matter
    old, logp = torch.where(pad, 1e4, old), torch.where(pad, float("nan"), logp)
    return dict(logp=logp.to(dtype), old_logp=old.to(dtype), advantages=adv, mask=mask,
                rollout_logp=rollout.to(dtype), ref_logp=ref.to(dtype))


CASES = list(itertools.product(AGGREGATIONS, ["token", "sequence"], [None, 2.0]))


@pytest.mark.parametrize("aggregation, ratio_level, dual_clip", CASES)
def test_value_and_gradient_match_loop_reference(aggregation, ratio_level, dual_clip):
    d = _batch()
    clip_high = 0.28 if ratio_level == "token" else 0.05
    lp = d["logp"].clone().requires_grad_(True)
    out = grpo(lp, d["old_logp"], d["advantages"], d["mask"], clip_high=clip_high,
                      dual_clip=dual_clip, ratio_level=ratio_level, aggregation=aggregation,
                      ref_logp=d["ref_logp"], kl_coef=0.1)
    out.loss.backward()
    lp_ref = d["logp"].clone().requires_grad_(True)
    ref = loop_grpo_loss(lp_ref, d["old_logp"], d["advantages"], d["mask"], clip_high=clip_high,
                         dual_clip=dual_clip, ratio_level=ratio_level, aggregation=aggregation,
                         ref_logp=d["ref_logp"], kl_coef=0.1)
    ref.backward()
    torch.testing.assert_close(out.loss, ref.detach().float())
    grad_ref = torch.where(d["mask"], lp_ref.grad, 0.0)
    torch.testing.assert_close(lp.grad, grad_ref)
    assert torch.isfinite(lp.grad).all()


def test_plain_grpo_hand_computed():
    # one sequence, two tokens, A = 1: ratios e^{0.5} (clipped at 1.2) and e^{-0.1}
    logp = torch.tensor([[0.5, -0.1]], requires_grad=True)
    out = grpo(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    expected = -(1.2 + torch.exp(torch.tensor(-0.1))) / 2
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -torch.exp(torch.tensor(-0.1)) / 2]]))
    assert out.metrics["loss/clip_frac_high"] == 0.5 and out.metrics["loss/clip_frac_low"] == 0


def test_per_token_advantages_equal_broadcast():
    d = _batch()
    a = grpo(d["logp"], d["old_logp"], d["advantages"], d["mask"]).loss
    adv_bt = d["advantages"][:, None].expand(d["mask"].shape).clone()
    adv_bt[~d["mask"]] = float("nan")
    b = grpo(d["logp"], d["old_logp"], adv_bt, d["mask"]).loss
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_sharding_invariance(aggregation):
    d = _batch(b=8, t=9, seed=3)
    lp = d["logp"].clone().requires_grad_(True)
    whole = grpo(lp, d["old_logp"], d["advantages"], d["mask"], aggregation=aggregation,
                        rollout_logp=d["rollout_logp"])
    whole.loss.backward()
    n_tok, n_seq = d["mask"].sum(), d["mask"].any(1).sum()
    total = 0.0
    lp2 = d["logp"].clone().requires_grad_(True)
    for rows in (slice(0, 3), slice(3, 8)):
        part = grpo(lp2[rows], d["old_logp"][rows], d["advantages"][rows], d["mask"][rows],
                           aggregation=aggregation, num_tokens=n_tok, num_sequences=n_seq,
                           rollout_logp=d["rollout_logp"][rows])
        part.loss.backward()
        total = total + part.loss.detach()
    torch.testing.assert_close(total, whole.loss.detach())
    torch.testing.assert_close(torch.nan_to_num(lp2.grad), torch.nan_to_num(lp.grad))


def test_rollout_without_correction_measures_only_and_masks_nonfinite():
    d = _batch()
    rollout = d["rollout_logp"].clone()
    rollout[0, 0] = float("nan")
    rollout[1, 0] = float("inf")
    lp = d["logp"].clone().requires_grad_(True)
    out = grpo(lp, d["old_logp"], d["advantages"], d["mask"], rollout_logp=rollout)
    keep = d["mask"].clone()
    keep[0, 0] = keep[1, 0] = False
    plain = grpo(d["logp"], d["old_logp"], d["advantages"], keep)
    torch.testing.assert_close(out.loss, plain.loss)  # no reweighting
    assert out.metrics["loss/nonfinite_rollout"] == 2
    assert "mismatch/kl_k3_mean" in out.metrics and torch.isfinite(out.loss)
    out.loss.backward()
    assert lp.grad[0, 0] == 0 and torch.isfinite(lp.grad).all()
    assert torch.equal(out.mask, keep)


def test_correction_without_rollout_is_an_error():
    d = _batch()
    with pytest.raises(ValueError, match="rollout_logp"):
        grpo(d["logp"], d["old_logp"], d["advantages"], d["mask"], correction=lambda x: x)


def test_metrics_are_detached_scalars_with_stable_names():
    d = _batch()
    lp = d["logp"].clone().requires_grad_(True)
    out = grpo(lp, d["old_logp"], d["advantages"], d["mask"], dual_clip=3.0,
               ref_logp=d["ref_logp"], rollout_logp=d["rollout_logp"], metrics="full")
    for name in ["loss/clip_frac_low", "loss/clip_frac_high", "loss/clip_frac_dual", "loss/ratio_mean",
                 "loss/ratio_min", "loss/ratio_max", "loss/kl_ref_k3_mean", "loss/ppo_kl_k1_mean",
                 "loss/tokens", "loss/sequences", "loss/pg_loss", "mismatch/kl_k3_mean"]:
        m = out.metrics[name]
        assert m.shape == () and m.dtype == torch.float32 and not m.requires_grad, name
    assert out.metrics["loss/tokens"] == d["mask"].sum()
    assert out.metrics["loss/sequences"] == d["mask"].any(1).sum()


def test_clip_fractions_hand_worked():
    logp = torch.log(torch.tensor([[0.5, 1.5, 5.0, 1.0]]))
    adv = torch.tensor([[-1.0, 1.0, -1.0, 1.0]])
    out = grpo(logp, torch.zeros(1, 4), adv, torch.ones(1, 4, dtype=torch.bool), dual_clip=3.0)
    assert out.metrics["loss/clip_frac_low"] == 0.25  # token 0: A<0, ratio 0.5 < 0.8
    assert out.metrics["loss/clip_frac_high"] == 0.25  # token 1: A>0, ratio 1.5 > 1.2
    assert out.metrics["loss/clip_frac_dual"] == 0.25  # token 2: A<0, ratio 5 > 3
    # token 2 is bounded by the dual clip: -max(-5, -3) = 3
    torch.testing.assert_close(out.token_loss[0, 2], torch.tensor(3.0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_low=1.5), "clip_low"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(surrogate="seq"), "surrogate"),
        (dict(metrics="some"), "metrics"),
        (dict(aggregation="mean"), "aggregation"),
        (dict(kl_coef=0.1), "ref_logp"),
        (dict(advantages=torch.zeros(3)), "advantages"),
        (dict(mask=torch.ones(2, 3)), "mask"),
        (dict(old_logp=torch.zeros(2, 4)), "old_logp"),
    ],
)
def test_errors(kwargs, match):
    args = dict(logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 3), advantages=torch.zeros(2),
                mask=torch.ones(2, 3, dtype=torch.bool))
    hp = {k: kwargs.pop(k) for k in list(kwargs) if k not in args}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        if "surrogate" in hp or "metrics" in hp:
            sparse_grpo(**args, **hp)
        else:
            grpo(**args, **hp)


def test_log_ratio_clamp_edge_has_no_gradient_and_finite_loss():
    # log-ratios beyond ±20: the ratio is pinned at e^{±20}, the clipped branch gets no gradient
    logp = torch.tensor([[30.0, -30.0, 30.0, -30.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0]])
    out = grpo(logp, torch.zeros(1, 4), adv, torch.ones(1, 4, dtype=torch.bool))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.equal(logp.grad, torch.zeros(1, 4))
    lp_ref = logp.detach().clone().requires_grad_(True)
    ref = loop_grpo_loss(lp_ref.clamp(-20, 20), torch.zeros(1, 4), adv, torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-5, atol=0)


def test_validate_false_gives_same_result():
    d = _batch()
    a = grpo(d["logp"], d["old_logp"], d["advantages"], d["mask"])
    b = grpo(d["logp"], d["old_logp"], d["advantages"], d["mask"], validate=False)
    torch.testing.assert_close(a.loss, b.loss)


def test_token_loss_backward_matches_loss_backward():
    d = _batch()
    lp1 = d["logp"].clone().requires_grad_(True)
    out = grpo(lp1, d["old_logp"], d["advantages"], d["mask"])
    out.loss.backward()
    lp2 = d["logp"].clone().requires_grad_(True)
    out2 = grpo(lp2, d["old_logp"], d["advantages"], d["mask"])
    (out2.token_loss.sum() / d["mask"].sum()).backward()  # token-mean by hand from token_loss
    torch.testing.assert_close(lp2.grad, lp1.grad)


def test_mismatch_metrics_can_be_turned_off():
    d = _batch()
    on = grpo(d["logp"], d["old_logp"], d["advantages"], d["mask"], rollout_logp=d["rollout_logp"],
                     metrics="full")
    off = grpo(d["logp"], d["old_logp"], d["advantages"], d["mask"], rollout_logp=d["rollout_logp"],
                      metrics="none")
    assert "mismatch/log_ratio_q05" in on.metrics
    assert not any(k.startswith("mismatch/") for k in off.metrics)
    torch.testing.assert_close(on.loss, off.loss)
