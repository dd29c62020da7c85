import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsecorr.mismatch import (
    BinnedQuantileSketch,
    QuantileSketch,
    binned_quantile,
    masked_quantile,
)
from tests.strategies import masks, shapes

levels = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4)


@st.composite
def values_and_mask(draw, max_b=6, max_t=30):
    shape = draw(shapes(max_b=max_b, max_t=max_t))
    mask = draw(masks(shape))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(*shape, generator=g) * draw(st.sampled_from([0.01, 1.0, 100.0]))
    if draw(st.booleans()):
        x = x.round()  # ties
    return x, mask


@given(values_and_mask(), levels)
def test_masked_quantile_equals_numpy(xm, qs):
    x, mask = xm
    ours = masked_quantile(x, mask, qs)
    if not mask.any():
        assert torch.isnan(ours).all()
        return
    ref = np.quantile(x[mask].numpy().astype(np.float64), qs)
    np.testing.assert_allclose(ours.numpy(), ref, rtol=1e-5, atol=1e-5)


@given(values_and_mask(), levels)
def test_masked_quantile_per_row_equals_numpy(xm, qs):
    x, mask = xm
    ours = masked_quantile(x, mask, qs, dim=1)
    for row, m, got in zip(x, mask, ours):
        if m.any():
            np.testing.assert_allclose(got.numpy(), np.quantile(row[m].numpy(), qs), rtol=1e-5, atol=1e-5)
        else:
            assert torch.isnan(got).all()


@given(values_and_mask(), st.lists(st.floats(0.0, 1.0), min_size=2, max_size=6))
def test_monotone_in_q(xm, qs):
    x, mask = xm
    qs = sorted(qs)
    out = masked_quantile(x, mask, qs)
    if mask.any():
        assert (out[1:] >= out[:-1] - 1e-6).all()


@given(values_and_mask(), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_invariant_to_padding_and_permutation(xm, q, seed):
    x, mask = xm
    g = torch.Generator().manual_seed(seed)
    base = masked_quantile(x, mask, q)
    padded_x = torch.cat([x, torch.randn(x.shape[0], 7, generator=g) * 1e6], dim=1)
    padded_m = torch.cat([mask, torch.zeros(x.shape[0], 7, dtype=torch.bool)], dim=1)
    perm = torch.randperm(x.numel(), generator=g)
    permuted = masked_quantile(x.reshape(-1)[perm], mask.reshape(-1)[perm], q)
    for other in (masked_quantile(padded_x, padded_m, q), permuted):
        assert torch.equal(torch.isnan(base), torch.isnan(other))
        torch.testing.assert_close(base, other, equal_nan=True)


@given(values_and_mask(max_t=40), st.sampled_from([1, 3, 8, 2000]), st.integers(0, 2**31 - 1), levels)
def test_binned_quantile_equals_per_bin_numpy(xm, bin_size, seed, qs):
    x, mask = xm
    g = torch.Generator().manual_seed(seed)
    offset = torch.randint(0, 20, (x.shape[0],), generator=g)
    vals, counts = binned_quantile(x, mask, qs, bin_size=bin_size, offset=offset)
    pos = offset[:, None] + torch.arange(x.shape[1])
    assert int(counts.sum()) == int(mask.sum())
    for k in range(counts.numel()):
        sel = mask & (pos // bin_size == k)
        assert int(counts[k]) == int(sel.sum())
        if sel.any():
            np.testing.assert_allclose(vals[k].numpy(), np.quantile(x[sel].numpy(), qs), rtol=1e-5, atol=1e-5)
        else:
            assert torch.isnan(vals[k]).all()


def _order_stat_interval(values: np.ndarray, q: float) -> tuple[float, float]:
    s = np.sort(values)
    h = q * (len(s) - 1)
    k = int(np.floor(h))
    return s[k], s[min(k + 1, len(s) - 1)]


@given(values_and_mask(), st.floats(0.0, 1.0), st.sampled_from([16, 256, 2048]), st.integers(1, 3))
def test_sketch_within_documented_bound_and_merge_is_concatenation(xm, q, n_buckets, parts):
    x, mask = xm
    acc = torch.sigmoid(x)  # values in [0, 1]
    sketches = [QuantileSketch(0.0, 1.0, n_buckets=n_buckets) for _ in range(parts)]
    for i, rows in enumerate(torch.arange(acc.shape[0]).chunk(parts)):
        sketches[i % parts].update(acc[rows], mask[rows])
    merged = sketches[0]
    for s in sketches[1:]:
        merged.merge(s)
    whole = QuantileSketch(0.0, 1.0, n_buckets=n_buckets).update(acc, mask)
    assert torch.equal(merged.counts, whole.counts)
    got = float(merged.quantile(q))
    if not mask.any():
        assert np.isnan(got)
        return
    lo, hi = _order_stat_interval(acc[mask].numpy(), q)
    eps = merged.error_bound + 1e-6
    assert lo - eps <= got <= hi + eps


@given(values_and_mask(max_t=40), st.floats(0.0, 1.0))
def test_binned_sketch_matches_binned_quantile_within_bound(xm, q):
    x, mask = xm
    acc = torch.sigmoid(x)
    offset = torch.zeros(x.shape[0], dtype=torch.long)
    sk = BinnedQuantileSketch(0.0, 1.0, bin_size=8, n_bins=5, n_buckets=512).update(acc, mask, offset)
    pos = torch.arange(x.shape[1]).expand_as(x)
    got = sk.quantile(q)
    for k in range(5):
        sel = mask & ((pos // 8).clamp(max=4) == k)
        if sel.any():
            lo, hi = _order_stat_interval(acc[sel].numpy(), q)
            assert lo - sk.error_bound - 1e-6 <= float(got[k]) <= hi + sk.error_bound + 1e-6
        else:
            assert torch.isnan(got[k])


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), min_size=1, max_size=20),
       st.sampled_from([(0.0, 1.0), (-20.0, 20.0)]), st.integers(1, 64))
def test_sketch_bucket_of_any_finite_value_is_its_clamped_floor(values, bounds, n_buckets):
    """Issue #14: update(1e30) landed in the bottom bucket (int64 overflow of the index)."""
    lo, hi = bounds
    s = QuantileSketch(lo, hi, n_buckets=n_buckets).update(torch.tensor(values, dtype=torch.float64))
    width = (hi - lo) / n_buckets
    want = np.zeros(n_buckets)
    for v in values:
        want[int(min(max(np.floor((v - lo) / width), 0), n_buckets - 1))] += 1
    assert s.counts.tolist() == want.tolist()
    assert float(s.n_clamped) == sum(v < lo or v > hi for v in values)


@given(values_and_mask(), st.integers(0, 3), st.integers(1, 4))
def test_binned_sketch_counts_equal_binned_quantile_counts(xm, n_bins_extra, bin_size):
    """The sketch and the exact path agree on how many tokens each bin holds (empty inputs too)."""
    x, mask = xm
    b, t = x.shape
    x = x.sigmoid()
    offset = torch.randint(0, 5, (b,), generator=torch.Generator().manual_seed(b * t))
    n_bins = (4 + t) // bin_size + 1 + n_bins_extra
    _, counts = binned_quantile(x, mask, 0.5, bin_size=bin_size, offset=offset, n_bins=n_bins)
    sk = BinnedQuantileSketch(0.0, 1.0, bin_size=bin_size, n_bins=n_bins).update(x, mask, offset)
    assert sk.bin_counts.long().tolist() == counts.tolist()
