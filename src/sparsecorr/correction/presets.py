r"""Correction pieces: frozen dataclasses, each a callable ``Mismatch -> Correction``.

Build them with the factories of [`sparsecorr.correction`][sparsecorr.correction] (``tis()``,
``sparse_rl()``, ...), which carry the papers' numbers as defaults; the classes are the
factories' results (readable ``repr``, comparable, storable in a config). Every piece reads the
record's clamped log-ratio \(\ell_t\) (0 outside ``valid``), never keeps a non-valid token, and
is plain tensor code (no host read, no device branch). A preset *is* its composition:
``sparse_rl()`` is ``batch_normalized(chain(tis(1.5), icepop(0.5, 1.5), veto(1e-4)))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import compile_safe_hash, count, finite
from .._dist import all_reduce_sum
from .._masks import and_rows, row_any
from .._ratio import clamp_log_ratio, ratio
from ..mismatch import Mismatch
from .base import Correction, CorrectionFn, RowFactor, _check_record, kept_sum
from .masks import divergence_stat, opsm_mask, tail_mask

__all__ = ["OPSM", "TIS", "BandMask", "BatchNormalized", "Divergence", "SequenceIS", "TailReject", "Veto"]

LEVELS = ("token", "sequence", "geometric")


def _log(x: float | None) -> float | None:
    """``log(x)`` for a ratio bound; None (no bound) at 0 / None / inf."""
    if x is None or x == math.inf or x <= 0:
        return None
    return math.log(x)


def row_log_ratio(mm: Mismatch, reduce: str) -> torch.Tensor:
    r"""``[B]``: \(\sum_t \ell_t\) (``"sum"``, clamped to ±20) or \(\bar\ell\) over valid tokens."""
    s = mm.log_ratio.sum(-1)  # [B]
    if reduce == "mean":
        return s / count(mm.valid, dim=-1).clamp(min=1)
    return clamp_log_ratio(s)


def outside(x: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
    """bool ``not lo <= x <= hi`` (a None bound is open); same shape as ``x``."""
    out = torch.zeros_like(x, dtype=torch.bool)
    if lo is not None:
        out = out | (x < lo)
    if hi is not None:
        out = out | (x > hi)
    return out


def per_valid(name: str, n: torch.Tensor, mm: Mismatch) -> dict[str, torch.Tensor]:
    """A fraction of the record's valid tokens, as a sum and its count."""
    return {name: n, name + "#n": mm.tokens}


@compile_safe_hash
@dataclass(frozen=True)
class TIS:
    """Truncated token-level IS: ``w_t = clamp(r_t, floor, cap)`` (Yao et al., 2025)."""

    cap: float | None = 2.0
    floor: float = 0.0

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        lr, valid = mm.log_ratio, mm.valid  # [B, T]
        w = torch.where(valid, ratio(lr).clamp(min=self.floor, max=self.cap), 0.0)  # [B, T]
        lo, hi = _log(self.floor), _log(self.cap)
        metrics = per_valid("correction/truncated_frac",
                            count(valid & outside(lr, lo, hi)), mm) if (lo, hi) != (None, None) else \
            {"correction/truncated_frac": torch.zeros((), device=lr.device)}
        return Correction(mask=valid, token_weights=w, piece_metrics=metrics, source=mm)


@compile_safe_hash
@dataclass(frozen=True)
class SequenceIS:
    r"""Sequence-level IS: product (``reduce="sum"``: \(e^{\mathrm{clamp}(\sum_t \ell_t, \pm20)}\))
    or geometric mean (``"mean"``: \(e^{\bar\ell}\)) of the token ratios, truncated to
    ``[floor, cap]``, broadcast to the row's valid tokens."""

    reduce: str = "mean"
    cap: float | None = None
    floor: float = 0.0

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        w = ratio(row_log_ratio(mm, self.reduce)).clamp(min=self.floor, max=self.cap)  # [B]
        return Correction(mask=mm.valid, token_weights=torch.where(mm.valid, w[:, None], 0.0), source=mm)


@compile_safe_hash
@dataclass(frozen=True)
class BandMask:
    """Reject outside ``[low, high]`` (token ratio, sequence product or geometric mean);
    ``reweight`` keeps the ratio at the band's level as the weight (MIS), else weight 1."""

    low: float
    high: float
    level: str = "token"
    reweight: bool = False

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        lo, hi = _log(self.low), _log(self.high)
        if self.level == "token":
            stat = mm.log_ratio  # [B, T]
            keep = mm.valid & ~outside(stat, lo, hi)
        else:
            stat = row_log_ratio(mm, "sum" if self.level == "sequence" else "mean")  # [B]
            keep = and_rows(mm.valid, ~outside(stat, lo, hi))
        w = None
        if self.reweight:
            r = ratio(stat) if self.level == "token" else ratio(stat)[:, None]
            w = torch.where(keep, r, 0.0)
        rejected = per_valid("correction/band_rejected_frac", mm.tokens - count(keep), mm)
        return Correction(mask=keep, token_weights=w, piece_metrics=rejected, source=mm)


