"""The public way to build a correction: one factory per method, the paper's numbers as defaults.

Every factory validates its numbers (a ``ValueError`` names the argument), so a setting that
would make the loss silently zero or constant is refused before any batch is seen.
"""

from __future__ import annotations

import math

from .._checks import check_choice, check_number, check_probability
from .base import CorrectionFn, chain
from .peers import OPENRLHF_GATINGS, TRL_MODES, OpenRLHFCorrection, TRLCorrection
from .presets import (
    LEVELS,
    OPSM,
    TIS,
    BandMask,
    BatchNormalized,
    Divergence,
    SequenceIS,
    TailReject,
    Veto,
)

__all__ = [
    "batch_normalized",
    "divergence",
    "geo_rs",
    "icepop",
    "mis",
    "openrlhf",
    "opsm",
    "sequence_is",
    "sparrow",
    "sparse_rl",
    "sparse_tail",
    "tis",
    "trl",
    "veto",
]


def _band(low: object, high: object, *, names: tuple[str, str] = ("low", "high")) -> None:
    check_number(names[0], low, low=0)
    if high != math.inf:  # an open-ended band is allowed
        check_number(names[1], high, low=0, low_open=True)
    if not low < high:  # type: ignore[operator]
        raise ValueError(f"{names[0]}, {names[1]}: expected {names[0]} < {names[1]}, got "
                         f"{names[0]}={low!r}, {names[1]}={high!r}")


def _cap(cap: object, floor: object) -> None:
    check_number("floor", floor, low=0)
    check_number("cap", cap, low=0, low_open=True, allow_none=True)
    if cap is not None and not cap > floor:  # type: ignore[operator]
        raise ValueError(f"cap: expected None or a number > floor ({floor!r}), got {cap!r}")


def tis(cap: float | None = 2.0, floor: float = 0.0) -> TIS:
    """Truncated token IS ``w_t = clamp(r_t, floor, cap)``, cap 2 (Yao et al., "Your efficient RL
    framework secretly brings you off-policy RL training", 2025)."""
    _cap(cap, floor)
    return TIS(cap=cap, floor=floor)


def sequence_is(reduce: str = "mean", cap: float | None = None, floor: float = 0.0) -> SequenceIS:
    """Sequence IS: ``reduce="sum"`` is the product of the (±20-clamped) token ratios, its log
    clamped to ±20 again (vanishes on long outputs, TRL #5814); ``"mean"`` (default) the
    geometric mean."""
    check_choice("reduce", reduce, ("sum", "mean"))
    _cap(cap, floor)
    return SequenceIS(reduce=reduce, cap=cap, floor=floor)


def mis(low: float = 0.5, high: float = 2.0, level: str = "token") -> BandMask:
    """Masked IS: weight ``r`` kept only inside ``[low, high]``, else dropped (METHODS §4)."""
    _band(low, high)
    check_choice("level", level, LEVELS)
    return BandMask(low=low, high=high, level=level, reweight=True)


def icepop(low: float = 0.5, high: float = 5.0) -> BandMask:
    """IcePop (Ring-1T, 2025): tokens inside [0.5, 5] kept with weight 1, others dropped."""
    _band(low, high)
    return BandMask(low=low, high=high, level="token", reweight=False)


def geo_rs(low: float, high: float) -> BandMask:
    """Geometric rejection sampling: keep sequences whose geometric-mean ratio is in
    ``[low, high]``, weight 1. No published default: both bounds are required."""
    _band(low, high)
    return BandMask(low=low, high=high, level="geometric", reweight=False)


def veto(threshold: float = 1e-4) -> Veto:
    """Sequence veto at ratio ``threshold`` (Sparse-RL, Luo et al., ACL 2026: 1e-4)."""
    check_number("threshold", threshold, low=0, low_open=True)
    return Veto(threshold=threshold)


def divergence(threshold: float, estimator: str = "k3", reduce: str = "max") -> Divergence:
    """k2/k3 sequence rejection (verl ``rollout_rs`` ``seq_max_k3``, ``seq_mean_k2``, ...)."""
    check_number("threshold", threshold, low=0)
    check_choice("estimator", estimator, ("k2", "k3"))
    check_choice("reduce", reduce, ("max", "mean"))
    return Divergence(threshold=threshold, estimator=estimator, reduce=reduce)


def opsm(delta: float) -> OPSM:
    """Off-policy sequence masking (DeepSeek-V3.2, 2025) with drift threshold ``delta``."""
    check_number("delta", delta, low=0)
    return OPSM(delta=delta)


