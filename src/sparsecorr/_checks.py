"""Input validation shared by every layer.

Every public function validates its tensors with these helpers so errors read the same
everywhere: a ``ValueError`` naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import TypeVar

import torch

from ._masks import total

__all__ = [
    "as_float32",
    "check_advantages",
    "check_choice",
    "check_dim",
    "check_float_tensor",
    "check_int",
    "check_int_list",
    "check_int_tensor",
    "check_levels",
    "check_mask",
    "check_number",
    "check_positive",
    "check_probability",
    "check_same_shape",
    "compile_safe_hash",
    "count",
    "count_int",
    "field",
    "finite",
    "finite_in",
    "is_int",
]


def check_float_tensor(name: str, x: object, *, ndim: int | None = None) -> torch.Tensor:
    """Return ``x`` if it is a floating-point tensor (with ``ndim`` dims if given)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(x.shape)}")
    return x


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise if the given (non-None) tensors do not all share one shape; names both shapes."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(
                f"{name}: expected the shape of {ref_name} {tuple(ref.shape)}, "
                f"got {tuple(t.shape)}"
            )


def check_mask(mask: object, like: torch.Tensor, *, name: str = "mask") -> torch.Tensor:
    """Return ``mask`` if it is a bool tensor with the shape of ``like``.

    Masks are explicit bool tensors (True = the token counts); integer or float masks are
    refused rather than guessed at.
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name}: expected a bool torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name}: expected dtype torch.bool (True = token counts), got {mask.dtype}; "
            "convert with mask.bool()"
        )
    if tuple(mask.shape) != tuple(like.shape):
        raise ValueError(f"{name}: expected shape {tuple(like.shape)}, got {tuple(mask.shape)}")
    if mask.device != like.device:
        raise ValueError(f"{name}: expected device {like.device}, got {mask.device}")
    return mask


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    """Raise if ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise if ``value`` is not a finite number > 0 (>= 0 with ``allow_zero``)."""
    ok = value >= 0 if allow_zero else value > 0
    if not isinstance(value, (int, float)) or value != value or not ok or value == float("inf"):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a finite number {bound}, got {value!r}")


def check_probability(name: str, value: float, *, open_low: bool = False) -> None:
    """Raise if ``value`` is not in [0, 1] ((0, 1] with ``open_low``)."""
    low_ok = value > 0 if open_low else value >= 0
    if not isinstance(value, (int, float)) or not (low_ok and value <= 1):
        interval = "(0, 1]" if open_low else "[0, 1]"
        raise ValueError(f"{name}: expected a number in {interval}, got {value!r}")


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 (no copy when it already is)."""
    return x if x.dtype == torch.float32 else x.float()


