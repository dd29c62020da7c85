"""The verl plugin: importing this module plugs sparsecorr into verl, loudly.

verl 0.9.1 loads every entry point of the group ``verl.plugins`` at ``import verl`` (in the
driver, the TaskRunner and every Ray worker), but logs a failing plugin at DEBUG only. So this
module never fails quietly:

- `install` first checks the installed verl against the tested one (`check_verl`): a different
  version is logged at WARNING; a changed hook signature raises `VerlMismatchError`, logged at
  WARNING here before verl can swallow it, and nothing is installed;
- then it registers the policy loss ``sparsecorr`` and the advantage estimator
  ``sparsecorr_grpo`` (`sparsecorr_verl.advantage`: GRPO with the rows the correction vetoed
  whole left out of the group statistics) in verl's registries, and wraps
  ``rollout_corr_helper.compute_rollout_correction_and_add_to_batch`` (logged at INFO). The
  wrapper only acts when ``algorithm.rollout_correction.sparsecorr`` is set; `uninstall`
  restores verl's function;
- and it registers the rollout backend ``sparsecorr`` (``rollout.name=sparsecorr``): the
  replica in ``RolloutReplicaRegistry`` (loaded lazily) and the in-worker adapter in
  ``_ROLLOUT_REGISTRY[("sparsecorr", "async")]``. verl's rollout modules import Ray, so without
  Ray (which verl needs to run at all) only the loss and the correction are installed (logged
  at INFO); a verl without those two registries gets a WARNING.

Set ``SPARSECORR_VERL_STRICT=1`` to make the import raise on a version difference too, and
``SPARSECORR_VERL_NO_AUTOLOAD=1`` to import this module without installing (then call
`install` yourself).

Modules that bind verl's function by name (``from ... import
compute_rollout_correction_and_add_to_batch``, verl's v1 trainer) get the wrapper when they are
imported after the plugin (verl loads plugins at ``import verl``, before any trainer module);
one already imported is patched too. verl's main trainer (``ray_trainer.py``) imports the
function inside ``fit`` on every step, so it always sees the module attribute.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
from typing import Any

from . import advantage
from .check import check_verl
from .correction import driver_spec, rollout_correction
from .loss import LOSS_MODE, sparsecorr_policy_loss

__all__ = ["ROLLOUT_NAME", "install", "installed", "rollout_registered", "uninstall"]

logger = logging.getLogger("sparsecorr_verl")
_HOOK = "compute_rollout_correction_and_add_to_batch"
_MARK = "_sparsecorr_original"
# modules that bound verl's function by name at import (the v1 trainer); patched when loaded
_BOUND_BY_NAME = ("verl.trainer.ppo.v1.trainer_base",)
ROLLOUT_NAME = "sparsecorr"
_ADAPTER = "sparsecorr_verl.rollout.adapter.SparseCorrServerAdapter"


def _load_replica():
    """verl's replica loader for ``rollout.name=sparsecorr`` (imports the replica on first use)."""
    from .rollout.replica import SparseCorrReplica

    return SparseCorrReplica


def _ray_available() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except ValueError:  # a stand-in module without a spec
        return False


def _rollout_registries():
    from verl.workers.rollout import base, replica

    return replica.RolloutReplicaRegistry, base._ROLLOUT_REGISTRY


def _register_rollout() -> bool:
    """Register ``rollout.name=sparsecorr`` in verl's two rollout registries."""
    if not _ray_available():
        logger.info("sparsecorr-verl: rollout backend %r not registered (Ray is not installed)", ROLLOUT_NAME)
        return False
    replicas, adapters = _rollout_registries()
    if not hasattr(replicas, "register") or not isinstance(adapters, dict):
        logger.warning("sparsecorr-verl: rollout backend %r NOT registered: this verl has no "
                       "RolloutReplicaRegistry.register / _ROLLOUT_REGISTRY", ROLLOUT_NAME)
        return False
    replicas.register(ROLLOUT_NAME, _load_replica)
    adapters[(ROLLOUT_NAME, "async")] = _ADAPTER
    logger.info("sparsecorr-verl: registered rollout backend %r (actor_rollout_ref.rollout.name=%s)",
                ROLLOUT_NAME, ROLLOUT_NAME)
    return True


def rollout_registered() -> bool:
    """True when ``rollout.name=sparsecorr`` resolves in verl's registries."""
    if not _ray_available():
        return False
    replicas, adapters = _rollout_registries()
    return replicas._registry.get(ROLLOUT_NAME) is _load_replica and \
        adapters.get((ROLLOUT_NAME, "async")) == _ADAPTER


