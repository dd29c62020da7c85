r"""Correction pieces: frozen dataclasses, each a callable ``Mismatch -> Correction``.

Build them with the factories of [`sparsecorr.correction`][sparsecorr.correction] (``tis()``,
``sparse_rl()``, ...), which carry the papers' numbers as defaults; the classes are the
factories' results (readable ``repr``, comparable, storable in a config). Every piece reads the
record's clamped log-ratio \(\ell_t\) (0 outside ``valid``) and never keeps a non-valid token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import count, count_int, finite, host_all
from .._dist import all_reduce_sum
from .._masks import and_rows, count_float, row_any, zero_outside_
from ..mismatch import LOG_RATIO_CLAMP, Mismatch
from .base import Correction, CorrectionFn, Count
from .masks import divergence_stat, opsm_mask, tail_mask

__all__ = [
    "OPSM",
    "TIS",
    "BandMask",
    "BatchNormalized",
    "Divergence",
    "SequenceIS",
    "SparseRL",
    "TailReject",
    "Veto",
]

LEVELS = ("token", "sequence", "geometric")


def _log(x: float | None, default: float | None) -> float | None:
    """``log(x)`` for a ratio bound; ``default`` (None = no bound) at 0 / None / inf."""
    if x is None or x == math.inf:
        return default
    return math.log(x) if x > 0 else default


def row_log_ratio(mm: Mismatch, reduce: str) -> torch.Tensor:
    r"""``[B]``: \(\sum_t \ell_t\) (``"sum"``, clamped to ±20) or \(\bar\ell\) over valid tokens."""
    s = mm.log_ratio.sum(-1)
    if reduce == "mean":
        return s / count(mm.valid, dim=-1).clamp(min=1)
    return s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _count_above(lr: torch.Tensor, valid: torch.Tensor, t: float) -> torch.Tensor:
    """0-d int64: valid tokens with log-ratio above ``t`` (padding holds 0, which is above ``t``
    only when ``t < 0``: then masked). A bool comparison: a quarter of a float buffer."""
    above = lr > t
    return count_int(above if t >= 0 else above.logical_and_(valid))


def _out_of_band(x: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
    """bool ``not lo <= x <= hi`` (``x`` finite): ``clamp`` moves exactly the out-of-band
    entries, and the difference it makes is nonzero exactly there (float-to-bool is a fast
    kernel, the ``==`` comparison is not)."""
    return torch.clamp(x, lo, hi).sub_(x).bool()


@dataclass(frozen=True)
class TIS:
    """Truncated token-level IS: ``w_t = clamp(r_t, floor, cap)`` (Yao et al., 2025)."""

    cap: float | None = 2.0
    floor: float = 0.0

    def __call__(self, mm: Mismatch) -> Correction:
        lo, hi = _log(self.floor, None), _log(self.cap, None)
        lr, valid = mm.log_ratio, mm.valid
        # clamp before masking: a floor > 0 must not reach the padding
        w = mm.ratio_copy().clamp_(min=self.floor, max=self.cap).mul_(mm.valid_f)
        outside = (lambda: valid & _out_of_band(lr, lo, hi)) if (lo, hi) != (None, None) else None
        metrics = {"correction/truncated_frac": Count(lambda: count(outside()), per_token=True)
                   if outside else torch.zeros(())}
        return Correction(mask=valid, token_weights=w, piece_metrics=metrics, source=mm)


@dataclass(frozen=True)
class SequenceIS:
    r"""Sequence-level IS: product (``reduce="sum"``: \(e^{\mathrm{clamp}(\sum_t \ell_t, \pm20)}\))
    or geometric mean (``"mean"``: \(e^{\bar\ell}\)) of the token ratios, truncated to
    ``[floor, cap]``, broadcast to the row's valid tokens."""

    reduce: str = "mean"
    cap: float | None = None
    floor: float = 0.0

    def __call__(self, mm: Mismatch) -> Correction:
        w = row_log_ratio(mm, self.reduce).exp().clamp(min=self.floor, max=self.cap)
        return Correction(mask=mm.valid, token_weights=zero_outside_(w[:, None].expand(mm.shape).clone(), mm.valid),
                          source=mm)


