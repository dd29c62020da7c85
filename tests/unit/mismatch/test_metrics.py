import math

import pytest
import torch

from sparsecorr.mismatch import (
    chi2,
    effective_sample_size,
    kl_k1,
    kl_k2,
    kl_k3,
    log_ratio,
    mismatch_metrics,
    quantile_name,
    sequence_log_ratio,
)

OLD = torch.tensor([[-0.1, -2.0, -0.5, 0.0]])
ROLL = torch.tensor([[-0.1, -1.5, -0.9, 0.0]])
MASK = torch.tensor([[True, True, True, False]])


def test_log_ratio_hand_worked():
    lr = log_ratio(OLD, ROLL, MASK)
    torch.testing.assert_close(lr, torch.tensor([[0.0, -0.5, 0.4, 0.0]]))
    assert lr.dtype == torch.float32


def test_log_ratio_clamped_and_nonfinite_zeroed():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    roll = torch.tensor([[-50.0, 50.0, float("nan"), float("-inf")]])
    lr = log_ratio(old, roll, torch.ones(1, 4, dtype=torch.bool))
    assert lr.tolist() == [[20.0, -20.0, 0.0, 0.0]]


def test_estimators_hand_worked():
    lr = torch.tensor([0.0, -0.5, 0.4])
    torch.testing.assert_close(kl_k1(OLD, ROLL, MASK)[0, :3], -lr)
    torch.testing.assert_close(kl_k2(OLD, ROLL, MASK)[0, :3], lr**2 / 2)
    torch.testing.assert_close(kl_k3(OLD, ROLL, MASK)[0, :3], lr.exp() - 1 - lr)
    torch.testing.assert_close(chi2(OLD, ROLL, MASK)[0, :3], (lr.exp() - 1) ** 2)
    for f in (kl_k1, kl_k2, kl_k3, chi2):
        assert f(OLD, ROLL, MASK)[0, 3] == 0


def test_sequence_log_ratio_sum_and_mean():
    lr = log_ratio(OLD, ROLL, MASK)
    assert sequence_log_ratio(lr, MASK).tolist() == pytest.approx([-0.1])
    assert sequence_log_ratio(lr, MASK, reduce="mean").tolist() == pytest.approx([-0.1 / 3])
    empty = torch.zeros(1, 4, dtype=torch.bool)
    assert sequence_log_ratio(lr, empty, reduce="mean").tolist() == [0.0]


def test_effective_sample_size_cases():
    m = torch.ones(1, 4, dtype=torch.bool)
    assert float(effective_sample_size(torch.ones(1, 4), m)) == pytest.approx(1.0)
    assert float(effective_sample_size(torch.tensor([[1.0, 0, 0, 0]]), m)) == pytest.approx(0.25)
    assert float(effective_sample_size(torch.zeros(1, 4), m)) == 0.0
    assert math.isnan(float(effective_sample_size(torch.ones(1, 4), ~m)))
    per_row = effective_sample_size(torch.tensor([[1.0, 1], [1, 0]]), torch.ones(2, 2, dtype=torch.bool), dim=-1)
    assert per_row.tolist() == pytest.approx([1.0, 0.5])


def test_errors_name_the_argument_and_shapes():
    with pytest.raises(ValueError, match=r"rollout_logp: expected the shape of old_logp \(1, 4\), got \(1, 3\)"):
        log_ratio(OLD, ROLL[:, :3], MASK)
    with pytest.raises(ValueError, match=r"mask: expected dtype torch\.bool"):
        log_ratio(OLD, ROLL, MASK.float())
    with pytest.raises(ValueError, match="old_logp: expected a floating-point tensor"):
        log_ratio(OLD.long(), ROLL, MASK)
    with pytest.raises(ValueError, match="reduce"):
        sequence_log_ratio(OLD, MASK, reduce="max")


def test_mismatch_metrics_values_and_nonfinite_counting():
    roll = ROLL.clone()
    roll[0, 1] = float("nan")
    d = mismatch_metrics(OLD, roll, MASK, acceptance=torch.tensor([[0.9, 0.5, 0.7, 0.1]]))
    assert float(d["mismatch/nonfinite_count"]) == 1
    assert float(d["mismatch/tokens"]) == 2  # tokens 0 and 2
    assert float(d["mismatch/log_ratio_abs_max"]) == pytest.approx(0.4)
    assert float(d["mismatch/log_ratio_mean"]) == pytest.approx(0.2)
    assert float(d["mismatch/acceptance_mean"]) == pytest.approx(0.8)
    assert float(d["mismatch/acceptance_q50"]) == pytest.approx(0.8)
    assert float(d["mismatch/ratio_min"]) == pytest.approx(1.0)
    for v in d.values():
        assert v.dim() == 0 and v.dtype == torch.float32 and not v.requires_grad


def test_mismatch_metrics_empty_batch():
    d = mismatch_metrics(OLD, ROLL, torch.zeros_like(MASK))
    assert float(d["mismatch/tokens"]) == 0
    assert math.isnan(float(d["mismatch/log_ratio_q05"]))
    assert math.isnan(float(d["mismatch/ratio_min"]))


def test_quantile_names():
    assert [quantile_name(q) for q in (0.01, 0.05, 0.5, 0.999, 1.0)] == [
        "q01", "q05", "q50", "q99.9", "q100"]