def _verl_modules():
    from verl.trainer.ppo import core_algos, rollout_corr_helper

    return core_algos, rollout_corr_helper


def _wrap(original):
    @functools.wraps(original)
    def compute_rollout_correction_and_add_to_batch(batch: Any, rollout_corr_config: Any):
        spec = driver_spec(rollout_corr_config)
        if spec is None:
            return original(batch, rollout_corr_config)
        return rollout_correction(batch, spec)

    setattr(compute_rollout_correction_and_add_to_batch, _MARK, original)
    return compute_rollout_correction_and_add_to_batch


def installed() -> bool:
    """True when verl's rollout-correction function is the sparsecorr wrapper."""
    _, rc = _verl_modules()
    return hasattr(getattr(rc, _HOOK, None), _MARK)


def install(*, strict: bool | None = None) -> None:
    """Check verl, register ``loss_mode="sparsecorr"`` and ``algorithm.adv_estimator=
    "sparsecorr_grpo"``, wrap the rollout correction and
    register ``rollout.name="sparsecorr"`` (when Ray is installed).

    Idempotent. Raises `VerlMismatchError` on a changed hook (and, with ``strict``, on a
    different verl version); logs every step.
    """
    strict = os.environ.get("SPARSECORR_VERL_STRICT", "0") == "1" if strict is None else strict
    core_algos, rc = _verl_modules()
    for note in check_verl(core_algos, rc):
        if strict:
            from .check import VerlMismatchError

            raise VerlMismatchError(f"{note} (SPARSECORR_VERL_STRICT=1)")
        logger.warning("sparsecorr-verl: %s; the hooks match, loading anyway", note)
    core_algos.register_policy_loss(LOSS_MODE)(sparsecorr_policy_loss)
    advantage.register(core_algos)
    _register_rollout()
    if hasattr(getattr(rc, _HOOK), _MARK):
        return
    wrapper = _wrap(getattr(rc, _HOOK))
    setattr(rc, _HOOK, wrapper)
    for name in _BOUND_BY_NAME:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, _HOOK, None) is getattr(wrapper, _MARK):
            setattr(mod, _HOOK, wrapper)
    logger.info("sparsecorr-verl: registered policy loss %r, advantage estimator %r and wrapped "
                "verl.trainer.ppo.rollout_corr_helper.%s (active when algorithm.rollout_correction."
                "sparsecorr is set; sparsecorr_verl.plugin.uninstall() restores it)", LOSS_MODE,
                advantage.ADV_ESTIMATOR, _HOOK)


def uninstall() -> None:
    """Restore verl's rollout-correction function and drop the ``sparsecorr`` loss and the
    ``sparsecorr_grpo`` estimator."""
    core_algos, rc = _verl_modules()
    wrapper = getattr(rc, _HOOK, None)
    original = getattr(wrapper, _MARK, None)
    if original is not None:
        setattr(rc, _HOOK, original)
        for name in _BOUND_BY_NAME:
            mod = sys.modules.get(name)
            if mod is not None and getattr(mod, _HOOK, None) is wrapper:
                setattr(mod, _HOOK, original)
    core_algos.POLICY_LOSS_REGISTRY.pop(LOSS_MODE, None)
    advantage.unregister(core_algos)
    if _ray_available():
        replicas, adapters = _rollout_registries()
        if getattr(replicas, "_registry", {}).get(ROLLOUT_NAME) is _load_replica:
            replicas._registry.pop(ROLLOUT_NAME)
        if adapters.get((ROLLOUT_NAME, "async")) == _ADAPTER:
            adapters.pop((ROLLOUT_NAME, "async"))
    logger.info("sparsecorr-verl: restored verl's %s and removed policy loss %r", _HOOK, LOSS_MODE)


def _load() -> None:
    """What the entry point runs: `install`, and a WARNING (then the error) when it fails."""
    try:
        install()
    except Exception as exc:
        logger.warning("sparsecorr-verl plugin NOT loaded (loss_mode=%r and "
                       "algorithm.rollout_correction.%s will not work): %s: %s", LOSS_MODE,
                       "sparsecorr", type(exc).__name__, exc)
        raise


if os.environ.get("SPARSECORR_VERL_NO_AUTOLOAD", "0") != "1":
    _load()
