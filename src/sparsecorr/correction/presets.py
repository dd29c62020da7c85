"""Presets: frozen dataclasses with the paper's numbers as defaults, each citing its source.

Every preset is a callable ``(CorrectionInputs) -> Correction`` with a readable ``repr`` (its
numbers), so it can be logged, compared and stored in a config. The factories (``tis()``,
``sparse_rl()``, ...) are the public way to build them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import count
from .base import Chain, Correction, CorrectionInputs, chain, finalize, prepare, transform_of
from .masks import band_mask, divergence_mask, opsm_mask, tail_mask, veto_mask
from .weights import batch_normalize, sequence_is_weights, token_is_weights

__all__ = [
    "OPSM",
    "TIS",
    "BandMask",
    "BatchNormalized",
    "Divergence",
    "SequenceIS",
    "TailReject",
    "Veto",
    "divergence",
    "geo_rs",
    "icepop",
    "mis",
    "opsm",
    "sequence_is",
    "sparrow",
    "sparse_rl",
    "sparse_tail",
    "tis",
    "veto",
]


def _frac(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    return count(part) / count(whole).clamp(min=1)


class _Piece:
    """``__call__`` = prepare once, ``transform``, finalize once (standard metrics)."""

    def __call__(self, inputs: CorrectionInputs) -> Correction:
        lr, clean, nonfinite = prepare(inputs)
        weights, kept, extra = self.transform(inputs, lr, clean)
        return finalize(weights, kept, inputs, extra, nonfinite=nonfinite)


@dataclass(frozen=True)
class TIS(_Piece):
    """Truncated token-level IS: ``w_t = clamp(r_t, floor, cap)`` (Yao et al., 2025)."""

    cap: float | None = 2.0
    floor: float = 0.0

    def transform(self, inputs, lr, clean):
        w = token_is_weights(lr, clean, cap=self.cap, floor=self.floor)
        hi = math.inf if self.cap is None else math.log(self.cap)
        lo = math.log(self.floor) if self.floor > 0 else -math.inf
        truncated = clean & ((lr > hi) | (lr < lo))
        return w, clean, {"correction/truncated_frac": _frac(truncated, clean)}


@dataclass(frozen=True)
class SequenceIS(_Piece):
    """Sequence-level IS: product (``reduce="sum"``) or geometric mean (``"mean"``) of ratios."""

    reduce: str = "mean"
    cap: float | None = None
    floor: float = 0.0

    def transform(self, inputs, lr, clean):
        return sequence_is_weights(lr, clean, reduce=self.reduce, cap=self.cap, floor=self.floor), clean, {}


@dataclass(frozen=True)
class BandMask(_Piece):
    """Reject outside ``[low, high]``; ``reweight`` keeps the ratio at the band's level as weight."""

    low: float
    high: float
    level: str = "token"
    reweight: bool = False

    def transform(self, inputs, lr, clean):
        kept = band_mask(lr, clean, low=self.low, high=self.high, level=self.level)
        if not self.reweight:
            w = kept.float()
        elif self.level == "token":
            w = token_is_weights(lr, kept, cap=None)
        else:
            reduce = "sum" if self.level == "sequence" else "mean"
            w = sequence_is_weights(lr, kept, reduce=reduce, cap=None)
        return w, kept, {"correction/band_rejected_frac": _frac(clean & ~kept, clean)}


@dataclass(frozen=True)
class Veto(_Piece):
    """Drop a sequence if any token ratio is below ``threshold`` (Sparse-RL: 1e-4)."""

    threshold: float = 1e-4

    def transform(self, inputs, lr, clean):
        kept = veto_mask(lr, clean, threshold=self.threshold)
        vetoed = count(clean.any(-1) & ~kept.any(-1))
        return kept.float(), kept, {"correction/vetoed_seqs": vetoed}


@dataclass(frozen=True)
class Divergence(_Piece):
    """Drop sequences whose max/mean k2 or k3 exceeds ``threshold`` (verl ``seq_max_k3`` ...)."""

    threshold: float
    estimator: str = "k3"
    reduce: str = "max"

    def transform(self, inputs, lr, clean):
        kept = divergence_mask(inputs.old_logp, inputs.rollout_logp, clean,
                               estimator=self.estimator, reduce=self.reduce, threshold=self.threshold)
        rejected = count(clean.any(-1) & ~kept.any(-1))
        return kept.float(), kept, {"correction/divergence_rejected_seqs": rejected}


@dataclass(frozen=True)
class TailReject(_Piece):
    """Drop sequences whose own ``q``-quantile of acceptance is below ``tau`` (needs acceptance)."""

    q: float = 0.05
    tau: float = 0.86

    def transform(self, inputs, lr, clean):
        if inputs.acceptance is None:
            raise ValueError("acceptance: the tail rejection needs per-token acceptance rates "
                             "(CorrectionInputs.acceptance), got None")
        clean = clean & torch.isfinite(inputs.acceptance)
        kept = tail_mask(inputs.acceptance, clean, q=self.q, tau=self.tau)
        rejected = count(clean.any(-1) & ~kept.any(-1))
        return kept.float(), kept, {"correction/tail_rejected_seqs": rejected}


