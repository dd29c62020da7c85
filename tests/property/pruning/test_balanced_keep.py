import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsecorr.pruning import balanced_keep, expected_kept_variance


@st.composite
def groups(draw, max_g=9):
    g = draw(st.integers(1, max_g))
    n = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(n * g, generator=gen) ** draw(st.sampled_from([0.3, 1.0, 3.0]))
    if draw(st.booleans()):  # ties
        p = (p * 4).round() / 4
    return p, g


@given(groups(), st.floats(0.05, 1.0), st.sampled_from(["variance", "target", "random"]))
def test_exactly_k_per_group(pg, ratio, rule):
    p, g = pg
    keep = balanced_keep(p, group_size=g, keep_ratio=ratio, rule=rule,
                         generator=torch.Generator().manual_seed(0))
    k = max(1, round(ratio * g))
    assert keep.dtype == torch.bool and keep.shape == p.shape
    assert (keep.reshape(-1, g).sum(1) == k).all()


@given(groups(max_g=8), st.floats(0.1, 1.0))
def test_variance_rule_equals_brute_force(pg, ratio):
    p, g = pg
    k = max(1, round(ratio * g))
    keep = balanced_keep(p, group_size=g, keep_ratio=ratio, rule="variance").reshape(-1, g)
    for row, kept in zip(p.reshape(-1, g), keep):
        best = max(float(expected_kept_variance(row[list(c)]))
                   for c in itertools.combinations(range(g), k))
        assert abs(float(expected_kept_variance(row[kept])) - best) < 1e-6


@given(groups(max_g=8), st.floats(0.0, 1.0))
def test_target_rule_equals_brute_force_on_small_groups(pg, target):
    p, g = pg
    k = max(1, round(0.5 * g))
    keep = balanced_keep(p, group_size=g, rule="target", target=target).reshape(-1, g)
    for row, kept in zip(p.reshape(-1, g), keep):
        best = min(abs(float(row[list(c)].mean()) - target)
                   for c in itertools.combinations(range(g), k))
        assert abs(float(row[kept].mean()) - target) <= best + 1e-6


def test_expected_variance_formula_matches_monte_carlo():
    p = torch.tensor([0.1, 0.5, 0.9, 0.7])
    gen = torch.Generator().manual_seed(0)
    r = (torch.rand(200_000, 4, generator=gen) < p).float()
    mc = r.var(dim=1, unbiased=False).mean()
    assert abs(float(expected_kept_variance(p)) - float(mc)) < 3e-3
