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

import math
from dataclasses import dataclass

import torch

from .._checks import check_choice, compile_safe_hash, count
from .._masks import row_any
from .._ratio import ratio as exp_ratio
from ..mismatch import Mismatch
from .base import Correction, _check_record
from .presets import per_valid, row_log_ratio

__all__ = ["OPENRLHF_GATINGS", "TRL_MODES", "OpenRLHFCorrection", "TRLCorrection"]

TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OPENRLHF_GATINGS = ("ratio", "binary_kl", "tv")


def _filtered_frac(name: str, outside: torch.Tensor, mm: Mismatch) -> dict[str, torch.Tensor]:
    return per_valid(name, count(outside & mm.valid), mm)


@compile_safe_hash
@dataclass(frozen=True)
class TRLCorrection:
    """TRL 1.16's vLLM importance-sampling correction (see the module docstring)."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, TRL_MODES)

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        lr = mm.log_ratio  # [B, T]
        if self.mode.startswith("sequence"):
            lr = row_log_ratio(mm, "sum")[:, None].expand_as(lr)
        ratio = exp_ratio(lr)
        lo = -math.inf if self.clip_min is None else self.clip_min
        hi = math.inf if self.clip_max is None else self.clip_max
        outside = (ratio < lo) | (ratio > hi)
        if self.mode.endswith("truncate"):
            w = ratio.clamp(min=self.clip_min, max=self.clip_max)
            name = "correction/truncated_frac"
        else:
            w = ratio.masked_fill(outside, 0.0)
            name = "correction/band_rejected_frac"
        return Correction(mask=mm.valid, token_weights=torch.where(mm.valid, w, 0.0),
                          piece_metrics=_filtered_frac(name, outside, mm), source=mm)


@compile_safe_hash
@dataclass(frozen=True)
class OpenRLHFCorrection:
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

    def _stat(self, mm: Mismatch) -> torch.Tensor:
        seq = self.level == "seq"
        lr, clean = mm.log_ratio, mm.valid
        if self.gating == "ratio":
            if seq:
                return exp_ratio(row_log_ratio(mm, "mean"))[:, None]
            return exp_ratio(lr)
        p = mm.rollout_logp.detach().float().exp().clamp(1e-6, 1 - 1e-6)
        q = mm.old_logp.detach().float().exp().clamp(1e-6, 1 - 1e-6)
        if self.gating == "binary_kl":
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            stat = (p - q).abs()
        stat = torch.where(clean, stat, 0.0)
        if seq:
            stat = stat.sum(-1, keepdim=True) / count(clean, dim=-1, keepdim=True).clamp(min=1)
        return stat

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        clean = mm.valid
        if self.level == "off":
            return Correction(mask=clean, source=mm)
        low, high = self.threshold
        stat = self._stat(mm)
        if self.mode == "clip":
            w = stat.clamp(min=low, max=high)
            filtered = (stat < low) | (stat > high)
        else:
            keep = (stat >= low) & (stat <= high)
            w = torch.where(keep, exp_ratio(mm.log_ratio), 0.0)
            filtered = ~keep
        filtered = filtered.expand_as(clean)
        if self.level == "seq":
            # OpenRLHF averages over every row; an empty row's statistic is 0/0 = NaN there,
            # which fails the band test, so it counts as filtered (its weight is moot)
            name = "correction/is_filter_ratio"
            rows = torch.full((), float(max(clean.shape[0], 1)), device=clean.device)
            frac = {name: count(filtered[:, 0] | ~row_any(clean)), name + "#n": rows} \
                if clean.shape[-1] else {name: torch.zeros((), device=clean.device)}
        else:
            frac = _filtered_frac("correction/is_filter_ratio", filtered, mm)
        return Correction(mask=clean, token_weights=torch.where(clean, w, 0.0),
                          piece_metrics=frac, source=mm)
