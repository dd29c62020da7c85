"""Install `SparsePolicyLoss` into OpenRLHF's PPO actor: one call, or process-wide.

- `use_sparsecorr` swaps the ``actor_loss_fn`` of one ``ActorPPOTrainer`` (or any object with
  that attribute and a ``training_step(experience, ...)`` method), keeping its clip and
  aggregation settings, and routes sparsecorr's metrics into ``experience.info`` so they reach
  OpenRLHF's loggers (wandb / tensorboard via its status dict).
- `install` patches ``ActorPPOTrainer.__init__`` so every trainer created afterwards in this
  process uses it; `setup_worker` does the same in Ray worker processes from the
  ``SPARSECORR_OPENRLHF`` environment variable (the launcher sets both).
"""

from __future__ import annotations

import json
import os
from typing import Any

from sparsecorr.correction import CorrectionFn, get_preset

from ._version import check_openrlhf_version
from .loss import SparsePolicyLoss

__all__ = ["ENV_VAR", "correction_from_spec", "install", "setup_worker", "use_sparsecorr"]

ENV_VAR = "SPARSECORR_OPENRLHF"
_PATCHED_ATTR = "_sparsecorr_patched"


def correction_from_spec(spec: dict[str, Any]) -> CorrectionFn | None:
    """``{"name": "sparse_rl", "numbers": {"cap": 1.5}}`` -> the preset (ValueError if bad)."""
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(f"spec: expected a dict with a 'name' key, got {spec!r}")
    return get_preset(str(spec["name"]), **dict(spec.get("numbers") or {}))


def use_sparsecorr(
    trainer: Any,
    correction: CorrectionFn | str | None = "sparse_rl",
    *,
    metrics_quantiles: tuple[float, ...] = (0.01, 0.05, 0.5),
    check_version: bool = True,
) -> SparsePolicyLoss:
    """Replace ``trainer.actor_loss_fn`` by a `SparsePolicyLoss` with ``correction``.

    The trainer's clip range, dual clip, aggregation and loss type are kept; ``correction`` may
    be a callable, a preset name, or None to keep OpenRLHF's own ``is_correction_*`` settings.

    Returns:
        the installed loss (its ``last_metrics`` hold the latest metrics).
    """
    if check_version:
        check_openrlhf_version()
    old = getattr(trainer, "actor_loss_fn", None)
    if old is None:
        raise ValueError(f"trainer: expected an OpenRLHF ActorPPOTrainer with actor_loss_fn, got {type(trainer).__name__}")
    kwargs = {k: getattr(old, k) for k in (
        "clip_eps_low", "clip_eps_high", "dual_clip", "token_level_loss", "policy_loss_type",
        "is_correction_level", "is_correction_mode", "is_correction_gating",
        "is_correction_threshold") if hasattr(old, k)}
    if correction is not None:  # sparsecorr's correction replaces OpenRLHF's (no double correction)
        kwargs["is_correction_level"] = "off"
    loss = SparsePolicyLoss(**kwargs, correction=correction, metrics_quantiles=metrics_quantiles)
    trainer.actor_loss_fn = loss
    original_step = trainer.training_step

    def training_step(experience: Any, *args: Any, **kw: Any) -> Any:
        loss.info = getattr(experience, "info", None)
        try:
            return original_step(experience, *args, **kw)
        finally:
            loss.info = None

    trainer.training_step = training_step
    return loss


def install(spec: dict[str, Any]) -> None:
    """Patch ``ActorPPOTrainer.__init__`` in this process so every trainer uses sparsecorr."""
    check_openrlhf_version()
    correction_from_spec(spec)  # validate before touching OpenRLHF
    from openrlhf.trainer.ray import ppo_actor

    cls = ppo_actor.ActorPPOTrainer
    if getattr(cls, _PATCHED_ATTR, False):
        return
    original_init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        use_sparsecorr(self, correction_from_spec(spec),
                       metrics_quantiles=tuple(spec.get("quantiles", (0.01, 0.05, 0.5))),
                       check_version=False)

    cls.__init__ = __init__
    setattr(cls, _PATCHED_ATTR, True)


def setup_worker() -> None:
    """Ray ``worker_process_setup_hook``: install from ``$SPARSECORR_OPENRLHF`` if set."""
    raw = os.environ.get(ENV_VAR)
    if raw:
        install(json.loads(raw))
