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


# -- scalar / integer-tensor / JSON-field helpers (issue #14) ------------------------------------
import math  # noqa: E402

import numpy as np  # noqa: E402

from sparsecorr._checks import (  # noqa: E402
    check_dim,
    check_int,
    check_int_tensor,
    check_levels,
    check_number,
    field,
)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", None, float("nan")])
def test_check_int_names_argument_expectation_and_value(bad):
    with pytest.raises(ValueError, match=r"^chunk_size: expected an int >= 1, got "):
        check_int("chunk_size", bad, low=1)


def test_check_int_accepts_numpy_ints_bounds_and_none():
    check_int("n", np.int64(3), low=1, high=3)
    check_int("n", None, low=1, allow_none=True)
    with pytest.raises(ValueError, match=r"n: expected an int in \[1, 3\] \(why\), got 4"):
        check_int("n", 4, low=1, high=3, why=" (why)")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), True, "1", None])
def test_check_number_refuses_non_finite(bad):
    with pytest.raises(ValueError, match=r"^tau: expected a finite number"):
        check_number("tau", bad, low=0, high=1)


def test_check_number_bounds():
    check_number("x", 0.0, low=0)
    with pytest.raises(ValueError, match=r"x: expected a finite number > 0, got 0"):
        check_number("x", 0, low=0, low_open=True)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        check_number("x", 1, low=0, high=1, high_open=True)


def test_check_levels():
    assert check_levels("q", 0.05) == [0.05]
    assert check_levels("q", torch.tensor([0.0, 1.0])) == [0.0, 1.0]
    for bad in (1.5, -0.1, math.nan, [], [0.5, 2.0], "0.5", None):
        with pytest.raises(ValueError, match=r"^q: expected"):
            check_levels("q", bad)


def test_check_dim_refuses_out_of_range_instead_of_wrapping():
    assert check_dim("dim", -1, 2) == 1
    assert check_dim("dim", None, 2, allow_none=True) is None
    with pytest.raises(ValueError, match=r"dim: expected an int in \[-2, 1\] or None for a 2-dim input, got 5"):
        check_dim("dim", 5, 2, allow_none=True)


def test_check_int_tensor():
    check_int_tensor("offset", torch.tensor([0, 3]), shape=(2,), nonnegative=True)
    with pytest.raises(ValueError, match="offset: expected values >= 0, got a minimum of -5"):
        check_int_tensor("offset", torch.tensor([-5, 0]), nonnegative=True)
    with pytest.raises(ValueError, match=r"offset: expected an integer dtype, got torch.float32"):
        check_int_tensor("offset", torch.zeros(2))
    with pytest.raises(ValueError, match=r"offset: expected shape \(3,\), got \(2,\)"):
        check_int_tensor("offset", torch.zeros(2, dtype=torch.long), shape=(3,))


def test_field_names_the_json_path():
    data = {"bin_size": 8, "q": 0.05, "budgets": [4], "flag": True}
    assert field(data, "bin_size", where="", kind="int") == 8
    assert field(data, "missing", where="state", kind="int", default=3) == 3
    with pytest.raises(ValueError, match=r"^state\.missing: missing$"):
        field(data, "missing", where="state", kind="int")
    with pytest.raises(ValueError, match=r"^flag: expected an int, got True$"):
        field(data, "flag", where="", kind="int")
    with pytest.raises(ValueError, match=r"^budgets: expected an object"):
        field(data, "budgets", where="", kind="dict")
    with pytest.raises(ValueError, match=r"^q: expected a finite number, got nan$"):
        field({"q": float("nan")}, "q", where="", kind="number")
    with pytest.raises(ValueError, match=r"^table: expected a JSON object, got list$"):
        field([], "q", where="table", kind="number")
