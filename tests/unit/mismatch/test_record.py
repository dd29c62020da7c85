import dataclasses

import pytest
import torch

from sparsecorr.mismatch import Mismatch, measure


def _record(nonfinite: bool) -> tuple[Mismatch, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g)
    roll = old + 0.1 * torch.randn(3, 5, generator=g)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [False] * 5])
    if nonfinite:
        roll[0, 1] = float("nan")
        old[1, 4] = float("inf")  # outside the mask: still takes the general path
    return measure(old, roll, mask), mask


@pytest.mark.parametrize("nonfinite", [False, True])
def test_with_context_copies_every_field_and_shares_the_cache(nonfinite):
    mm, _ = _record(nonfinite)
    adv = torch.tensor([1.0, -1.0, 0.5])
    logp = torch.randn(3, 5, requires_grad=True)
    for validate in (True, False):
        c = mm.with_context(advantages=adv, logp=logp, validate=validate)
        for f in dataclasses.fields(Mismatch):
            if f.name not in ("advantages", "logp"):
                assert getattr(c, f.name) is getattr(mm, f.name), f.name
        assert c.advantages is adv and not c.logp.requires_grad and torch.equal(c.logp, logp)
    with pytest.raises(ValueError, match="logp"):
        mm.with_context(logp=torch.randn(2, 5))


@pytest.mark.parametrize("nonfinite", [False, True])
def test_counts_and_the_float_mask_survive_the_ratio_taking_its_buffer(nonfinite):
    mm, mask = _record(nonfinite)
    want_valid = mask.clone()
    if nonfinite:
        want_valid[0, 1] = False
    assert torch.equal(mm.valid, want_valid)
    assert torch.equal(mm.valid_f, want_valid.float())
    r = mm.ratio_m1  # computed into the buffer measure() kept the float mask in
    assert torch.equal(r, torch.expm1(mm.log_ratio))
    assert torch.equal(mm.valid_f, want_valid.float())  # recomputed, not the reused buffer
    assert float(mm.valid_count) == want_valid.sum() and float(mm.input_count) == mask.sum()
    assert float(mm.nonfinite) == (1.0 if nonfinite else 0.0)


@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("beyond_clamp", [False, True])
def test_cached_sum_and_extremes_equal_the_clamped_log_ratio(nonfinite, beyond_clamp):
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 7, generator=g)
    roll = old + 0.3 * torch.randn(4, 7, generator=g)
    mask = torch.rand(4, 7, generator=g) > 0.3
    if beyond_clamp:
        roll[0, 0], roll[1, 2] = old[0, 0] - 30.0, old[1, 2] + 25.0
        mask[0, 0] = mask[1, 2] = True
        roll[2, 3] = old[2, 3] - 50.0  # outside the mask: no effect
        mask[2, 3] = False
    if nonfinite:
        roll[3, 1] = float("-inf")
        mask[3, 1] = True
    mm = measure(old, roll, mask)
    diff = old - roll
    ok = mask & torch.isfinite(diff)
    want = torch.where(ok, diff.clamp(-20.0, 20.0), 0.0)
    assert torch.equal(mm.log_ratio, want)
    torch.testing.assert_close(mm.log_ratio_sum, want.sum())
    lo, hi = mm.log_ratio_extremes
    assert float(lo) == float(want.min()) and float(hi) == float(want.max())
    if beyond_clamp:
        assert float(hi) == 20.0 and float(lo) == -20.0


def test_ratio_is_exp_of_the_log_ratio_and_the_record_is_unchanged_by_reads():
    mm, _ = _record(nonfinite=True)
    lr = mm.log_ratio.clone()
    want = torch.exp(mm.log_ratio)
    assert torch.equal(mm.ratio, want)
    assert torch.equal(mm.ratio_m1, torch.expm1(mm.log_ratio))
    assert torch.equal(torch.where(mm.valid, mm.ratio, 0.0), torch.where(mm.valid, want, 0.0))
    _ = mm.valid_f, mm.valid_count, mm.log_ratio_sum  # reads change nothing: no cache, no reuse
    assert torch.equal(mm.log_ratio, lr) and torch.equal(mm.ratio, want)
    assert not hasattr(mm, "cache")
