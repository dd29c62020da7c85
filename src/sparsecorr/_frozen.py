"""A frozen dataclass's hash that ``torch.compile`` can take while it builds the object.

The loss path's callables (correction pieces, ``Chain``, ``BatchNormalized``, surrogates) are
frozen dataclasses, and a training step may build them inside the compiled function
(``sparse_grpo(..., correction=sparse_rl())``). When dynamo traces such a constructor it keeps
the new fields in its own side-effect table and leaves the real Python object empty until the
graph is done. torch 2.11's dynamo then calls the object (``correction(mm)``) and first asks
whether it is a ``random`` function: ``obj in {random.random, ...}``, which calls ``hash(obj)``.
``dataclass``'s generated ``__hash__`` reads the fields, finds none and raises
``AttributeError``, which 2.11 does not catch (2.13 catches it): ``InternalTorchDynamoError:
AttributeError: 'BatchNormalized' object has no attribute 'inner'`` (issue 35).

`compile_safe_hash` replaces that ``__hash__`` by the same hash of the same fields, which raises
``TypeError`` (what any unhashable object raises, and what every torch version catches there)
while the fields are not set yet. A built object hashes and compares exactly as before.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

__all__ = ["compile_safe_hash"]

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
