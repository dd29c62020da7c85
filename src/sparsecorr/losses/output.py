"""The result of every loss in `sparsecorr.losses`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LossOutput"]


@dataclass(frozen=True)
class LossOutput:
    r"""A scalar loss, its per-token contributions and detached metrics.

    Attributes:
        loss: 0-d float32 tensor to call ``.backward()`` on (carries the gradient).
        token_loss: ``[B, T]`` float32 per-token loss *before* aggregation (IS weight applied,
            0 where ``mask`` is False); ``loss`` is a weighted sum of it whose weights depend
            on the aggregation mode.
        metrics: stable names -> detached 0-d float32 tensors (no host synchronisation).
        mask: ``[B, T]`` bool, the tokens that entered the loss (input mask minus rejected and
            non-finite tokens); ``None`` when a loss has no per-token mask.
        ratio: the detached importance ratio the surrogate used (``[B, T]``, or ``[B, 1]`` per
            sequence), for a caller that logs it; ``None`` when a loss has none.
        sums: the metrics' 0-d sums and counts (``reduce_metrics(sums, group)`` reduces them
            over data-parallel ranks in one all-reduce); empty with ``metrics="none"``.
        kl: the detached per-token KL penalty term as the loss weighs it before \(\beta\)
            (\(k_3\), times the ratio with ``KLPenalty(bias_correction=True)``), 0 off ``mask``,
            for a caller that logs it; ``None`` when the loss has no penalty.

    Shapes:
        loss: ``[]``; token_loss, mask, kl: ``[B, T]``.
    """

    loss: torch.Tensor
    token_loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    mask: torch.Tensor | None = None
    ratio: torch.Tensor | None = None
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    kl: torch.Tensor | None = None
