"""The loss path's frozen callables hash as dataclasses do, and an unbuilt one is unhashable.

torch 2.11's dynamo hashes a correction it is still building inside a compiled function (fields
not set yet) and crashed on the ``AttributeError`` the dataclass hash raised (issue 35). Every
frozen-dataclass callable of ``sparsecorr.correction`` and ``sparsecorr.losses`` carries
`compile_safe_hash`, found by walking the modules, so a new piece cannot miss it; the compile
tests (tests/unit/losses/test_compile.py, built inside) show the effect on each torch.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import sparsecorr.correction.base
import sparsecorr.correction.peers
import sparsecorr.correction.presets
import sparsecorr.losses.surrogate
from sparsecorr._checks import _field_hash, compile_safe_hash
from sparsecorr.correction import PRESETS, get_preset

MODULES = (sparsecorr.correction.base, sparsecorr.correction.peers, sparsecorr.correction.presets,
           sparsecorr.losses.surrogate)
CALLABLES = sorted({cls for m in MODULES for _, cls in inspect.getmembers(m, inspect.isclass)
                    if cls.__module__ == m.__name__ and dataclasses.is_dataclass(cls)
                    and cls.__dataclass_params__.frozen and "__call__" in dir(cls)
                    and not cls.__name__.startswith("_")}, key=lambda c: c.__name__)
PRESET_ARGS = {"geo_rs": dict(low=0.5, high=2.0), "divergence": dict(threshold=1.0), "opsm": dict(delta=1e-3)}


def test_the_walk_finds_the_pieces():
    names = {c.__name__ for c in CALLABLES}
    assert {"TIS", "BatchNormalized", "Chain", "Veto", "PPOClip", "GSPO", "VESPO",
            "OpenRLHFCorrection", "TRLCorrection"} <= names


@pytest.mark.parametrize("cls", CALLABLES, ids=lambda c: c.__name__)
def test_every_frozen_callable_has_the_compile_safe_hash(cls):
    assert cls.__hash__ is _field_hash


@pytest.mark.parametrize("cls", CALLABLES, ids=lambda c: c.__name__)
def test_an_object_whose_fields_are_not_set_is_unhashable_not_broken(cls):
    """What dynamo holds while it traces the constructor: an object without its fields. A
    membership test (2.11's ``is_supported_random``) raises TypeError, never AttributeError
    (a class whose fields all have defaults reads them from the class and hashes)."""
    empty = object.__new__(cls)
    required = [f for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    if required:
        with pytest.raises(TypeError, match="fields are not set yet"):
            _ = empty in {1, 2}
    else:
        assert empty not in {1, 2}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_built_correction_hashes_and_compares_as_a_dataclass(name):
    a, b = (get_preset(name, **PRESET_ARGS.get(name, {})) for _ in range(2))
    assert a == b and hash(a) == hash(b)
    fields = tuple(getattr(a, f.name) for f in dataclasses.fields(a) if f.compare)
    assert hash(a) == hash(fields)  # dataclass(frozen=True)'s own hash
    assert len({a, b}) == 1


def test_different_numbers_differ():
    tis = get_preset("tis")
    assert tis != get_preset("tis", cap=3.0) and hash(tis) != hash(get_preset("tis", cap=3.0))


def test_the_decorator_refuses_a_class_that_is_not_a_frozen_dataclass():
    class Plain:
        pass

    with pytest.raises(TypeError, match="frozen"):
        compile_safe_hash(Plain)
    with pytest.raises(TypeError, match="frozen"):
        compile_safe_hash(dataclasses.dataclass(Plain))
