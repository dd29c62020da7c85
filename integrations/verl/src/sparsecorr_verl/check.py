"""What this glue was tested against, and the check that runs before it touches verl.

The plugin plugs into two of verl's functions by name; when verl changes one of them the glue
must say so loudly instead of training with a half-installed plugin (verl logs a plugin's
import error at DEBUG only). `verl_problems` lists every difference from the tested verl:

- the installed version (``TESTED_VERL``) — a different one is reported, and the plugin still
  loads when the hooks below match;
- the parameters of ``core_algos.register_policy_loss`` / the registry, of the ``vanilla``
  policy loss (the signature ``ppo_loss`` calls every registered loss with) and of
  ``rollout_corr_helper.compute_rollout_correction_and_add_to_batch`` (the driver's call) —
  any difference makes `check_verl` raise, so nothing is installed.
"""

from __future__ import annotations

import inspect
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

__all__ = ["LOSS_PARAMS", "ROLLOUT_CORRECTION_PARAMS", "TESTED_VERL", "VerlMismatchError",
           "check_verl", "verl_problems"]

TESTED_VERL = "0.9.1"
#: ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``
LOSS_PARAMS = ("old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config",
               "rollout_is_weights")
ROLLOUT_CORRECTION_PARAMS = ("batch", "rollout_corr_config")


class VerlMismatchError(ImportError):
    """The installed verl's hooks are not the ones this glue was tested with."""


def _params(fn: object) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def installed_verl_version() -> str | None:
    """The installed verl distribution's version, or None when it is not installed."""
    try:
        return version("verl")
    except PackageNotFoundError:
        return None


def verl_problems(core_algos: ModuleType, rollout_corr_helper: ModuleType, *,
                  installed: str | None = None) -> tuple[list[str], list[str]]:
    """``(version_notes, hook_errors)``: how the installed verl differs from the tested one.

    Args:
        core_algos: ``verl.trainer.ppo.core_algos``.
        rollout_corr_helper: ``verl.trainer.ppo.rollout_corr_helper``.
        installed: the version to check (default: the installed distribution's).
    """
    notes, errors = [], []
    v = installed if installed is not None else installed_verl_version()
    if v != TESTED_VERL:
        notes.append(f"verl {v} is installed; sparsecorr-verl was tested with verl {TESTED_VERL}")
    for name in ("register_policy_loss", "get_policy_loss_fn", "POLICY_LOSS_REGISTRY",
                 "compute_policy_loss_vanilla"):
        if not hasattr(core_algos, name):
            errors.append(f"verl.trainer.ppo.core_algos.{name} is missing")
    vanilla = getattr(core_algos, "compute_policy_loss_vanilla", None)
    if vanilla is not None and _params(vanilla) != LOSS_PARAMS:
        errors.append(f"the policy-loss signature changed: expected {LOSS_PARAMS}, "
                      f"got {_params(vanilla)} (compute_policy_loss_vanilla)")
    hook = getattr(rollout_corr_helper, "compute_rollout_correction_and_add_to_batch", None)
    if hook is None:
        errors.append("verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_"
                      "to_batch is missing")
    else:
        original = getattr(hook, "__wrapped__", hook)  # our own wrapper keeps verl's signature
        if _params(original) != ROLLOUT_CORRECTION_PARAMS:
            errors.append(f"the rollout-correction hook's signature changed: expected "
                          f"{ROLLOUT_CORRECTION_PARAMS}, got {_params(original)} "
                          "(compute_rollout_correction_and_add_to_batch)")
    return notes, errors


def check_verl(core_algos: ModuleType, rollout_corr_helper: ModuleType, *,
               installed: str | None = None) -> list[str]:
    """Raise `VerlMismatchError` when a hook differs; return the version notes otherwise."""
    notes, errors = verl_problems(core_algos, rollout_corr_helper, installed=installed)
    if errors:
        raise VerlMismatchError(
            "sparsecorr-verl cannot plug into this verl: " + "; ".join(errors + notes)
            + f". Install verl=={TESTED_VERL} or a sparsecorr-verl release that supports yours.")
    return notes
