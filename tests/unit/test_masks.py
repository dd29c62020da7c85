"""The mask helpers equal their plain torch forms, NaN/inf and empty shapes included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecorr._checks import finite, finite_in
from sparsecorr._masks import and_rows, count_rows, row_any

SPECIAL = [0.0, -0.0, 1.5, -3.0, float("nan"), float("inf"), float("-inf"), 1e-45, 3e38]


@st.composite
def float_masks(draw):
    # both sides of the 4096-entry switch in finite(): [B, T] up to 3 x 2000
    b = draw(st.integers(0, 3))
    t = draw(st.sampled_from([0, 1, 7, 2000]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(b, t, generator=g)
    if x.numel():
        idx = torch.randint(0, x.numel(), (min(x.numel(), 50),), generator=g)
        vals = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), (idx.numel(),), generator=g)]
        x.view(-1)[idx] = vals
    mask = torch.rand(b, t, generator=g) < 0.7
    return x, mask


@given(float_masks())
@settings(max_examples=80, deadline=None)
def test_finiteness_helpers_equal_isfinite(xm):
    x, mask = xm
    want = torch.isfinite(x)
    assert torch.equal(finite(x), want)
    assert torch.equal(finite_in(x, mask), mask & want)


@given(float_masks())
@settings(max_examples=60, deadline=None)
def test_row_helpers_equal_plain_forms(xm):
    _, mask = xm
    rows = torch.rand(mask.shape[0]) < 0.5
    assert torch.equal(and_rows(mask, rows), mask & rows[:, None])
    assert torch.equal(row_any(mask), mask.any(-1))
    assert int(count_rows(mask)) == int(mask.any(-1).sum()) and count_rows(mask).dtype == torch.float32