def count_int(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """int64 number of True (nonzero) entries (``count_nonzero``; of a ``[B, T]`` mask as int32
    row counts, exact below 2**31 tokens a row, then their int64 sum: see ``_masks.total``;
    an int32 lane is as wide as a float32 one, so the compiled loop counts without widening)."""
    if dim is None and mask.dim() == 2 and mask.dtype == torch.bool:
        return total(mask, dtype=torch.int32)  # int32 row sums; torch sums those into int64
    return torch.count_nonzero(mask) if dim is None else torch.count_nonzero(mask, dim=dim)


def count(mask: torch.Tensor, dim: int | None = None, *, keepdim: bool = False) -> torch.Tensor:
    """Number of True entries as float32."""
    n = count_int(mask, dim)
    if keepdim and dim is not None:
        n = n.unsqueeze(dim)
    return n.float()


def finite(x: torch.Tensor) -> torch.Tensor:
    """bool ``isfinite(x)``: False at NaN and ±inf."""
    return torch.isfinite(x.detach())


def finite_in(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """bool ``mask & isfinite(x)`` (``mask`` broadcastable to ``x``)."""
    return mask & torch.isfinite(x.detach())


# -- scalar, integer-tensor and file-field checks (validation before any work) -------------------

_MISSING = object()


def is_int(value: object) -> bool:
    """A Python or numpy integer, not a bool."""
    if type(value) is int:  # the common case without the ABC check (a few µs on a hot path)
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A Python or numpy real number, not a bool."""
    if type(value) is float or type(value) is int:
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None,
              allow_none: bool = False, why: str = "") -> None:
    """Raise unless ``value`` is an int (not a bool) in ``[low, high]`` (None when allowed).

    ``why`` is appended to the message (e.g. the reason for an upper bound).
    """
    if value is None and allow_none:
        return
    ok = is_int(value) and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        if low is not None and high is not None:
            expected = f"an int in [{low:,}, {high:,}]"
        elif low is not None:
            expected = f"an int >= {low:,}"
        elif high is not None:
            expected = f"an int <= {high:,}"
        else:
            expected = "an int"
        if allow_none:
            expected += " or None"
        raise ValueError(f"{name}: expected {expected}{why}, got {value!r}")


def check_int_list(name: str, values: object, *, low: int = 1) -> None:
    """Raise unless ``values`` is a non-empty list or tuple of ints >= ``low`` (bools refused);
    a bad entry is named ``name[i]``."""
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{name}: expected a non-empty list of positive ints, got {values!r}")
    for i, v in enumerate(values):
        check_int(f"{name}[{i}]", v, low=low)


def check_advantages(advantages: object, like: torch.Tensor, *, column: bool = True) -> None:
    """Raise unless ``advantages`` is a tensor of shape ``[B]``, ``[B, T]`` (``like``'s) or,
    with ``column``, ``[B, 1]``."""
    b = like.shape[0]
    shapes = [(b,), *([(b, 1)] if column else []), tuple(like.shape)]
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in shapes:
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        listed = ", ".join(str(s) for s in shapes[:-1])
        raise ValueError(f"advantages: expected shape {listed} or {shapes[-1]}, got {got}")


def check_number(name: str, value: object, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, allow_none: bool = False,
                 why: str = "") -> None:
    """Raise unless ``value`` is a finite real number (not a bool) within the given bounds.

    NaN and ±inf are always refused; ``low_open``/``high_open`` make the bounds strict. ``why`` is
    appended to the message (e.g. what a bound means).
    """
    if value is None and allow_none:
        return
    ok = _is_real(value) and -math.inf < value < math.inf  # False at NaN (compiles as a guard)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is not None and high is not None:
            expected = f"a finite number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            expected = f"a finite number {'>' if low_open else '>='} {low}"
        elif high is not None:
            expected = f"a finite number {'<' if high_open else '<='} {high}"
        else:
            expected = "a finite number"
        if allow_none:
            expected += " or None"
        raise ValueError(f"{name}: expected {expected}{why}, got {value!r}")


def check_levels(name: str, q: object) -> list[float]:
    """Quantile level(s) in [0, 1]: a number or a non-empty sequence/tensor of numbers.

    Returns the levels as a list of floats (NaN and values outside [0, 1] are refused).
    """
    if isinstance(q, torch.Tensor):
        levels = q.detach().reshape(-1).double().tolist()
    elif _is_real(q):
        levels = [float(q)]  # type: ignore[arg-type]
    elif isinstance(q, Sequence) and not isinstance(q, str) and all(_is_real(v) for v in q):
        levels = [float(v) for v in q]
    else:
        raise ValueError(f"{name}: expected a level in [0, 1] or a sequence of levels, got {q!r}")
    if not levels or not all(0.0 <= v <= 1.0 for v in levels):
        raise ValueError(f"{name}: expected quantile level(s) in [0, 1], got {q!r}")
    return levels


def check_int_tensor(name: str, x: object, *, shape: tuple[int, ...] | None = None,
                     ndim: int | None = None, nonnegative: bool = False) -> torch.Tensor:
    """Return ``x`` if it is an integer (not bool) tensor of ``shape`` / ``ndim``.

    ``nonnegative`` also checks the values (one host synchronisation: use it on small tensors
    such as per-row offsets, before the expensive work).
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected an integer torch.Tensor, got {type(x).__name__}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer dtype, got {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(x.shape)}")
    if nonnegative and x.numel() and int(x.min()) < 0:
        raise ValueError(f"{name}: expected values >= 0, got a minimum of {int(x.min())}")
    return x


def check_dim(name: str, dim: object, ndim: int, *, allow_none: bool = False) -> int | None:
    """``dim`` normalised to ``[0, ndim)``; refuses out-of-range dims (instead of wrapping)."""
    if dim is None and allow_none:
        return None
    if not is_int(dim) or not -ndim <= dim < ndim:  # type: ignore[operator]
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name}: expected an int in [{-ndim}, {ndim - 1}]{extra} "
                         f"for a {ndim}-dim input, got {dim!r}")
    return int(dim) % ndim  # type: ignore[call-overload]


def field(data: object, key: str, *, where: str, kind: str, default: object = _MISSING) -> object:
    """``data[key]`` from parsed JSON, checked to be of ``kind``; errors name ``where.key``.

    ``kind``: ``"int"`` (not bool), ``"number"`` (finite int or float), ``"str"``, ``"list"``,
    ``"dict"``, ``"bool"``, or ``"any"``. Missing keys raise unless ``default`` is given.
    """
    label = f"{where}.{key}" if where else key
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'data'}: expected a JSON object, got {type(data).__name__}")
    if key not in data:
        if default is not _MISSING:
            return default
        raise ValueError(f"{label}: missing")
    value = data[key]
    ok = {
        "int": is_int,
        "number": lambda v: _is_real(v) and math.isfinite(v),
        "str": lambda v: isinstance(v, str),
        "list": lambda v: isinstance(v, list),
        "dict": lambda v: isinstance(v, dict),
        "bool": lambda v: isinstance(v, bool),
        "any": lambda v: True,
    }[kind](value)
    if not ok:
        names = {"int": "an int", "number": "a finite number", "str": "a string", "list": "a list",
                 "dict": "an object", "bool": "true or false"}
        raise ValueError(f"{label}: expected {names[kind]}, got {value!r}")
    return value


