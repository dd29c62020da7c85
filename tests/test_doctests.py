"""Every docstring example in the library runs (``>>>`` lines are tests)."""

import doctest
import importlib
import pkgutil

import pytest

import sparsecorr

MODULES = sorted(m.name for m in pkgutil.walk_packages(sparsecorr.__path__, "sparsecorr.")
                 if not m.name.startswith("sparsecorr.demo"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_core_layers_have_examples():
    found = 0
    for name in ("sparsecorr.mismatch.record", "sparsecorr.correction.base",
                 "sparsecorr.correction.factories", "sparsecorr.losses.grpo"):
        finder = doctest.DocTestFinder()
        found += sum(len(t.examples) for t in finder.find(importlib.import_module(name)))
    assert found >= 10
