"""Test-only import shim for verl 0.9 on a CPU machine without its heavy deps. Never shipped.

verl's package ``__init__`` imports ``verl.protocol`` (Ray, tensordict), and the two modules the
parity tests need, ``verl.trainer.ppo.rollout_corr_helper`` (rollout IS weights, rejection
masks, batch normalisation) and ``verl.trainer.ppo.core_algos`` (policy losses, ``agg_loss``),
import config packages that pull in omegaconf, hydra and the worker configs. The dev setup
installs verl with ``pip install --no-deps`` (see the Makefile), so the tests load the *real*
modules this way:

1. the packages ``verl``, ``verl.utils``, ``verl.trainer``, ``verl.trainer.ppo`` are
   registered as bare namespace modules pointing at the installed directories, so their
   ``__init__`` files are not executed;
2. while verl's modules import, stand-ins are registered for names used only in type hints or
   ``isinstance`` checks of code paths the tests never take: ``tensordict.TensorDict``,
   ``omegaconf.DictConfig``, ``verl.protocol.DataProto``, ``verl.trainer.config`` (``AlgoConfig``,
   ``RolloutCorrectionConfig``) and ``verl.workers.config`` (``ActorConfig``,
   ``PolicyLossConfig``); they are removed from ``sys.modules`` afterwards;
3. the modules are then imported normally from the installed files.

The functions under test are therefore verl's own code, unmodified.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from types import ModuleType

__all__ = ["load_verl_module", "verl_available"]

_NEEDED = ("verl.trainer.ppo.rollout_corr_helper", "verl.trainer.ppo.core_algos")


def verl_available() -> bool:
    """True when the ``verl`` distribution is installed (its heavy deps need not be)."""
    return importlib.util.find_spec("verl") is not None


def _bare_package(name: str, path: Path) -> None:
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    module.__path__ = [str(path)]  # a package whose __init__ is never executed
    module.__package__ = name
    sys.modules[name] = module


def _stub(name: str, **attrs: object) -> ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


class _StandIn:
    """A class only named in annotations / isinstance checks of paths the tests do not take."""

    @classmethod
    def from_dict(cls, tensors: dict) -> dict:  # DataProto.from_dict: keep the tensors visible
        return dict(tensors)


@contextlib.contextmanager
def _stand_ins():
    names = {
        "tensordict": {"TensorDict": type("TensorDict", (_StandIn,), {})},
        "omegaconf": {"DictConfig": type("DictConfig", (_StandIn,), {})},
        "verl.protocol": {"DataProto": type("DataProto", (_StandIn,), {})},
        "verl.trainer.config": {"AlgoConfig": type("AlgoConfig", (_StandIn,), {})},
        "verl.trainer.config.algorithm": {
            "RolloutCorrectionConfig": type("RolloutCorrectionConfig", (_StandIn,), {})},
        "verl.workers.config": {"ActorConfig": type("ActorConfig", (_StandIn,), {})},
        "verl.workers.config.actor": {
            "PolicyLossConfig": type("PolicyLossConfig", (_StandIn,), {})},
    }
    inserted = []
    for name, attrs in names.items():
        real_exists = name in sys.modules or (
            "." not in name and importlib.util.find_spec(name) is not None)
        if not real_exists:
            sys.modules[name] = _stub(name, **attrs)
            inserted.append(name)
    try:
        yield
    finally:
        for name in inserted:
            sys.modules.pop(name, None)


def load_verl_module(name: str) -> ModuleType:
    """Return the installed ``verl.<...>`` module ``name`` (one of the two the tests need).

    Raises:
        ImportError: when verl is not installed.
    """
    if name not in _NEEDED:
        raise ValueError(f"name: expected one of {_NEEDED}, got {name!r}")
    if name in sys.modules:
        return sys.modules[name]
    if "verl" in sys.modules:
        root = Path(sys.modules["verl"].__path__[0])
    else:
        spec = importlib.util.find_spec("verl")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("verl is not installed (pip install --no-deps 'verl==0.9.1')")
        root = Path(next(iter(spec.submodule_search_locations)))
    for pkg in ("verl", "verl.utils", "verl.trainer", "verl.trainer.ppo", "verl.workers"):
        _bare_package(pkg, root.joinpath(*pkg.split(".")[1:]))
    with _stand_ins():
        groupwise = importlib.import_module("verl.utils.groupwise")
        utils = sys.modules["verl.utils"]
        for attr in ("as_torch_index", "group_mean_std"):  # what core_algos takes from verl.utils
            setattr(utils, attr, getattr(groupwise, attr))
        return importlib.import_module(name)
