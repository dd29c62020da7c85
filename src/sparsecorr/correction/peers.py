"""Presets that reproduce the corrections of peer trainers exactly, on the same inputs.

Both peers give an out-of-band token weight 0 but keep it in the loss denominator; these
presets do the same (their ``mask`` is the input mask minus non-finite tokens, and the weight
carries the rejection), so a user can switch to sparsecorr without changing behaviour, then
move to ``sparse_rl()`` or ``sparse_tail()``, which drop rejected tokens from the denominator.

Definitional differences kept on purpose (shared/BASELINES.md):

- **TRL 1.16** ``vllm_importance_sampling_mode``: token ratio \\(e^{\\ell_t}\\) or sequence
  product \\(e^{\\sum_t \\ell_t}\\) (TRL does not clamp the sum; we clamp at ±20 like every
  sparsecorr ratio, so extreme sums differ: TRL would overflow there); ``*_truncate`` clamps to
  ``[clip_min, clip_max]`` (``clip_min=None``: no floor); ``*_mask`` sets the weight to 0
  outside the band. TRL's default mode is ``sequence_mask`` with ``clip_max = 3``.
- **OpenRLHF 0.11** ``PolicyLoss``: the gate reads a statistic per unit — the token ratio, the
  sequence's *geometric-mean* ratio, or the sampled-token binary KL / total variation between
  the rollout and dense probabilities (token, or sequence mean); ``mask`` keeps each surviving
  token's *own* ratio as its weight, ``clip`` clamps the token ratio to the band (both ends).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_choice, count
from .base import CorrectionInputs
from .presets import _Piece

__all__ = ["OPENRLHF_GATINGS", "TRL_MODES", "OpenRLHFCorrection", "TRLCorrection", "openrlhf", "trl"]

TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OPENRLHF_GATINGS = ("ratio", "binary_kl", "tv")


@dataclass(frozen=True)
class TRLCorrection(_Piece):
    """TRL 1.16's vLLM importance-sampling correction (see the module docstring)."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, TRL_MODES)

    def transform(self, inputs: CorrectionInputs, lr: torch.Tensor, clean: torch.Tensor):
        if self.mode.startswith("sequence"):
            lr = lr.sum(-1, keepdim=True).clamp(-20.0, 20.0).expand_as(lr)
        ratio = lr.exp()
        lo = -torch.inf if self.clip_min is None else self.clip_min
        hi = torch.inf if self.clip_max is None else self.clip_max
        outside = (ratio < lo) | (ratio > hi)
        if self.mode.endswith("truncate"):
            w = ratio.clamp(min=self.clip_min, max=self.clip_max)
            extra = {"correction/truncated_frac": count(clean & outside) / count(clean).clamp(min=1)}
        else:
            w = ratio.masked_fill(outside, 0.0)
            extra = {"correction/band_rejected_frac": count(clean & outside) / count(clean).clamp(min=1)}
        return w, clean, extra


def trl(mode: str = "sequence_mask", clip_min: float | None = None, clip_max: float | None = 3.0) -> TRLCorrection:
    """TRL 1.16 ``vllm_importance_sampling_mode`` (default ``sequence_mask``, ``clip_max=3``)."""
    return TRLCorrection(mode=mode, clip_min=clip_min, clip_max=clip_max)


@dataclass(frozen=True)
class OpenRLHFCorrection(_Piece):
    """OpenRLHF 0.11 ``PolicyLoss`` correction (``is_correction_*``; see the module docstring)."""

    level: str = "token"
    mode: str = "mask"
    gating: str = "ratio"
    threshold: tuple[float, float] = (0.5, 5.0)

    def __post_init__(self) -> None:
        check_choice("level", self.level, ("off", "token", "seq"))
        check_choice("mode", self.mode, ("mask", "clip"))
        check_choice("gating", self.gating, OPENRLHF_GATINGS)
        if len(tuple(self.threshold)) != 2:
            raise ValueError(f"threshold: expected (low, high), got {self.threshold!r}")
        if self.mode == "clip" and (self.level == "seq" or self.gating != "ratio"):
            raise ValueError("mode: 'clip' requires level='token' and gating='ratio' (as OpenRLHF)")
        if self.gating != "ratio" and self.level != "off" and self.threshold[0] > 0:
            raise ValueError(f"threshold: gating={self.gating!r} takes an upper bound only "
                             f"(low must be <= 0), got {self.threshold!r}")

    def _stat(self, inputs: CorrectionInputs, lr: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        seq = self.level == "seq"
        if self.gating == "ratio":
            if seq:
                return (lr.sum(-1, keepdim=True) / clean.sum(-1, keepdim=True).clamp(min=1)).exp()
            return lr.exp()
        p = inputs.rollout_logp.detach().float().exp().clamp(1e-6, 1 - 1e-6)
        q = inputs.old_logp.detach().float().exp().clamp(1e-6, 1 - 1e-6)
        if self.gating == "binary_kl":
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            stat = (p - q).abs()
        stat = torch.where(clean, stat, 0.0)
        if seq:
            stat = stat.sum(-1, keepdim=True) / clean.sum(-1, keepdim=True).clamp(min=1)
        return stat

    def transform(self, inputs: CorrectionInputs, lr: torch.Tensor, clean: torch.Tensor):
        if self.level == "off":
            return clean.float(), clean, {}
        low, high = self.threshold
        stat = self._stat(inputs, lr, clean)
        if self.mode == "clip":
            w = stat.clamp(min=low, max=high)
            filtered = (stat < low) | (stat > high)
        else:
            keep = (stat >= low) & (stat <= high)
            w = torch.where(keep, lr.exp(), 0.0)
            filtered = ~keep
        filtered = filtered.expand_as(lr)
        if self.level == "seq":
            # OpenRLHF averages over every row; an empty row's statistic is 0/0 = NaN there,
            # which fails the band test, so it counts as filtered (its weight is moot)
            frac = (filtered[:, 0] | ~clean.any(-1)).float().mean()
        else:
            frac = count(filtered & clean) / count(clean).clamp(min=1)
        return w, clean, {"correction/is_filter_ratio": frac}


def openrlhf(
    level: str = "token", mode: str = "mask", gating: str = "ratio",
    threshold: tuple[float, float] = (0.5, 5.0),
) -> OpenRLHFCorrection:
    """OpenRLHF 0.11 ``PolicyLoss(is_correction_level, _mode, _gating, _threshold)``."""
    return OpenRLHFCorrection(level=level, mode=mode, gating=gating, threshold=tuple(threshold))
