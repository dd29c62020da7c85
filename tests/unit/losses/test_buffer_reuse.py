"""``sparse_grpo`` writes its learner side into the buffers of a record it built itself
(``Mismatch.take_buffers``): the results equal those of the same call on a record the caller
owns (which is never touched), and a correction whose weights live in one of the record's
buffers is not overwritten."""

import pytest
import torch

from sparsecorr.correction import Correction, chain, icepop, sparse_rl, tis
from sparsecorr.losses import sparse_grpo
from sparsecorr.mismatch import measure


def _batch(seed: int = 0, b: int = 5, t: int = 32, poison: bool = False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    roll = old - 0.3 * torch.randn(b, t, generator=g)
    logp = old + 0.05 * torch.randn(b, t, generator=g)
    mask = torch.arange(t)[None] < torch.randint(t // 2, t, (b,), generator=g)[:, None]
    if poison:  # a NaN inside the mask: the general paths run
        roll[1, 2] = float("nan")
        mask[1, 2] = True
    return old, roll, logp, torch.randn(b, generator=g), mask


def _run(old, logp, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    out = sparse_grpo(lp, old, adv, mask, **kw)
    out.loss.backward()
    return out, lp.grad


CORRECTIONS = {"none": lambda: None, "sparse_rl": sparse_rl, "tis": lambda: tis(cap=2.0),
               "chain": lambda: chain(tis(cap=2.0), icepop(low=0.5, high=2.0))}


@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
@pytest.mark.parametrize("metrics", ["default", "none", "full"])
@pytest.mark.parametrize("poison", [False, True])
def test_own_record_equals_a_callers_record(correction, metrics, poison):
    old, roll, logp, adv, mask = _batch(poison=poison)
    make = CORRECTIONS[correction]
    own, g_own = _run(old, logp, adv, mask, rollout_logp=roll, correction=make(), metrics=metrics)
    mm = measure(old, roll, mask)
    lr_before = mm.log_ratio.clone()
    theirs, g_theirs = _run(old, logp, adv, mask, mismatch=mm, correction=make(), metrics=metrics)
    assert torch.equal(own.loss, theirs.loss)
    assert torch.equal(g_own, g_theirs)
    assert torch.equal(own.mask, theirs.mask)
    assert own.metrics.keys() == theirs.metrics.keys()
    for k, v in own.metrics.items():
        assert torch.equal(v, theirs.metrics[k]) or (v.isnan() and theirs.metrics[k].isnan()), k
    # the caller's record is untouched and serves a second micro-step alike
    assert torch.equal(mm.log_ratio, lr_before)
    again, g_again = _run(old, logp, adv, mask, mismatch=mm, correction=make(), metrics=metrics)
    assert torch.equal(again.loss, theirs.loss) and torch.equal(g_again, g_theirs)


@pytest.mark.parametrize("which", ["valid_f", "log_ratio"])
def test_weights_living_in_the_records_buffers_are_kept(which):
    old, roll, logp, adv, mask = _batch(seed=4)

    def aliasing(mm):  # a hand-made correction returning one of the record's own buffers
        w = mm.valid_f if which == "valid_f" else mm.log_ratio.abs_().add_(1.0).mul_(mm.valid_f)
        return Correction(mask=mm.valid, token_weights=w, source=mm)

    def copying(mm):
        c = aliasing(mm)
        return Correction(mask=c.mask, token_weights=c.token_weights.clone(), source=mm)

    a, g_a = _run(old, logp, adv, mask, rollout_logp=roll, correction=aliasing)
    b, g_b = _run(old, logp, adv, mask, rollout_logp=roll, correction=copying)
    assert torch.equal(a.loss, b.loss) and torch.equal(g_a, g_b)


def test_a_record_cannot_compute_after_handing_its_buffers_over():
    old, roll, _, _, mask = _batch()
    mm = measure(old, roll, mask)
    n = mm.valid_count  # cached before: still readable
    lr, spare = mm.take_buffers()
    assert lr is mm.log_ratio and spare is not None and spare.shape == lr.shape
    assert torch.equal(mm.valid_count, n)
    with pytest.raises(RuntimeError, match="take_buffers"):
        _ = mm.ratio_m1


def test_the_spare_buffer_is_handed_over_after_a_library_correction():
    old, roll, _, _, mask = _batch()
    mm = measure(old, roll, mask)
    mm.expect_ratio_m1()
    corr = sparse_rl()(mm)
    float(mm.ratio_m1.sum())  # the k3 metric's read
    _, spare = mm.take_buffers()
    assert spare is not None  # sparse_grpo's learner side gets it: no fresh buffer
    assert not any(t is spare for t in (corr.token_weights, corr.mask))
