import pytest
import torch

from sparsecorr.pruning import balanced_keep


def _survivor_positive_fraction(rule, base_alpha, base_beta, seed=0, n_groups=400, g=8):
    """Perfectly calibrated head: rewards ~ Bernoulli(p), the head reports p exactly."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.distributions.Beta(base_alpha, base_beta).sample((n_groups * g,))
    rewards = (torch.rand(n_groups * g, generator=gen) < p).float()
    keep = balanced_keep(p, group_size=g, keep_ratio=0.5, rule=rule,
                         generator=torch.Generator().manual_seed(seed + 12345))
    return float(rewards.mean()), float(rewards[keep].mean())


@pytest.mark.parametrize("rule", ["variance", "target"])
@pytest.mark.parametrize("ab", [(1.0, 4.0), (4.0, 1.0)])  # mostly wrong / mostly right
def test_calibrated_head_moves_survivors_toward_target(rule, ab):
    torch.manual_seed(0)
    before, after = _survivor_positive_fraction(rule, *ab)
    # 3200 rollouts: the standard error of a fraction is < 0.012; a 0.05 move is > 4 sigma
    assert abs(after - 0.5) < abs(before - 0.5) - 0.05


def test_random_rule_keeps_base_rate():
    torch.manual_seed(0)
    before, after = _survivor_positive_fraction("random", 1.0, 4.0)
    assert abs(after - before) < 0.04


def test_hand_worked_variance_choice():
    # K = 2 of [0.0, 0.1, 0.9, 1.0]: the confident pair {0.0, 1.0} has expected variance 0.25
    keep = balanced_keep(torch.tensor([0.0, 0.1, 0.9, 1.0]), group_size=4)
    assert keep.tolist() == [True, False, False, True]


def test_hand_worked_target_choice():
    keep = balanced_keep(torch.tensor([0.1, 0.2, 0.3, 0.8]), group_size=4, rule="target",
                         target=0.5)
    assert keep.tolist() == [False, True, False, True]  # mean 0.5 exactly


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=3), "group_size"),
        (dict(group_size=2, rule="best"), "rule"),
        (dict(group_size=2, keep_ratio=0.0), "keep_ratio"),
        (dict(group_size=2, target=1.5), "target"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        balanced_keep(torch.rand(4), **kwargs)


def test_bad_probabilities():
    with pytest.raises(ValueError, match="p_success"):
        balanced_keep(torch.tensor([0.5, float("nan")]), group_size=2)
    with pytest.raises(ValueError, match="p_success"):
        balanced_keep(torch.rand(2, 2), group_size=2)
