"""``_fastexp``: e^x as 2^(x log2 e) on the CPU, within the documented ulp bounds of float64's
e^x, exact at 0, and the PPO clip still counts a ratio pinned at e^20 as clipped."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecorr._fastexp import exp_, exp_into
from sparsecorr.losses import sparse_grpo


def _ulps(got: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ref = torch.exp(x.double())
    ulp = (torch.nextafter(ref.float(), torch.tensor(math.inf)).double() - ref.float().double()).abs()
    return (got.double() - ref).abs() / ulp


def test_within_bounds_on_a_grid():
    small = torch.linspace(-1, 1, 400_001)
    assert float(_ulps(exp_(small.clone()), small).max()) <= 3.0
    wide = torch.linspace(-20, 20, 400_001)
    assert float(_ulps(exp_into(wide), wide).max()) <= 20.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-20, 20, width=32), min_size=1, max_size=64))
def test_in_place_and_into_agree(values):
    x = torch.tensor(values)
    out = torch.empty_like(x)
    assert torch.equal(exp_into(x, out), exp_(x.clone()))
    assert float(_ulps(out, x).max()) <= 20.0


def test_zero_is_exactly_one():
    assert torch.equal(exp_(torch.zeros(5)), torch.ones(5))


def test_a_ratio_pinned_at_the_clamp_counts_as_clipped():
    logp = torch.full((1, 4), 30.0, requires_grad=True)  # logp - old = 30 -> clamped to 20
    out = sparse_grpo(logp, torch.zeros(1, 4), torch.tensor([-1.0]), torch.ones(1, 4, dtype=torch.bool))
    assert float(out.metrics["loss/clip_frac_high"]) == 1.0
