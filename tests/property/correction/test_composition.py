"""The preset registry is covered by the invariant table; random chains keep the invariants;
the fused ``sparse_rl`` equals its composition bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecorr.correction import (
    PRESETS as REGISTRY,
)
from sparsecorr.correction import (
    batch_normalized,
    chain,
    icepop,
    sparse_rl,
    tis,
    veto,
)
from sparsecorr.mismatch import measure
from tests.strategies import logp_batches

from .presets_table import PRESETS

BY_NAME = {r.name: r for r in PRESETS}


def test_every_registered_preset_is_in_the_invariant_table():
    covered = {row.preset for row in PRESETS}
    missing = sorted(set(REGISTRY) - covered)
    assert not missing, f"presets without a row in presets_table.PRESETS: {missing}"


def _record(batch, rows):
    g = torch.Generator().manual_seed(batch.seed)
    b, t = batch.mask.shape
    acc = 0.3 + 0.7 * torch.rand(b, t, generator=g) if any(r.needs_acceptance for r in rows) else None
    adv = torch.randn(b, generator=g) if any(r.needs_advantages for r in rows) else None
    return measure(batch.old_logp, batch.rollout_logp, batch.mask, acceptance=acc, advantages=adv)


@given(batch=logp_batches(nonfinite=True),
       names=st.lists(st.sampled_from(sorted(BY_NAME)), min_size=1, max_size=3))
@settings(max_examples=60)
def test_random_chains_keep_the_invariants(batch, names):
    rows = [BY_NAME[n] for n in names]
    mm = _record(batch, rows)
    pieces = [r.loose()(mm) for r in rows]
    c = chain(*(r.loose() for r in rows))(mm)
    # masks AND, weights multiply (on the kept tokens), nothing outside the record's valid tokens
    want_mask = pieces[0].mask
    for p in pieces[1:]:
        want_mask = want_mask & p.mask
    assert torch.equal(c.mask, want_mask)
    assert not (c.mask & ~mm.valid).any()
    w = c.weights
    assert w.dtype == torch.float32 and not w.requires_grad
    assert torch.isfinite(w).all() and (w >= 0).all() and (w[~c.mask] == 0).all()
    prod = torch.ones_like(w)
    for p in pieces:
        prod = prod * p.weights
    torch.testing.assert_close(w[c.mask], prod[c.mask], rtol=1e-5, atol=1e-30)
    for name, value in c.metrics.items():
        assert name.startswith("correction/") and value.shape == () and torch.isfinite(value) | value.isnan()
    assert int(c.metrics["correction/nonfinite_count"]) == int((batch.mask & ~mm.valid).sum())


@given(batch=logp_batches(nonfinite=True),
       cap=st.sampled_from([1.2, 1.5, 3.0, None]),
       band=st.sampled_from([(0.5, 1.5), (0.2, 5.0), (0.9, 1.1), (1.1, 2.0), (0.3, 0.8)]),
       threshold=st.sampled_from([1e-4, 1e-2, 0.5]))
@settings(max_examples=60)
def test_fused_sparse_rl_equals_its_composition_bit_for_bit(batch, cap, band, threshold):
    mm = measure(batch.old_logp, batch.rollout_logp, batch.mask)
    low, high = band
    fused = sparse_rl(cap=cap, low=low, high=high, veto_threshold=threshold)(mm)
    generic = batch_normalized(chain(tis(cap=cap), icepop(low, high), veto(threshold)))(mm)
    assert torch.equal(fused.mask, generic.mask)
    assert torch.equal(fused.weights, generic.weights)
    for name in ("correction/truncated_frac", "correction/band_rejected_frac", "correction/vetoed_seqs",
                 "correction/ess",
                 "correction/weight_mean", "correction/kept_token_frac"):
        torch.testing.assert_close(fused.metrics[name], generic.metrics[name], equal_nan=True)


@pytest.mark.parametrize("factory, kwargs, match", [
    ("tis", dict(cap=float("nan")), "cap"),
    ("tis", dict(cap=0.5, floor=1.0), "cap"),
    ("trl", dict(clip_max=-1.0), "clip_max"),
    ("trl", dict(clip_max=float("nan")), "clip_max"),
    ("trl", dict(mode="token_truncate", clip_min=5.0, clip_max=1.0), "clip_min"),
    ("openrlhf", dict(threshold=(5.0, 0.5)), "threshold"),
    ("openrlhf", dict(gating="tv", threshold=(0.1, 0.5)), "threshold"),
    ("opsm", dict(delta=float("nan")), "delta"),
    ("sparse_tail", dict(tau=1.5), "tau"),
    ("sparse_tail", dict(q=-0.1), "q"),
    ("mis", dict(low=2.0, high=1.0), "low"),
    ("icepop", dict(low=-1.0), "low"),
    ("veto", dict(threshold=0.0), "threshold"),
    ("sparse_rl", dict(veto_threshold=float("inf")), "veto_threshold"),
    ("divergence", dict(threshold=float("nan")), "threshold"),
    ("sequence_is", dict(reduce="prod"), "reduce"),
])
def test_settings_that_would_make_the_loss_silently_wrong_are_refused(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        REGISTRY[factory](**kwargs)
