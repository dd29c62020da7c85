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
