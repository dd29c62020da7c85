"""Hand-worked values for the correction functions and presets."""

import math

import pytest
import torch

from sparsecorr.correction import (
    band_mask,
    batch_normalize,
    chain,
    divergence_mask,
    get_preset,
    icepop,
    mis,
    openrlhf,
    opsm_mask,
    sequence_is_weights,
    sparse_rl,
    sparse_tail,
    tail_mask,
    tis,
    token_is_weights,
    trl,
    veto,
    veto_mask,
)
from sparsecorr.mismatch import measure

LN = math.log
# ratios r = [1, 4, 0.25, 1e-5]: log-ratios
LR = torch.tensor([[0.0, LN(4.0), LN(0.25), LN(1e-5)], [LN(1.2), LN(0.8), 0.0, 0.0]])
MASK = torch.tensor([[True, True, True, True], [True, True, True, False]])


def _inputs(lr=LR, mask=MASK, **kw):
    rollout = -torch.ones_like(lr) * 3
    return measure(old_logp=rollout + lr, rollout_logp=rollout, mask=mask, **kw)


def test_token_is_weights_truncates_and_masks():
    w = token_is_weights(LR, MASK, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.25, 1e-5], [1.2, 0.8, 1.0, 0.0]]))
    torch.testing.assert_close(token_is_weights(LR, MASK, cap=None)[0, 1], torch.tensor(4.0))
    with pytest.raises(ValueError, match="cap"):
        token_is_weights(LR, MASK, cap=0.0)


def test_sequence_weights_product_and_geometric():
    w_sum = sequence_is_weights(LR, MASK, reduce="sum")
    torch.testing.assert_close(w_sum[0, 0], torch.tensor(1e-5), rtol=1e-4, atol=0)
    torch.testing.assert_close(w_sum[1, :3], torch.full((3,), 0.96))
    geo = sequence_is_weights(LR, MASK, reduce="mean")
    torch.testing.assert_close(geo[0, 0], torch.tensor((1e-5) ** 0.25), rtol=1e-4, atol=0)
    assert w_sum[1, 3] == 0


def test_band_mask_levels():
    tok = band_mask(LR, MASK, low=0.5, high=2.0)
    assert tok.tolist() == [[True, False, False, False], [True, True, True, False]]
    seq = band_mask(LR, MASK, low=0.5, high=2.0, level="sequence")
    assert seq.tolist() == [[False] * 4, [True, True, True, False]]
    geo = band_mask(LR, MASK, low=0.01, high=2.0, level="geometric")
    assert geo[0].all() and geo[1, :3].all()


def test_veto_divergence_tail_opsm():
    assert veto_mask(LR, MASK, threshold=1e-4).tolist() == [[False] * 4, [True, True, True, False]]
    rollout = torch.zeros_like(LR)
    div = divergence_mask(LR, rollout, MASK, estimator="k2", reduce="max", threshold=0.1)
    assert div.tolist() == [[False] * 4, [True, True, True, False]]
    acc = torch.tensor([[0.99, 0.99, 0.99, 0.2], [0.95, 0.95, 0.95, 0.0]])
    assert tail_mask(acc, MASK, q=0.05, tau=0.86).tolist() == [[False] * 4, [True, True, True, False]]
    adv = torch.tensor([-1.0, -1.0])
    # row 0 drifts: -mean(lr) = -(ln4 + ln0.25 + ln1e-5)/4 > 0 ; row 1: -(ln1.2+ln0.8)/3 ~ 0.014
    out = opsm_mask(LR, MASK, adv, delta=0.1)
    assert out.tolist() == [[False] * 4, [True, True, True, False]]
    assert opsm_mask(LR, MASK, -adv, delta=0.1).tolist() == MASK.tolist()


def test_batch_normalize_mean_one():
    w = batch_normalize(torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[True, True, False]]))
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 0.0]]))


def test_sparse_rl_hand_worked():
    c = sparse_rl()(_inputs())
    # row 0 vetoed (1e-5 < 1e-4); row 1: ratios 1.2, 0.8, 1.0 all in band, weights normalised to mean 1
    assert c.mask.tolist() == [[False] * 4, [True, True, True, False]]
    torch.testing.assert_close(c.weights[1, :3], torch.tensor([1.2, 0.8, 1.0]))
    assert float(c.metrics["correction/vetoed_seqs"]) == 1
    assert float(c.metrics["correction/weight_mean"]) == pytest.approx(1.0)
    assert c.sequence_mask.tolist() == [False, True]