# --- a frozen dataclass's hash that torch.compile can take while it builds the object ---
#
# The loss path's callables (correction pieces, ``Chain``, ``BatchNormalized``, surrogates) are
# frozen dataclasses, and a training step may build them inside the compiled function
# (``sparse_grpo(..., correction=sparse_rl())``). When dynamo traces such a constructor it keeps
# the new fields in its own side-effect table and leaves the real Python object empty until the
# graph is done. torch 2.11's dynamo then calls the object (``correction(mm)``) and first asks
# whether it is a ``random`` function: ``obj in {random.random, ...}``, which calls ``hash(obj)``.
# ``dataclass``'s generated ``__hash__`` reads the fields, finds none and raises
# ``AttributeError``, which 2.11 does not catch (2.13 catches it): ``InternalTorchDynamoError:
# AttributeError: 'BatchNormalized' object has no attribute 'inner'`` (issue 35).
#
# `compile_safe_hash` replaces that ``__hash__`` by the same hash of the same fields, which raises
# ``TypeError`` (what any unhashable object raises, and what every torch version catches there)
# while the fields are not set yet. A built object hashes and compares exactly as before.

T = TypeVar("T", bound=type)


def _hashed_fields(cls: type) -> tuple[str, ...]:
    # dataclass's rule: a field enters the hash if field.hash is True, or is None and compare is
    return tuple(f.name for f in dataclasses.fields(cls)
                 if (f.compare if f.hash is None else f.hash))


def _field_hash(self: object) -> int:
    try:
        values = tuple(getattr(self, name) for name in type(self).__hashed_fields__)
    except AttributeError:
        raise TypeError(f"unhashable {type(self).__name__}: its fields are not set yet "
                        f"(an object torch.compile is still building)") from None
    return hash(values)


def compile_safe_hash(cls: T) -> T:
    """Class decorator, above ``@dataclass(frozen=True)``: the dataclass hash of the same fields,
    a ``TypeError`` instead of an ``AttributeError`` while they are not set (see module doc)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not (params.frozen and params.eq):
        raise TypeError(f"compile_safe_hash: expected a @dataclass(frozen=True) class, got {cls!r}")
    cls.__hashed_fields__ = _hashed_fields(cls)
    cls.__hash__ = _field_hash
    return cls
