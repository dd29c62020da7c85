"""The schedule optimiser equals brute force over every schedule on small random tables."""

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecorr.schedules import solve_schedule


def _segments(choice):
    return 1 + sum(a != b for a, b in itertools.pairwise(choice))


@st.composite
def problems(draw):
    n_bins, k = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    feasible = rng.random((n_bins, k + 1)) < draw(st.sampled_from([0.3, 0.6, 0.9]))
    feasible[:, -1] = True  # dense is always allowed
    cost = np.sort(rng.integers(1, 20, (n_bins, k + 1)).astype(float), axis=1)  # bigger costs more
    return feasible, cost


@given(problems(), st.booleans(), st.sampled_from([None, 1, 2, 3]))
@settings(max_examples=150)
def test_exact_optimum_and_constraints(problem, monotone, max_steps):
    feasible, cost = problem
    n_bins, k1 = feasible.shape
    choice = solve_schedule(feasible, cost, monotone=monotone, max_steps=max_steps)
    assert all(feasible[i, c] for i, c in enumerate(choice))
    if monotone:
        assert all(a <= b for a, b in itertools.pairwise(choice))
    if max_steps is not None:
        assert _segments(choice) <= max_steps
    best = min(
        sum(cost[i, c] for i, c in enumerate(cand))
        for cand in itertools.product(range(k1), repeat=n_bins)
        if all(feasible[i, c] for i, c in enumerate(cand))
        and (not monotone or all(a <= b for a, b in itertools.pairwise(cand)))
        and (max_steps is None or _segments(cand) <= max_steps)
    )
    assert sum(cost[i, c] for i, c in enumerate(choice)) == best
