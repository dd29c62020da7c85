"""Fixtures of the verl glue tests: the real verl (tests/integration/verl/real_verl.py) and the
installed plugin."""

from __future__ import annotations

import pytest

from tests.integration.verl.real_verl import load_verl


@pytest.fixture(scope="module")
def verl():
    return load_verl()


@pytest.fixture
def plugin(verl):
    import importlib

    mod = importlib.import_module("sparsecorr_verl.plugin")
    mod.install()
    yield mod
    mod.install()  # a test may have uninstalled it
