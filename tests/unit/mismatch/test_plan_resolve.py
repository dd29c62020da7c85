"""``MetricPlan.resolve``: a sum that overflowed to inf (or is NaN) reaches only the metrics
that read it; every other metric keeps its value."""

import math

import pytest
import torch

from sparsecorr.mismatch import MetricPlan


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_nonfinite_sum_reaches_only_its_own_metrics(bad):
    plan = MetricPlan()
    n = plan.add(torch.tensor(4.0))
    s = plan.add(torch.tensor(6.0))
    big = plan.add(torch.tensor(bad))
    plan.ratio("mean", {s: 1.0}, n)
    plan.ratio("count", {n: 1.0})
    plan.ratio("difference", {n: 1.0, s: -1.0}, offset=1.0)
    plan.ratio("over_big", {s: 1.0}, big)
    plan.ratio("big_mean", {big: 1.0}, n)
    out = {k: float(v) for k, v in plan.resolve().items()}
    assert out["mean"] == 1.5 and out["count"] == 4.0 and out["difference"] == -1.0
    assert not math.isfinite(out["big_mean"])
    if bad == math.inf:
        assert out["over_big"] == 0.0  # 6 / inf


def test_an_empty_numerator_and_a_zero_denominator_give_the_offset():
    plan = MetricPlan()
    zero = plan.add(torch.tensor(0.0))
    plan.ratio("none", {})
    plan.ratio("frac", {zero: 1.0}, zero, offset=1.0)
    out = plan.resolve()
    assert float(out["none"]) == 0.0 and float(out["frac"]) == 1.0