@compile_safe_hash
@dataclass(frozen=True)
class Veto:
    """Drop a sequence if any valid token's ratio is below ``threshold`` (Sparse-RL: 1e-4)."""

    threshold: float = 1e-4

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        below = mm.valid & (mm.log_ratio < math.log(self.threshold))  # [B, T]
        vetoed = row_any(below)  # [B]
        return Correction(mask=and_rows(mm.valid, ~vetoed),
                          piece_metrics={"correction/vetoed_seqs": count(vetoed)}, source=mm,
                          factor=RowFactor(mm.valid, None, ~vetoed))


@compile_safe_hash
@dataclass(frozen=True)
class Divergence:
    r"""Drop sequences whose max (or mean) per-token \(k_2 = \ell^2/2\) or
    \(k_3 = e^\ell - 1 - \ell\) exceeds ``threshold`` (verl ``seq_max_k3``, ``seq_mean_k2`` ...)."""

    threshold: float
    estimator: str = "k3"
    reduce: str = "max"

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        stat = divergence_stat(mm.log_ratio, mm.valid, estimator=self.estimator, reduce=self.reduce)
        bad = stat > self.threshold  # [B]; an empty row has statistic 0 <= threshold
        return Correction(mask=and_rows(mm.valid, ~bad),
                          piece_metrics={"correction/divergence_rejected_seqs": count(bad)}, source=mm)


@compile_safe_hash
@dataclass(frozen=True)
class TailReject:
    """Drop sequences whose own ``q``-quantile of the acceptance rate is below ``tau``
    (Sparrow's tail statistic per sequence); needs ``Mismatch.acceptance``."""

    q: float = 0.05
    tau: float = 0.86

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        if mm.acceptance is None:
            raise ValueError("acceptance: expected per-token acceptance rates in the record "
                             "(measure(..., acceptance=...)) for the tail rejection, got None")
        clean = mm.valid & finite(mm.acceptance)
        keep = tail_mask(mm.acceptance, clean, q=self.q, tau=self.tau)
        return Correction(mask=keep, piece_metrics={
            "correction/tail_rejected_seqs": count(row_any(clean) & ~row_any(keep))}, source=mm)


@compile_safe_hash
@dataclass(frozen=True)
class OPSM:
    r"""Off-policy sequence masking (DeepSeek-V3.2): drop a sequence when its advantage is
    negative and its mean drift \(-\bar\ell\) exceeds ``delta``; the drift is to the learner
    (``Mismatch.logp``) when given, else to the dense model. Needs ``Mismatch.advantages``."""

    delta: float

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        if mm.advantages is None:
            raise ValueError("advantages: expected advantages in the record for OPSM (sparse_grpo "
                             "passes them; or measure(..., advantages=...)), got None")
        valid, lr = mm.valid, mm.log_ratio
        if mm.logp is not None:
            raw = mm.logp.float() - mm.rollout_logp.detach().float()
            valid = valid & finite(raw)
            lr = torch.where(valid, clamp_log_ratio(raw), 0.0)
        adv = mm.advantages
        if adv.dim() == 2 and adv.shape[1] == 1:
            adv = adv[:, 0]
        keep = opsm_mask(lr, valid, adv, delta=self.delta)
        # a rejected row had a valid token (an empty row has drift 0 <= delta) and lost them all
        return Correction(mask=keep, piece_metrics={
            "correction/opsm_rejected_seqs": count(row_any(valid) & ~row_any(keep))}, source=mm)


def normalize(c: Correction, group: object | None = None) -> Correction:
    r"""``c`` with the scale that makes its kept weights average 1 (over the ranks of ``group``):
    \(s = n / \sum_t w_t\), one sum and one count (no second pass over the weights: the loss
    folds the scale into the advantages). The new scale replaces any inner one. A weight sum of
    0 means no kept token (kept weights of the library's corrections are > 0): any scale works."""
    if c.token_weights is None:  # every kept weight is 1 already
        return c
    # float32 row sums, summed over rows in float64: the scale does not depend on how the
    # batch is split over ranks (to rounding)
    w_sum = kept_sum(c, 1, dtype=torch.float64)
    sums = all_reduce_sum(torch.stack([w_sum, kept_sum(c).double()]), group)  # [2]
    scale = (sums[1] / sums[0].clamp(min=1e-30)).float()
    return Correction(mask=c.mask, token_weights=c.token_weights, scale=scale,
                      piece_metrics=c.piece_metrics, source=c.source, factor=c.factor)


@compile_safe_hash
@dataclass(frozen=True)
class BatchNormalized:
    """Wrap a correction so its kept weights average 1 over the batch (all ranks of ``group``)."""

    inner: CorrectionFn
    group: object | None = None

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        return normalize(self.inner(mm), self.group)

    def __repr__(self) -> str:
        return f"BatchNormalized({self.inner!r})"