@dataclass(frozen=True)
class BandMask:
    """Reject outside ``[low, high]`` (token ratio, sequence product or geometric mean);
    ``reweight`` keeps the ratio at the band's level as the weight (MIS), else weight 1."""

    low: float
    high: float
    level: str = "token"
    reweight: bool = False

    def __call__(self, mm: Mismatch) -> Correction:
        lo, hi = _log(self.low, None), _log(self.high, None)
        if self.level == "token":
            stat = mm.log_ratio
            keep = torch.gt(mm.valid, _out_of_band(stat, lo, hi))  # valid and in the band
        else:
            stat = row_log_ratio(mm, "sum" if self.level == "sequence" else "mean")
            keep = and_rows(mm.valid, _out_of_band(stat, lo, hi).logical_not_())
        w = None
        if self.reweight:
            w = mm.ratio_copy() if self.level == "token" else stat.exp()[:, None].expand(keep.shape).clone()
            w = zero_outside_(w, keep)
        rejected = {"correction/band_rejected_frac": Count(lambda: count(keep), per_token=True,
                                                           coef=-1.0, offset=1.0)}
        return Correction(mask=keep, token_weights=w, piece_metrics=rejected, source=mm)


@dataclass(frozen=True)
class Veto:
    """Drop a sequence if any valid token's ratio is below ``threshold`` (Sparse-RL: 1e-4)."""

    threshold: float = 1e-4

    def __call__(self, mm: Mismatch) -> Correction:
        ok = _unvetoed_rows(mm, self.threshold)
        keep = mm.valid if ok is None else and_rows(mm.valid, ok)
        # a vetoed row has a valid token below the threshold: it is never an empty row
        return Correction(mask=keep, piece_metrics={"correction/vetoed_seqs": _vetoed(ok)}, source=mm)


def _unvetoed_rows(mm: Mismatch, threshold: float) -> torch.Tensor | None:
    """``[B]`` bool: rows without a valid token of ratio below ``threshold``; None when that is
    every row and the CPU could tell without a pass (the record's cached batch minimum)."""
    t = math.log(threshold)
    if t < 0 and mm.shape[-1] > 0:  # padding holds 0 > t: the row minimum decides (one reduction)
        if mm.log_ratio.device.type == "cpu" and float(mm.log_ratio_extremes[0]) >= t:
            return None
        return mm.log_ratio.amin(dim=-1) >= t
    below = mm.log_ratio < t
    if t >= 0:  # padding holds log-ratio 0, which would count as "below"
        below &= mm.valid
    return row_any(below).logical_not_()


def _vetoed(ok: torch.Tensor | None) -> Count:
    """The number of vetoed rows, ``B`` minus the rows kept (one count, no negation)."""
    if ok is None:  # none; one zero sum all the same (a plan's layout must not depend on the data)
        return Count(lambda: torch.zeros(()))
    return Count(lambda: count_int(ok), coef=-1.0, offset=float(ok.shape[0]))


@dataclass(frozen=True)
class Divergence:
    r"""Drop sequences whose max (or mean) per-token \(k_2 = \ell^2/2\) or
    \(k_3 = e^\ell - 1 - \ell\) exceeds ``threshold`` (verl ``seq_max_k3``, ``seq_mean_k2`` ...)."""

    threshold: float
    estimator: str = "k3"
    reduce: str = "max"

    def __call__(self, mm: Mismatch) -> Correction:
        stat = divergence_stat(mm.log_ratio, mm.valid, estimator=self.estimator, reduce=self.reduce)
        bad = stat > self.threshold  # an empty row has statistic 0 <= threshold
        return Correction(mask=mm.valid & ~bad[:, None],
                          piece_metrics={"correction/divergence_rejected_seqs": Count(lambda: count(bad))},
                          source=mm)


