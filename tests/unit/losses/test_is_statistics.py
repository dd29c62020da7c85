"""Statistics of sequence-level IS through sparse_grpo on a small discrete problem.

Sequences of T = 3 tokens over a 3-token vocabulary, positions independent; the sparse sampler q
and the dense model p differ strongly (per-token ratios 3, 1, 1/5; sequence ratios up to 27).
With the learner equal to the dense model (PPO ratio 1), advantages A_i = f(y_i) and
``seq-mean-token-mean``, ``-loss = (1/N) sum_i w_i f(y_i)``: the IS estimate of E_p[f].
The exact expectation of the truncated estimator, E_q[min(p/q, c) f], is computed by enumerating
all 27 sequences. Tolerance: 4 standard errors estimated from the same sample (two-sided normal
false-positive rate 6e-5 per check; the seed is fixed, so the test is deterministic).
"""

import itertools
import math

import pytest
import torch

from sparsecorr.correction import sequence_is
from tests.unit.losses.helpers import grpo

P = torch.tensor([0.6, 0.3, 0.1])  # dense
Q = torch.tensor([0.2, 0.3, 0.5])  # sparse sampler
T = 3
N = 20_000
CAPS = [1.0, 2.0, 4.0, 9.0, None]  # None = untruncated


def reward(y: torch.Tensor) -> torch.Tensor:
    return (y == 0).sum(-1).float()


def seq_is(cap):
    return sequence_is(reduce="sum", cap=cap)  # product of token ratios, truncated at cap


def exact(cap):
    total = 0.0
    for y in itertools.product(range(3), repeat=T):
        yt = torch.tensor(y)
        q, p = Q[yt].prod().item(), P[yt].prod().item()
        w = p / q if cap is None else min(p / q, cap)
        total += q * w * reward(yt).item()
    return total


@pytest.fixture(scope="module")
def sample():
    g = torch.Generator().manual_seed(1234)
    y = torch.multinomial(Q, N * T, replacement=True, generator=g).reshape(N, T)
    return y, P.log()[y], Q.log()[y]


def estimate(sample, cap):
    y, old_logp, rollout_logp = sample
    f = reward(y)
    mask = torch.ones(N, T, dtype=torch.bool)
    out = grpo(old_logp.clone(), old_logp, f, mask, rollout_logp=rollout_logp,
                      correction=seq_is(cap), aggregation="seq-mean-token-mean")
    per_seq = (out.token_loss.sum(1) / T).neg()  # w_i f_i, for the standard error
    se = per_seq.std().item() / math.sqrt(N)
    return -out.loss.item(), se


def test_untruncated_sequence_is_is_unbiased(sample):
    target = exact(None)
    assert target == pytest.approx((P * torch.tensor([1.0, 0, 0])).sum().item() * T)  # E_p f = 1.8
    est, se = estimate(sample, None)
    assert abs(est - target) < 4 * se, (est, target, se)


@pytest.mark.parametrize("cap", CAPS)
def test_truncated_estimate_matches_its_exact_expectation(sample, cap):
    est, se = estimate(sample, cap)
    assert abs(est - exact(cap)) < 4 * se, (cap, est, exact(cap), se)


def test_truncation_bias_shrinks_as_cap_grows(sample):
    target = exact(None)
    biases = [abs(exact(c) - target) for c in CAPS]
    assert all(a > b for a, b in itertools.pairwise(biases))  # strictly shrinking
    assert biases[-1] == pytest.approx(0.0, abs=1e-12)
    est, se = estimate(sample, 1.0)  # and the small-cap bias is visible in the sample
    assert abs(est - target) > 4 * se
