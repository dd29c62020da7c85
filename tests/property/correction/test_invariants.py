"""Invariants every correction preset must satisfy (driven by presets_table.PRESETS)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecorr.mismatch import measure
from tests.strategies import logp_batches

from .presets_table import PRESETS

IDS = [r.name for r in PRESETS]


def _inputs(batch, row, *, dtype=None, acceptance_floor=0.3):
    old, roll = batch.old_logp, batch.rollout_logp
    if dtype is not None:
        old, roll = old.to(dtype), roll.to(dtype)
    g = torch.Generator().manual_seed(batch.seed)
    b, t = batch.mask.shape
    acc = acceptance_floor + (1 - acceptance_floor) * torch.rand(b, t, generator=g) if row.needs_acceptance else None
    adv = torch.randn(b, generator=g) if row.needs_advantages else None
    return measure(old_logp=old, rollout_logp=roll, mask=batch.mask, acceptance=acc, advantages=adv)


def _weight_rejected(row):
    # peer presets (TRL, OpenRLHF) reject by weight 0 and keep the token in the mask
    return row.name.startswith(("trl_", "openrlhf_"))


@pytest.mark.parametrize("row", PRESETS, ids=IDS)
@given(batch=logp_batches(nonfinite=True))
@settings(max_examples=25)
def test_bounds_subset_finite_detached(row, batch):
    c = row.loose()(_inputs(batch, row))
    assert c.weights.dtype == torch.float32 and not c.weights.requires_grad
    assert torch.isfinite(c.weights).all() and (c.weights >= 0).all()
    if row.bound is not None:
        assert (c.weights <= row.bound * (1 + 1e-5)).all()
    assert not (c.mask & ~batch.mask).any()
    assert (c.weights[~c.mask] == 0).all()
    bad = batch.mask & ~torch.isfinite(batch.rollout_logp.float())
    assert not (c.mask & bad).any()  # non-finite never kept
    assert int(c.metrics["correction/nonfinite_count"]) == int(bad.sum())
    assert all(v.dim() == 0 and not v.requires_grad for v in c.metrics.values())


@pytest.mark.parametrize("row", PRESETS, ids=IDS)
@given(batch=logp_batches(zero_mismatch=True, extreme=False))
@settings(max_examples=20)
def test_identity_at_zero_mismatch(row, batch):
    inp = _inputs(batch, row, acceptance_floor=1.0)  # acceptance 1 everywhere
    if row.needs_advantages:
        inp = measure(inp.old_logp, inp.rollout_logp, inp.mask, advantages=-torch.ones(batch.mask.shape[0]))
    c = row.loose()(inp)
    assert torch.equal(c.mask, batch.mask)
    torch.testing.assert_close(c.weights[batch.mask], torch.ones(int(batch.mask.sum())))


@pytest.mark.parametrize("row", PRESETS, ids=IDS)
@given(batch=logp_batches())
@settings(max_examples=20)
def test_stricter_threshold_never_rejects_less(row, batch):
    inp = _inputs(batch, row)
    loose, strict = row.loose()(inp), row.strict()(inp)
    if _weight_rejected(row):
        assert not ((strict.weights > 0) & (loose.weights == 0) & batch.mask).any()
    else:
        assert not (strict.mask & ~loose.mask).any()


@pytest.mark.parametrize("row", PRESETS, ids=IDS)
@given(batch=logp_batches(dtypes=(torch.float32,)), pad=st.integers(1, 5))
@settings(max_examples=20)
def test_padding_invariance(row, batch, pad):
    inp = _inputs(batch, row)
    b = batch.mask.shape[0]
    g = torch.Generator().manual_seed(batch.seed + 1)

    def padded(x, fill):
        return None if x is None else torch.cat([x, fill], dim=1)

    big = measure(
        old_logp=padded(inp.old_logp, torch.randn(b, pad, generator=g) * 50),
        rollout_logp=padded(inp.rollout_logp, torch.randn(b, pad, generator=g) * 50),
        mask=padded(inp.mask, torch.zeros(b, pad, dtype=torch.bool)),
        acceptance=padded(inp.acceptance, torch.rand(b, pad, generator=g)),
        advantages=inp.advantages,
    )
    a, c = row.loose()(inp), row.loose()(big)
    t = batch.mask.shape[1]
    assert torch.equal(a.mask, c.mask[:, :t]) and not c.mask[:, t:].any()
    torch.testing.assert_close(a.weights, c.weights[:, :t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("row", PRESETS, ids=IDS)
@given(batch=logp_batches(dtypes=(torch.float32,)), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=20)
def test_row_permutation_equivariance(row, batch, seed):
    inp = _inputs(batch, row)
    perm = torch.randperm(batch.mask.shape[0], generator=torch.Generator().manual_seed(seed))

    def p(x):
        return None if x is None else x[perm]

    permuted = measure(p(inp.old_logp), p(inp.rollout_logp), p(inp.mask),
                                acceptance=p(inp.acceptance), advantages=p(inp.advantages))
    a, c = row.loose()(inp), row.loose()(permuted)
    assert torch.equal(a.mask[perm], c.mask)
    torch.testing.assert_close(a.weights[perm], c.weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("row", PRESETS, ids=IDS)
@given(batch=logp_batches(dtypes=(torch.float32,)))
@settings(max_examples=15)
def test_bf16_inputs_match_fp32_of_the_same_values(row, batch):
    bf = _inputs(batch, row, dtype=torch.bfloat16)
    fp = measure(bf.old_logp.float(), bf.rollout_logp.float(), bf.mask,
                          acceptance=bf.acceptance, advantages=bf.advantages)
    a, c = row.loose()(bf), row.loose()(fp)
    assert torch.equal(a.mask, c.mask)
    torch.testing.assert_close(a.weights, c.weights)