@dataclass(frozen=True)
class OPSM(_Piece):
    """DeepSeek-V3.2 off-policy sequence masking (needs advantages; drift to ``logp`` if given)."""

    delta: float

    def transform(self, inputs, lr, clean):
        if inputs.advantages is None:
            raise ValueError("advantages: OPSM needs advantages (CorrectionInputs.advantages), got None")
        if inputs.logp is not None:
            drift = inputs.logp.detach().float() - inputs.rollout_logp.detach().float()
            clean = clean & torch.isfinite(drift)
            lr = torch.where(clean, drift.clamp(-20, 20), 0.0)
        kept = opsm_mask(lr, clean, inputs.advantages, delta=self.delta)
        rejected = count(clean.any(-1) & ~kept.any(-1))
        return kept.float(), kept, {"correction/opsm_rejected_seqs": rejected}


@dataclass(frozen=True)
class BatchNormalized(_Piece):
    """Wrap a correction so its kept weights average 1 over the batch (all ranks of ``group``)."""

    inner: object
    group: object | None = None

    def transform(self, inputs, lr, clean):
        w, kept, extra = transform_of(self.inner, inputs, lr, clean)
        return batch_normalize(w, kept, group=self.group), kept, extra

    def __repr__(self) -> str:
        return f"BatchNormalized({self.inner!r})"




def tis(cap: float = 2.0, floor: float = 0.0) -> TIS:
    """Truncated IS, token level, cap 2 (Yao et al., "Your efficient RL framework secretly
    brings you off-policy RL training", 2025)."""
    return TIS(cap=cap, floor=floor)


def sequence_is(reduce: str = "mean", cap: float | None = None, floor: float = 0.0) -> SequenceIS:
    """Sequence IS: ``reduce="sum"`` is the product of ratios (vanishes on long outputs, TRL
    #5814); ``"mean"`` (default) the geometric mean."""
    return SequenceIS(reduce=reduce, cap=cap, floor=floor)


def mis(low: float = 0.5, high: float = 2.0, level: str = "token") -> BandMask:
    """Masked IS: weight ``r`` kept only inside ``[low, high]``, else dropped (METHODS §4)."""
    return BandMask(low=low, high=high, level=level, reweight=True)


def icepop(low: float = 0.5, high: float = 5.0) -> BandMask:
    """IcePop (Ring-1T, 2025): tokens inside [0.5, 5] kept with weight 1, others dropped."""
    return BandMask(low=low, high=high, level="token", reweight=False)


def geo_rs(low: float, high: float) -> BandMask:
    """Geometric rejection sampling: keep sequences whose geometric-mean ratio is in
    ``[low, high]``, weight 1. No published default: both bounds are required."""
    return BandMask(low=low, high=high, level="geometric", reweight=False)


def veto(threshold: float = 1e-4) -> Veto:
    """Sequence veto at ratio ``threshold`` (Sparse-RL, Luo et al., ACL 2026: 1e-4)."""
    return Veto(threshold=threshold)


def divergence(threshold: float, estimator: str = "k3", reduce: str = "max") -> Divergence:
    """k2/k3 sequence rejection (verl ``rollout_rs`` ``seq_max_k3``, ``seq_mean_k2``, ...)."""
    return Divergence(threshold=threshold, estimator=estimator, reduce=reduce)


def opsm(delta: float) -> OPSM:
    """Off-policy sequence masking (DeepSeek-V3.2, 2025) with drift threshold ``delta``."""
    return OPSM(delta=delta)


def sparse_rl(*, cap: float = 1.5, low: float = 0.5, high: float = 1.5, veto_threshold: float = 1e-4,
              group: object | None = None) -> BatchNormalized:
    """Sparse-RL's released correction (Luo et al., ACL 2026, arXiv 2601.10079, METHODS §1):
    token TIS cap 1.5, token band [0.5, 1.5], veto 1e-4, then batch normalisation so the mean
    kept weight is 1 (over ``group`` when given)."""
    inner = chain(TIS(cap=cap), BandMask(low=low, high=high, level="token"), Veto(veto_threshold))
    return BatchNormalized(inner, group=group)


def sparrow(cap: float = 3.0) -> TIS:
    """Sparrow's training correction (Zhou et al., 2026, arXiv 2606.08446): token TIS, C = 3."""
    return TIS(cap=cap)


def sparse_tail(q: float = 0.05, tau: float = 0.86, cap: float = 2.0) -> Chain:
    """Sparsity-aware rejection: drop sequences whose own 5th-percentile acceptance is below
    tau = 0.86 (Sparrow's tail statistic and threshold), then token TIS cap 2. Needs
    ``acceptance`` in the inputs."""
    return chain(TailReject(q=q, tau=tau), TIS(cap=cap))
