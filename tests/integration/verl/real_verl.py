"""Test-only: import verl 0.9.1 *for real* (its package ``__init__``, ``DataProto``, the worker
configs, ``ppo_loss``) on a CPU machine where verl was installed with ``--no-deps``. Never shipped.

verl's light runtime dependencies must be importable (``tensordict``, ``omegaconf``,
``codetiming``: ``pip install 'sparsecorr-verl[cpu-test]'``, as ``make venv`` does); the tests
that need them skip otherwise. Ray is the one heavy dependency left out: ``verl.protocol``
imports it at module level but and a few modules it pulls in (``verl.single_controller``) only touch ``ray.ObjectRef`` and
decorators on import, so while verl and the modules the tests use import, a stand-in module with that one name is registered when Ray is not
installed, and removed afterwards. verl's plugin discovery runs with
``VERL_USE_EXTERNAL_PLUGINS=none`` so each test decides what loads.

When tests/verl_shim.py already registered verl's packages as bare namespaces (the parity
tests), those entries are dropped first, so verl's ``__init__`` really executes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

NEEDED = ("tensordict", "omegaconf", "codetiming")
PRELOAD = ("verl.trainer.ppo.core_algos", "verl.trainer.ppo.rollout_corr_helper",
           "verl.workers.config", "verl.workers.utils.losses", "verl.utils.tensordict_utils")


def _root() -> Path | None:
    """The installed verl package directory (also when the shim registered a bare ``verl``)."""
    mod = sys.modules.get("verl")
    if mod is not None and getattr(mod, "__path__", None):
        return Path(next(iter(mod.__path__)))
    spec = importlib.util.find_spec("verl")
    return None if spec is None else Path(next(iter(spec.submodule_search_locations)))


def load_verl() -> types.ModuleType:
    """The real ``verl`` package (skips the calling test when verl or its light deps are missing)."""
    mod = sys.modules.get("verl")
    if mod is not None and hasattr(mod, "__version__"):
        return mod
    if _root() is None:
        pytest.skip("verl is not installed (pip install --no-deps 'verl==0.9.1')")
    for name in NEEDED:
        pytest.importorskip(name, reason="pip install 'sparsecorr-verl[cpu-test]'")
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]
    stub = None
    if "ray" not in sys.modules and importlib.util.find_spec("ray") is None:
        stub = types.ModuleType("ray")
        stub.ObjectRef = type("ObjectRef", (), {})
        sys.modules["ray"] = stub
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS")
    os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    try:
        verl = importlib.import_module("verl")
        for name in PRELOAD:  # what the tests use, imported while the stand-in is there
            importlib.import_module(name)
        return verl
    finally:
        if policy is None:
            os.environ.pop("VERL_USE_EXTERNAL_PLUGINS")
        else:
            os.environ["VERL_USE_EXTERNAL_PLUGINS"] = policy
        if stub is not None and sys.modules.get("ray") is stub:
            del sys.modules["ray"]


def verl_source(relative: str) -> str:
    """The text of one of the installed verl's files, e.g. ``trainer/ppo/ray_trainer.py``."""
    return (_root() / relative).read_text()


def source_block(text: str, start: str, end: str) -> str:
    """The lines of ``text`` from the first containing ``start`` through the next containing
    ``end``, dedented (a block of verl's code to execute as verl wrote it)."""
    import textwrap

    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if start in line)
    j = next(k for k in range(i, len(lines)) if end in lines[k])
    return textwrap.dedent("\n".join(lines[i:j + 1]))
