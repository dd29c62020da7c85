"""Test-only import shim for OpenRLHF on a CPU machine. Never shipped in a package.

OpenRLHF 0.11 imports GPU-only packages at module level: ``openrlhf/__init__``-level package
imports pull in the actor (flash-attn, deepspeed, ...), and ``openrlhf/models/utils.py`` does
``import deepspeed`` although the loss code never calls it. On a CPU machine those packages do
not install, so the tests load the *real* ``openrlhf.models.loss`` module this way:

1. if ``deepspeed`` is not importable, an empty stand-in module is registered under that name
   while OpenRLHF's modules import, and removed afterwards (only ``models/utils.py``'s ZeRO-3
   helper would touch it, and the tests never call it);
2. the ``openrlhf`` and ``openrlhf.models`` packages are registered as bare namespace modules
   pointing at the installed directories, so their ``__init__`` files (which import the actor)
   are not executed;
3. ``openrlhf.models.loss`` is then imported normally from the installed files.

The class under test (``PolicyLoss``) is therefore OpenRLHF's own code, unmodified.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from types import ModuleType

__all__ = ["load_openrlhf_loss_module", "load_openrlhf_module", "openrlhf_available"]


def openrlhf_available() -> bool:
    """True when the ``openrlhf`` distribution is installed (its GPU deps need not be)."""
    return importlib.util.find_spec("openrlhf") is not None


def _bare_package(name: str, path: Path) -> ModuleType:
    module = sys.modules.get(name)
    if module is not None:
        return module
    module = types.ModuleType(name)
    module.__path__ = [str(path)]  # a package whose __init__ is never executed
    module.__package__ = name
    sys.modules[name] = module
    return module


def load_openrlhf_loss_module() -> ModuleType:
    """Return the installed ``openrlhf.models.loss`` module without its GPU-only imports.

    Raises:
        ImportError: when openrlhf is not installed.
    """
    if "openrlhf.models.loss" in sys.modules:
        return sys.modules["openrlhf.models.loss"]
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("openrlhf is not installed (pip install --no-deps 'openrlhf>=0.11,<0.12')")
    root = Path(next(iter(spec.submodule_search_locations)))
    if "openrlhf" not in sys.modules:
        _bare_package("openrlhf", root)
    if "openrlhf.models" not in sys.modules:
        _bare_package("openrlhf.models", root / "models")
    with _deepspeed_stub():
        return importlib.import_module("openrlhf.models.loss")


@contextlib.contextmanager
def _deepspeed_stub():
    """Register an empty ``deepspeed`` only while OpenRLHF's modules import, then remove it, so
    that later imports (e.g. TRL's ``is_deepspeed_available``) do not see a fake package."""
    inserted = importlib.util.find_spec("deepspeed") is None and "deepspeed" not in sys.modules
    if inserted:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    try:
        yield
    finally:
        if inserted:
            sys.modules.pop("deepspeed", None)


def load_openrlhf_module(name: str) -> ModuleType:
    """Import ``openrlhf.<...>`` (e.g. ``openrlhf.trainer.ppo_utils.experience``) the same way:
    every parent package is registered bare, so only the module's own imports run."""
    load_openrlhf_loss_module()
    root = Path(sys.modules["openrlhf"].__path__[0])
    parts = name.split(".")
    _bare_package("openrlhf.utils", root / "utils")  # its __init__ pulls optional deps
    for i in range(2, len(parts)):
        pkg = ".".join(parts[:i])
        _bare_package(pkg, root.joinpath(*parts[1:i]))
    with _deepspeed_stub():
        return importlib.import_module(name)
