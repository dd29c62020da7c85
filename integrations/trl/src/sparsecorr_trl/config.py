"""``SparseCorrConfig`` and the init-time checks that keep the correction on every loss path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparsecorr.correction import get_preset

#: TRL ``loss_type`` -> sparsecorr aggregation (see ``sparsecorr.losses.aggregation``).
AGGREGATION_BY_LOSS_TYPE = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


@dataclass(frozen=True)
class SparseCorrConfig:
    """What the trainer corrects and logs.

    Attributes:
        correction: preset name for ``sparsecorr.correction.get_preset`` (``"sparse_rl"``,
            ``"tis"``, ``"trl:token_mask"``, ``"none"`` ...).
        correction_kwargs: numbers passed to the preset, e.g. ``{"cap": 2.0}``.
        log_metrics: copy the loss's ``mismatch/*`` and ``correction/*`` metrics into TRL's
            logged metrics.
    """

    correction: str = "sparse_rl"
    correction_kwargs: dict[str, Any] = field(default_factory=dict)
    log_metrics: bool = True

    def build(self):
        """The correction object (``None`` for ``"none"``); raises ValueError on a bad name."""
        return get_preset(self.correction, **self.correction_kwargs)


def validate_grpo_args(args: Any) -> str:
    """Reject TRL settings that would bypass the corrected loss; return the aggregation.

    Raises:
        ValueError: ``use_liger_loss=True`` (Liger's fused loss never sees the correction),
            a ``loss_type`` without a sparsecorr aggregation, or sequence-level ratios.
    """
    if getattr(args, "use_liger_loss", False):
        raise ValueError("use_liger_loss: expected False (the Liger fused loss would skip the "
                         "sparse-rollout correction), got True")
    loss_type = getattr(args, "loss_type", "dapo")
    if loss_type not in AGGREGATION_BY_LOSS_TYPE:
        raise ValueError(f"loss_type: expected one of {sorted(AGGREGATION_BY_LOSS_TYPE)}, "
                         f"got {loss_type!r}")
    level = getattr(args, "importance_sampling_level", "token")
    if level != "token":
        raise ValueError(f"importance_sampling_level: expected 'token', got {level!r}")
    return AGGREGATION_BY_LOSS_TYPE[loss_type]
