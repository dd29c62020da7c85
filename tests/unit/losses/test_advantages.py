import pytest
import torch

from sparsecorr.losses import group_advantages
from tests.unit.losses.reference import loop_group_advantages


def test_hand_worked_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2, eps=0.0)
    # mean 0.5, unbiased std sqrt(0.5): (1 - 0.5) / 0.7071 = 0.7071
    torch.testing.assert_close(adv, torch.tensor([0.70710677, -0.70710677, -0.70710677, 0.70710677]))


def test_dr_grpo_centres_only():
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0]), group_size=3, normalize="none")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0]))


@pytest.mark.parametrize("normalize", ["std", "none"])
def test_matches_loop_reference_with_invalid(normalize):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g)
    valid = torch.rand(24, generator=g) > 0.3
    out = group_advantages(rewards, group_size=4, normalize=normalize, valid=valid)
    torch.testing.assert_close(out, loop_group_advantages(rewards, 4, normalize, valid=valid))


def test_invalid_sequence_does_not_move_siblings():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    valid = torch.tensor([True, True, True, False])
    base = group_advantages(rewards, group_size=4, valid=valid)
    rewards2 = rewards.clone()
    rewards2[3] = 100.0  # the rejected rollout's reward must not matter
    torch.testing.assert_close(group_advantages(rewards2, group_size=4, valid=valid), base)
    assert base[3] == 0


def test_all_equal_rewards_give_zero_and_single_valid_gives_zero():
    assert torch.equal(group_advantages(torch.ones(4), group_size=2), torch.zeros(4))
    out = group_advantages(torch.tensor([5.0, 1.0]), group_size=2, valid=torch.tensor([True, False]))
    assert torch.equal(out, torch.zeros(2))


def test_bf16_rewards_give_float32():
    out = group_advantages(torch.tensor([1.0, 0.0]).bfloat16(), group_size=2)
    assert out.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(group_size=3), "group_size"),
        (dict(group_size=2, normalize="mad"), "normalize"),
        (dict(group_size=2, valid=torch.ones(4)), "valid"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(4), **kwargs)