@dataclass(frozen=True)
class TailReject:
    """Drop sequences whose own ``q``-quantile of the acceptance rate is below ``tau``
    (Sparrow's tail statistic per sequence); needs ``Mismatch.acceptance``."""

    q: float = 0.05
    tau: float = 0.86

    def __call__(self, mm: Mismatch) -> Correction:
        if mm.acceptance is None:
            raise ValueError("acceptance: expected per-token acceptance rates in the record "
                             "(measure(..., acceptance=...)) for the tail rejection, got None")
        clean = mm.valid & finite(mm.acceptance)
        keep = tail_mask(mm.acceptance, clean, q=self.q, tau=self.tau)
        return Correction(mask=keep, piece_metrics={
            "correction/tail_rejected_seqs": Count(lambda: count(row_any(clean) & ~row_any(keep)))},
            source=mm)


@dataclass(frozen=True)
class OPSM:
    r"""Off-policy sequence masking (DeepSeek-V3.2): drop a sequence when its advantage is
    negative and its mean drift \(-\bar\ell\) exceeds ``delta``; the drift is to the learner
    (``Mismatch.logp``) when given, else to the dense model. Needs ``Mismatch.advantages``."""

    delta: float

    def __call__(self, mm: Mismatch) -> Correction:
        if mm.advantages is None:
            raise ValueError("advantages: expected advantages in the record for OPSM (sparse_grpo "
                             "passes them; or measure(..., advantages=...)), got None")
        valid, lr = mm.valid, mm.log_ratio
        if mm.logp is not None:
            raw = mm.logp.float() - mm.rollout_logp.detach().float()
            valid = valid & finite(raw)
            lr = torch.where(valid, raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
        adv = mm.advantages
        if adv.dim() == 2 and adv.shape[1] == 1:
            adv = adv[:, 0]
        keep = opsm_mask(lr, valid, adv, delta=self.delta)
        # a rejected row had a valid token (an empty row has drift 0 <= delta) and lost them all
        return Correction(mask=keep, piece_metrics={
            "correction/opsm_rejected_seqs": Count(lambda: count(row_any(valid) & ~row_any(keep)))},
            source=mm)


def _normalize(c: Correction, group: object | None) -> Correction:
    """Scale ``c``'s weights so their mean over kept tokens (of every rank) is 1. The factor is
    kept apart (``Correction.scale``): the loss folds it into the per-row advantages."""
    if c.token_weights is None:  # every kept weight is 1 already
        return c
    n = c.cache["tokens"] if "tokens" in c.cache else count(c.mask)
    return _normalized(c.mask, c.token_weights, n, c.piece_metrics, c.source, group)


def _normalized(mask: torch.Tensor, w: torch.Tensor, n: torch.Tensor, metrics: dict,
                source: Mismatch | None, group: object | None) -> Correction:
    """The ``Correction`` of ``mask`` and weights ``w`` (``n`` kept tokens) with the scale that
    makes the kept weights' mean 1 (over the ranks of ``group``)."""
    w_sum = w.sum()
    if group is not None:
        total = all_reduce_sum(torch.stack([w_sum, n]), group)
        w_tot, n_tot = total[0], total[1]
    else:
        w_tot, n_tot = w_sum, n
    # the new scale replaces any inner one: the final weights are w * n / sum(w). A sum of 0
    # means no kept token (kept weights of the library's corrections are > 0): any scale works
    scale = n_tot / w_tot.clamp(min=1e-30)
    return Correction(mask=mask, token_weights=w, scale=scale, piece_metrics=metrics,
                      source=source, cache={"weight_sum": w_sum, "tokens": n})


@dataclass(frozen=True)
class BatchNormalized:
    """Wrap a correction so its kept weights average 1 over the batch (all ranks of ``group``)."""

    inner: CorrectionFn
    group: object | None = None

    def __call__(self, mm: Mismatch) -> Correction:
        return _normalize(self.inner(mm), self.group)

    def __repr__(self) -> str:
        return f"BatchNormalized({self.inner!r})"


@dataclass(frozen=True)
class SparseRL:
    """Sparse-RL's correction, fused: token TIS at ``cap``, token band ``[low, high]``, sequence
    veto below ``veto_threshold``, then batch normalisation (over ``group``). Equal to
    ``batch_normalized(chain(tis(cap), icepop(low, high), veto(veto_threshold)))`` in fewer
    passes (tested bit for bit)."""

    cap: float = 1.5
    low: float = 0.5
    high: float = 1.5
    veto_threshold: float = 1e-4
    group: object | None = None

    def __call__(self, mm: Mismatch) -> Correction:
        lo, hi, cap = _log(self.low, None), _log(self.high, None), _log(self.cap, None)
        if (lo is not None and lo > 0) or (hi is not None and hi < 0):  # padding (0) out of band
            return _sparse_rl_general(self, mm, lo, hi, cap)
        lr = mm.log_ratio
        # the band test in a buffer that then holds the weights (one fresh [B, T] float): the
        # clamp's move has sign +1 below the band, -1 above, 0 inside (padding, 0, included)
        side = torch.clamp(lr, lo, hi).sub_(lr).sign_()
        below_minus_above = side.sum()
        out = side.abs_()  # 1.0 on the valid tokens out of the band
        n_out = out.sum()
        keep_f = torch.sub(mm.valid_f, out, out=out)
        ok = _unvetoed_rows(mm, self.veto_threshold)
        if ok is None or host_all(ok):  # nothing vetoed: kept = valid - out of the band
            keep = keep_f.bool()
            n_keep = mm.valid_count - n_out
        else:  # a [B, 1] factor: no [B, T] mask conversion
            keep = keep_f.mul_(ok.float().reshape(-1, 1)).bool()
            n_keep = count_float(keep_f, keep)
        # TIS's weight on kept tokens, keep * rho (from the record's rho - 1 when the loss
        # computed it for the k3 metric), capped (a cap equal to ``high`` can still bind by a
        # rounding)
        w = mm.ratio_times(keep_f)
        if cap is not None:
            w.clamp_(max=self.cap)
        if cap is None:
            truncated = torch.zeros(())
        elif cap == hi:  # above the cap = above the band: (out - (below - above)) / 2
            truncated = Count(lambda: ((n_out, 0.5), (below_minus_above, -0.5)), per_token=True)
        else:
            truncated = Count(lambda: _count_above(lr, mm.valid, cap), per_token=True)
        metrics = {
            "correction/truncated_frac": truncated,
            # 1 - in band / valid, as BandMask reports it (1 on an empty batch)
            "correction/band_rejected_frac": Count(lambda: ((mm.valid_count, 1.0), (n_out, -1.0)),
                                                   per_token=True, coef=-1.0, offset=1.0),
            "correction/vetoed_seqs": _vetoed(ok),
        }
        return _normalized(keep, w, n_keep, metrics, mm, self.group)

    def __repr__(self) -> str:
        return (f"SparseRL(cap={self.cap}, low={self.low}, high={self.high}, "
                f"veto_threshold={self.veto_threshold})")


def _sparse_rl_general(p: SparseRL, mm: Mismatch, lo: float | None, hi: float | None,
                       cap: float | None) -> Correction:
    """``SparseRL`` when the band excludes ratio 1 (padding, log-ratio 0, is then out of it)."""
    lr, valid = mm.log_ratio, mm.valid
    in_band = torch.gt(valid, _out_of_band(lr, lo, hi))
    ok = _unvetoed_rows(mm, p.veto_threshold)
    keep = in_band if ok is None else and_rows(in_band, ok)
    w = zero_outside_(mm.ratio_copy(), keep)
    if cap is not None:
        w.clamp_(max=p.cap)
    metrics = {
        "correction/truncated_frac": (Count(lambda: _count_above(lr, valid, cap), per_token=True)
                                      if cap is not None else torch.zeros(())),
        "correction/band_rejected_frac": Count(lambda: count_int(in_band), per_token=True,
                                               coef=-1.0, offset=1.0),
        "correction/vetoed_seqs": _vetoed(ok),
    }
    return _normalize(Correction(mask=keep, token_weights=w, piece_metrics=metrics, source=mm), p.group)
