import pytest
import torch

from sparsecorr._checks import check_mask, check_same_shape, count, finite


def test_check_same_shape_names_both():
    with pytest.raises(ValueError, match=r"rollout_logp: expected the shape of old_logp \(2, 3\), got \(2, 4\)"):
        check_same_shape(old_logp=torch.zeros(2, 3), rollout_logp=torch.zeros(2, 4))


def test_check_mask_rejects_float():
    with pytest.raises(ValueError, match=r"mask: expected dtype torch\.bool"):
        check_mask(torch.ones(2, 3), torch.zeros(2, 3))


def test_count_and_finite():
    x = torch.tensor([[0.0, float("nan"), float("inf")], [1.0, 2.0, -float("inf")]])
    m = torch.tensor([[True, True, False], [True, True, True]])
    assert finite(x).tolist() == [[True, False, False], [True, True, False]]
    assert float(count(m & ~finite(x))) == 2.0
    assert count(m, dim=1).tolist() == [2.0, 3.0]
    assert count(m, dim=1, keepdim=True).shape == (2, 1)
