"""The loss-path rows of issue 30's table: inputs that still fail inside torch or are silently
accepted. Each test failed before the loss-path rewrite (issue 25), which fixed them.

Every case uses ``B, T = 3, 5`` and ``m``, a bool mask (as in the issue).
"""

from __future__ import annotations

import re

import pytest
import torch

from sparsecorr import correction as C
from sparsecorr import losses as L
from sparsecorr import mismatch as M
from tests.bad_inputs import check_row, refused

B, T = 3, 5
NAN = float("nan")


def _lp(seed=0):
    return -torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) * 3


def _m():
    return torch.ones(B, T, dtype=torch.bool)


def _adv():
    return torch.tensor([1.0, -1.0, -0.5])


def test_effective_sample_size_names_an_out_of_range_dim():
    check_row(refused("effective_sample_size", "range",
                      lambda: M.effective_sample_size(torch.rand(B, T), _m(), dim=5), r"dim\b"))


def test_opsm_mask_refuses_a_nan_delta():
    lr = _lp(0) - _lp(1)
    check_row(refused("opsm_mask", "nan", lambda: C.opsm_mask(lr, _m(), _adv(), delta=NAN), r"delta\b"))


def test_group_advantages_refuses_a_bool_group_size():
    check_row(refused("group_advantages", "dtype",
                      lambda: L.group_advantages(torch.rand(4), group_size=True), r"group_size\b"))


def test_aggregate_refuses_an_integer_loss():
    check_row(refused("aggregate", "dtype", lambda: L.aggregate(torch.full((B, T), 3), _m()), r"token_loss\b"))


def test_aggregate_names_a_missing_loss():
    check_row(refused("aggregate", "dtype", lambda: L.aggregate(None, _m()), r"token_loss\b"))


def test_sparse_kl_k3_names_a_missing_dense_logp():
    check_row(refused("sparse_kl_k3", "dtype", lambda: L.sparse_kl_k3(_lp(), None, _m()), r"dense_logp\b"))


#: the numbers each preset needs to be built (the others build with defaults)
PRESET_ARGS = {"geo_rs": dict(low=0.5, high=2.0), "divergence": dict(threshold=1.0), "opsm": dict(delta=1e-4)}


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_a_correction_called_on_a_tensor_says_it_takes_measures_record(name):
    correction = C.get_preset(name, **PRESET_ARGS.get(name, {}))
    with pytest.raises(ValueError, match=re.escape("measure(")):
        correction(torch.randn(B, T))


def test_measure_documents_column_advantages():
    """``[B, 1]`` is accepted and read as ``[B]`` (tests/unit/test_bad_inputs.py pins that);
    the docstring must list it with the shapes it accepts."""
    assert "[B, 1]" in M.measure.__doc__