def batch_normalized(inner: CorrectionFn, *, group: object | None = None) -> BatchNormalized:
    """Rescale ``inner``'s weights so their mean over the kept tokens of the batch (of every rank
    of ``group``) is 1, as Sparse-RL does."""
    if not callable(inner):
        raise ValueError(f"inner: expected a callable Mismatch -> Correction, got {type(inner).__name__}")
    return BatchNormalized(inner, group=group)


def sparse_rl(*, cap: float = 1.5, low: float = 0.5, high: float = 1.5, veto_threshold: float = 1e-4,
              group: object | None = None) -> BatchNormalized:
    """Sparse-RL's released correction (Luo et al., ACL 2026, arXiv 2601.10079, METHODS §1):
    token TIS cap 1.5, token band [0.5, 1.5], veto 1e-4, then batch normalisation so the mean
    kept weight is 1 (over ``group`` when given). It *is* the composition
    ``batch_normalized(chain(tis(cap), icepop(low, high), veto(veto_threshold)), group=group)``.

    Example:
        >>> import torch
        >>> from sparsecorr.correction import sparse_rl
        >>> from sparsecorr.mismatch import measure
        >>> roll = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
        >>> old = torch.log(torch.tensor([[0.6, 0.4, 0.5], [0.5, 1e-6, 0.5]]))
        >>> c = sparse_rl()(measure(old, roll, torch.ones(2, 3, dtype=torch.bool)))
        >>> c.mask.tolist()  # row 1 vetoed: one ratio is 2e-6 < 1e-4
        [[True, True, True], [False, False, False]]
        >>> c.weights[0]  # ratios 1.2, 0.8, 1.0, mean already 1
        tensor([1.2000, 0.8000, 1.0000])
    """
    _cap(cap, 0.0)
    _band(low, high)
    check_number("veto_threshold", veto_threshold, low=0, low_open=True)
    return BatchNormalized(chain(TIS(cap=cap), BandMask(low=low, high=high), Veto(threshold=veto_threshold)),
                           group=group)


def sparrow(cap: float = 3.0) -> TIS:
    """Sparrow's training correction (Zhou et al., 2026, arXiv 2606.08446): token TIS, C = 3."""
    return tis(cap=cap)


def sparse_tail(q: float = 0.05, tau: float = 0.86, cap: float = 2.0):
    """Sparsity-aware rejection: drop sequences whose own 5th-percentile acceptance is below
    tau = 0.86 (Sparrow's tail statistic and threshold), then token TIS cap 2. Needs the
    acceptance in the record (``measure(..., acceptance=...)``)."""
    check_probability("q", q)
    check_probability("tau", tau)
    return chain(TailReject(q=q, tau=tau), tis(cap=cap))


def trl(mode: str = "sequence_mask", clip_min: float | None = None, clip_max: float | None = 3.0) -> TRLCorrection:
    """TRL 1.16 ``vllm_importance_sampling_mode`` (default ``sequence_mask``, ``clip_max=3``)."""
    check_choice("mode", mode, TRL_MODES)
    check_number("clip_min", clip_min, low=0, allow_none=True)
    check_number("clip_max", clip_max, low=0, low_open=True, allow_none=True)
    if clip_min is not None and clip_max is not None and not clip_min < clip_max:
        raise ValueError(f"clip_min, clip_max: expected clip_min < clip_max, got "
                         f"clip_min={clip_min!r}, clip_max={clip_max!r}")
    return TRLCorrection(mode=mode, clip_min=clip_min, clip_max=clip_max)


def openrlhf(
    level: str = "token", mode: str = "mask", gating: str = "ratio",
    threshold: tuple[float, float] = (0.5, 5.0),
) -> OpenRLHFCorrection:
    """OpenRLHF 0.11 ``PolicyLoss(is_correction_level, _mode, _gating, _threshold)``.

    ``threshold`` is ``(low, high)`` on the gated statistic: the ratio (token, or the sequence's
    geometric mean) for ``gating="ratio"``; for ``"binary_kl"`` / ``"tv"`` only an upper bound
    is meaningful, so ``low`` must be ``<= 0`` there.
    """
    check_choice("gating", gating, OPENRLHF_GATINGS)
    if not isinstance(threshold, (tuple, list)) or len(threshold) != 2:
        raise ValueError(f"threshold: expected a pair (low, high), got {threshold!r}")
    low, high = threshold
    if gating == "ratio":
        _band(low, high, names=("threshold[0]", "threshold[1]"))
    else:
        check_number("threshold[1]", high, low=0, low_open=True)
        if not (isinstance(low, (int, float)) and low == low and low <= 0):
            raise ValueError(f"threshold[0]: expected a number <= 0 (gating={gating!r} takes an "
                             f"upper bound only), got {low!r}")
    return OpenRLHFCorrection(level=level, mode=mode, gating=gating, threshold=(low, high))