def test_chain_multiplies_and_ands():
    c = chain(tis(cap=2.0), icepop(low=0.5, high=5.0))(_inputs())
    assert c.mask.tolist() == [[True, True, False, False], [True, True, True, False]]
    torch.testing.assert_close(c.weights[0, :2], torch.tensor([1.0, 2.0]))
    assert "correction/truncated_frac" in c.metrics and "correction/band_rejected_frac" in c.metrics


def test_mis_keeps_ratio_inside_band():
    c = mis(low=0.5, high=2.0)(_inputs())
    torch.testing.assert_close(c.weights[1, :3], torch.tensor([1.2, 0.8, 1.0]))
    assert not c.mask[0, 1]


def test_trl_modes_hand_worked():
    inp = _inputs()
    tm = trl("token_mask", clip_max=3.0)(inp)
    torch.testing.assert_close(tm.weights[0], torch.tensor([1.0, 0.0, 0.25, 1e-5]))
    assert tm.mask.tolist() == MASK.tolist()  # TRL keeps rejected tokens in the denominator
    tt = trl("token_truncate", clip_min=0.5, clip_max=3.0)(inp)
    torch.testing.assert_close(tt.weights[0], torch.tensor([1.0, 3.0, 0.5, 0.5]))
    sm = trl("sequence_mask")(inp)  # clip_min=None: TRL has no lower bound, product 1e-5 kept
    torch.testing.assert_close(sm.weights[0], torch.full((4,), 1e-5), rtol=1e-4, atol=0)
    assert (trl("sequence_mask", clip_max=0.5)(inp).weights[1] == 0).all()
    torch.testing.assert_close(sm.weights[1, :3], torch.full((3,), 0.96))


def test_openrlhf_modes_hand_worked():
    inp = _inputs()
    mask_mode = openrlhf("token", "mask", "ratio", (0.5, 5.0))(inp)
    torch.testing.assert_close(mask_mode.weights[0], torch.tensor([1.0, 4.0, 0.0, 0.0]))
    clip = openrlhf("token", "clip", "ratio", (0.5, 5.0))(inp)
    torch.testing.assert_close(clip.weights[0], torch.tensor([1.0, 4.0, 0.5, 0.5]))
    seq = openrlhf("seq", "mask", "ratio", (0.5, 5.0))(inp)
    assert (seq.weights[0] == 0).all()  # geometric mean (1e-5)^(1/4) ~ 0.056 < 0.5
    torch.testing.assert_close(seq.weights[1, :3], torch.tensor([1.2, 0.8, 1.0]))  # own ratios
    with pytest.raises(ValueError, match="clip"):
        openrlhf("seq", "clip")
    with pytest.raises(ValueError, match="upper bound"):
        openrlhf("token", "mask", "tv", (0.5, 5.0))


def test_nonfinite_rollout_is_masked_and_counted():
    inp = _inputs()
    roll = inp.rollout_logp.clone()
    roll[1, 0] = float("nan")
    roll[1, 1] = float("inf")
    bad = measure(old_logp=inp.old_logp, rollout_logp=roll, mask=MASK)
    for preset in (tis(), sparse_rl(), icepop(), trl(), openrlhf()):
        c = preset(bad)
        assert not c.mask[1, 0] and not c.mask[1, 1]
        assert torch.isfinite(c.weights).all()
        assert float(c.metrics["correction/nonfinite_count"]) == 2


def test_sparse_tail_needs_acceptance():
    with pytest.raises(ValueError, match="acceptance"):
        sparse_tail()(_inputs())
    acc = torch.full_like(LR, 0.95)
    assert sparse_tail()(_inputs(acceptance=acc)).mask.tolist() == MASK.tolist()


def test_get_preset_and_errors():
    assert get_preset("tis", cap=3.0) == tis(cap=3.0)
    assert get_preset("trl", mode="token_mask") == trl("token_mask")
    with pytest.raises(ValueError, match="name"):
        get_preset("trl:token_mask")  # the string mini-language is gone
    assert get_preset("none") is None
    with pytest.raises(ValueError, match="name: expected one of"):
        get_preset("nope")
    with pytest.raises(ValueError, match="numbers"):
        get_preset("veto", cap=2.0)
    with pytest.raises(ValueError, match="mode"):
        trl("token_weird")
    with pytest.raises(ValueError, match="advantages"):
        measure(old_logp=LR, rollout_logp=LR, mask=MASK, advantages=torch.zeros(3))
    with pytest.raises(ValueError, match="corrections"):
        chain()


def test_weights_are_detached():
    inp = _inputs()
    old = inp.old_logp.clone().requires_grad_()
    c = sparse_rl()(measure(old_logp=old, rollout_logp=inp.rollout_logp, mask=MASK))
    assert not c.weights.requires_grad
    assert all(not v.requires_grad for v in c.metrics.values())
    assert veto()(inp).weights.dtype == torch.float32
