import pytest
import torch

from sparsecorr.losses import AGGREGATIONS, aggregate, aggregation_coefficients

MASK = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
LOSS = torch.tensor([[1.0, 3.0, float("nan")], [5.0, 7.0, 9.0], [float("inf"), 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 3 + 5) / 3),
        ("seq-mean-token-mean", (2.0 + 5.0) / 2),
        ("seq-mean-token-sum", (4.0 + 5.0) / 2),
        ("seq-mean-token-sum-norm", (4.0 / 3 + 5.0 / 3) / 2),
    ],
)
def test_hand_worked(mode, expected):
    out = aggregate(LOSS, MASK, mode=mode)
    torch.testing.assert_close(out, torch.tensor(expected))


def test_global_counts_override():
    torch.testing.assert_close(aggregate(LOSS, MASK, num_tokens=9), torch.tensor(1.0))
    torch.testing.assert_close(aggregate(LOSS, MASK, mode="seq-mean-token-sum", num_sequences=torch.tensor(9.0)),
                               torch.tensor(1.0))
    torch.testing.assert_close(aggregate(LOSS, MASK, mode="seq-mean-token-sum-norm", norm_length=1.0),
                               torch.tensor(4.5))


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_empty_mask_gives_zero(mode):
    out = aggregate(LOSS, torch.zeros_like(MASK), mode=mode)
    assert out == 0 and torch.isfinite(out)


def test_coefficients_zero_outside_mask():
    for mode in AGGREGATIONS:
        c = aggregation_coefficients(MASK, mode=mode)
        assert c.dtype == torch.float32 and bool((c[~MASK] == 0).all())


def test_errors():
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(LOSS, MASK, mode="sum")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(LOSS, MASK, num_tokens=torch.ones(2))
    with pytest.raises(ValueError, match="mask"):
        aggregate(LOSS, MASK.float())
