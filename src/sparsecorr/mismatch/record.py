r"""The shared mismatch record: built once per batch, read by metrics, corrections and the loss.

Every consumer of the sparse-to-dense mismatch needs the same three things: the per-token
log-ratio \(\ell_t = \text{old\_logp}_t - \text{rollout\_logp}_t\), which tokens are valid
(masked in and finite) and how many were dropped as non-finite. [`measure`][sparsecorr.mismatch.measure]
computes them once, in a few fused passes, into a frozen [`Mismatch`][sparsecorr.mismatch.Mismatch];
[`mismatch_metrics`][sparsecorr.mismatch.mismatch_metrics], every correction
(``Mismatch -> Correction``) and [`sparse_grpo`][sparsecorr.losses.sparse_grpo] read it instead
of re-deriving it.

The clamp: \(\ell_t\) is clamped to \(\pm\)``LOG_RATIO_CLAMP`` (20, shared/DESIGN.md) once, here,
so every ratio \(e^{\ell_t}\) formed from the record is finite. Sequence-level sums are sums of
the clamped per-token values (see ``docs/methods.md`` for how that differs from verl).

Example:
    >>> import torch
    >>> from sparsecorr.mismatch import measure
    >>> old = torch.tensor([[-1.0, -2.0, float("nan")]])
    >>> roll = torch.tensor([[-1.5, -2.0, -1.0]])
    >>> mm = measure(old, roll, torch.tensor([[True, True, True]]))
    >>> mm.log_ratio
    tensor([[0.5000, 0.0000, 0.0000]])
    >>> mm.valid.tolist(), int(mm.nonfinite)
    ([[True, True, False]], 1)
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch

from .._checks import (
    check_advantages,
    check_float_tensor,
    check_mask,
    check_same_shape,
    count_int,
    finite_in_scratch,
)
from .._fastexp import exp_into
from .._masks import as_float, count_float, float_into_, row_any

__all__ = ["LOG_RATIO_CLAMP", "Mismatch", "measure"]

#: the one bound on every per-token log-ratio before ``exp`` (shared/DESIGN.md: ±20)
LOG_RATIO_CLAMP = 20.0

_EXPECT_M1 = "_expect_ratio_m1"  # cache key: a consumer will read ratio_m1
_TAKEN = "_buffers_taken"  # cache key: take_buffers() handed the [B, T] buffers over


@dataclass(frozen=True, eq=False)
class Mismatch:
    r"""Per-token sampler/learner mismatch of one batch (build it with ``measure``).

    Attributes:
        log_ratio: float32, \(\ell_t\) = old_logp − rollout_logp clamped to ±20, exactly 0 where
            ``valid`` is False (so masked sums need no further masking).
        valid: bool, ``mask`` and both log-probs finite.
        mask: bool, the caller's mask (True = the token counts).
        old_logp: the dense log-probs as given (not copied).
        rollout_logp: the sampler's log-probs as given (not copied).
        acceptance: optional per-token acceptance rate in [0, 1]: \(1 - \mathrm{TV}\) between the
            dense and sparse next-token distributions from their top-k log-probs
            (``acceptance_rate_topk``; Sparrow, read by ``sparse_tail``), the statistic
            calibration and the controller use.
        advantages: optional ``[B]`` or ``[B, T]`` advantages, context for corrections that
            read them (OPSM); set by ``sparse_grpo`` or ``with_context``.
        logp: optional detached learner log-probs, context for OPSM (drift to the current
            policy); set by ``sparse_grpo`` or ``with_context``.

    Cached on first use (no host synchronisation): ``ratio_m1`` (\(e^{\ell_t} - 1\), read by
    the k3 metric and, when expected, the IS weights), ``log_ratio_sum`` and
    ``log_ratio_extremes`` (read by the metrics, the veto and the clamp decision), ``tokens``
    (valid count; ``valid_count`` unconverted), ``input_tokens`` (``input_count``),
    ``nonfinite`` (masked-in tokens dropped as non-finite), ``valid_rows``/``input_rows``
    (``[B]`` bool: rows with a valid / masked-in token). The IS weights read \(\rho_t\) through
    ``ratio_times`` / ``ratio_copy``: from ``ratio_m1`` when it is computed or expected
    (``expect_ratio_m1``, which ``sparse_grpo`` calls when it reports the k3 metric: one
    transcendental pass for both), else from ``_fastexp.exp_into`` (3x cheaper on the CPU); the
    two agree to a few float32 ulp and every correction of a record takes the same one.

    Shapes:
        log_ratio, valid, mask, old_logp, rollout_logp, acceptance: ``[B, T]``.
    """

    log_ratio: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor
    rollout_logp: torch.Tensor
    acceptance: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    logp: torch.Tensor | None = None
    #: counts computed on first use, shared with the copies ``with_context`` makes
    cache: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.log_ratio.shape

    def _cached(self, key: str, compute) -> torch.Tensor:
        if key not in self.cache:
            if _TAKEN in self.cache:
                raise RuntimeError(f"Mismatch.{key}: the record's buffers were handed over "
                                   "(take_buffers); read it before that")
            self.cache[key] = compute()
        return self.cache[key]

    @property
    def ratio_m1(self) -> torch.Tensor:
        r"""float32 \(\rho_t - 1 = \mathrm{expm1}(\ell_t)\), exactly 0 where ``valid`` is False;
        computed once and shared by the corrections' weights (\(\rho_t\) = this + 1) and the
        \(k_3\) metric (``expm1`` keeps a small \(\ell_t\) exact, where \(e^{\ell} - 1\) would
        cancel)."""
        return self._cached("ratio_m1", self._expm1_into_spare)

    def _expm1_into_spare(self) -> torch.Tensor:
        return torch.expm1(self.log_ratio, out=self._take_spare())

    def _take_spare(self) -> torch.Tensor | None:
        # the buffer measure() kept the float valid mask in: that cached mask goes with it,
        # unless someone else holds it (a correction's weights, a caller's reference, a view)
        if not _cache_only(self.cache, "_spare"):
            self.cache.pop("_spare", None)
            return None
        spare = self.cache.pop("_spare")
        if self.cache.get("valid_f") is spare:
            del self.cache["valid_f"]
        return spare

    def expect_ratio_m1(self) -> None:
        """Declare that ``ratio_m1`` will be read (``sparse_grpo``'s k3 metric): the corrections'
        weights are then built from it (one transcendental pass for both) instead of ``exp``."""
        self.cache[_EXPECT_M1] = None

    def _ratio_from_m1(self) -> bool:
        """The one rule of ``ratio_times`` and ``ratio_copy``: rho from ``ratio_m1`` when it is
        computed or expected, else from ``exp``."""
        return "ratio_m1" in self.cache or _EXPECT_M1 in self.cache

    def ratio_times(self, mask_f: torch.Tensor) -> torch.Tensor:
        r"""``mask_f * rho`` in place (``mask_f`` a float 0/1 mask, overwritten and returned):
        from ``ratio_m1`` as ``mask_f + mask_f * (rho - 1)`` when it is computed or expected
        (``expect_ratio_m1``), else from \(e^{\ell_t}\) (cached; ``_fastexp.exp_into``, 3x
        cheaper than ``expm1`` on the CPU). The two differ by a few float32 ulp (``_fastexp``);
        every correction reading the same record takes the same one."""
        if self._ratio_from_m1():
            return torch.addcmul(mask_f, mask_f, self.ratio_m1, out=mask_f)
        ratio = self._cached("ratio", lambda: exp_into(self.log_ratio, self._take_spare()))
        return mask_f.mul_(ratio)

    def ratio_copy(self) -> torch.Tensor:
        r"""A new float32 tensor holding \(\rho_t = e^{\ell_t}\) (1 where not valid), the
        caller's to modify; by the same rule as ``ratio_times`` (``ratio_m1 + 1`` when that is
        computed, else ``_fastexp.exp_into``)."""
        if self._ratio_from_m1():
            return self.ratio_m1.add(1.0)
        if "ratio" in self.cache:
            return self.cache["ratio"].clone()
        return exp_into(self.log_ratio)

    def take_buffers(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        r"""Hand over the record's float32 ``[B, T]`` buffers: the log-ratio and the spare one
        ``measure`` made (holding the float valid mask, \(\rho\) or \(\rho - 1\), or None),
        for the code that built the record and has read everything it needs from it
        (``sparse_grpo``, which writes the learner side into them instead of two fresh
        buffers). The spare is only one that the record's cache alone holds (no caller's
        reference, no correction's weights, no view). The record must not be read afterwards."""
        keys = ("ratio_m1", "ratio", "_spare", "valid_f")
        free = [k for k in keys if _cache_only(self.cache, k)]  # before any local reference
        spare = next((self.cache[k] for k in free if self.cache[k].shape == self.shape
                      and self.cache[k].dtype == torch.float32), None)
        for key in keys:
            self.cache.pop(key, None)
        self.cache[_TAKEN] = None  # what is not cached yet cannot be computed any more
        return self.log_ratio, spare

    @property
    def log_ratio_sum(self) -> torch.Tensor:
        r"""0-d float32 \(\sum_t \ell_t\) over the valid tokens (cached)."""
        return self._cached("log_ratio_sum", self.log_ratio.sum)

    @property
    def log_ratio_extremes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """0-d ``(min, max)`` of ``log_ratio`` over every entry (0 at the non-valid ones; both 0
        for an empty batch), cached."""
        return self._cached("log_ratio_extremes", lambda: _extremes(self.log_ratio))

    @property
    def valid_f(self) -> torch.Tensor:
        r"""float32 ``valid`` (1/0), to multiply by (cached; ``TIS`` and ``SparseRL`` read it).
        ``measure``'s buffer is reused for \(\rho\) or \(\rho - 1\) once they are computed,
        but only while the record alone holds it: a reference or a view kept elsewhere keeps
        it intact."""
        return self._cached("valid_f", lambda: as_float(self.valid))

    @property
    def valid_count(self) -> torch.Tensor:
        """0-d: number of valid tokens (what the metric plan reads: no conversion; int64, or
        float32 from ``measure``'s float mask)."""
        return self._cached("valid_count", lambda: count_int(self.valid))

    @property
    def input_count(self) -> torch.Tensor:
        """0-d: number of masked-in tokens (int64; ``valid_count`` itself when ``measure`` found
        every entry finite)."""
        return self._cached("input_count", lambda: count_int(self.mask))

    @property
    def tokens(self) -> torch.Tensor:
        """0-d float32: number of valid tokens."""
        return self._cached("tokens", lambda: self.valid_count.float())

    @property
    def input_tokens(self) -> torch.Tensor:
        """0-d float32: number of masked-in tokens."""
        return self._cached("input_tokens", lambda: self.input_count.float())

    @property
    def nonfinite(self) -> torch.Tensor:
        """0-d float32: masked-in tokens whose log-ratio was NaN or ±inf."""
        return self._cached("nonfinite", lambda: self.input_tokens - self.tokens)

    @property
    def valid_rows(self) -> torch.Tensor:
        """``[B]`` bool: rows with at least one valid token."""
        return self._cached("valid_rows", lambda: row_any(self.valid))

    @property
    def input_rows(self) -> torch.Tensor:
        """``[B]`` bool: rows with at least one masked-in token."""
        return self._cached("input_rows", lambda: row_any(self.mask))

    def with_context(
        self, *, advantages: torch.Tensor | None = None, logp: torch.Tensor | None = None,
        validate: bool = True,
    ) -> Mismatch:
        """A copy (no tensor copied) carrying ``advantages`` / detached ``logp`` for corrections
        that read them (OPSM); it shares the cached counts with this record. ``validate=False``
        skips the shape checks (inputs already checked, as ``sparse_grpo`` does)."""
        if validate and advantages is not None:
            check_advantages(advantages, self.log_ratio)
        if logp is not None:
            if validate:
                check_float_tensor("logp", logp)
                check_same_shape(old_logp=self.log_ratio, logp=logp)
            logp = logp.detach()
        return Mismatch(log_ratio=self.log_ratio, valid=self.valid, mask=self.mask, old_logp=self.old_logp,
                        rollout_logp=self.rollout_logp, acceptance=self.acceptance,
                        advantages=advantages if advantages is not None else self.advantages,
                        logp=logp if logp is not None else self.logp, cache=self.cache)


def measure(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    acceptance: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    logp: torch.Tensor | None = None,
    validate: bool = True,
) -> Mismatch:
    r"""Build the [`Mismatch`][sparsecorr.mismatch.Mismatch] record of a batch.

    \(\ell_t = \mathrm{clamp}(\text{old\_logp}_t - \text{rollout\_logp}_t, \pm 20)\) where the
    token is masked in and the difference is finite (a NaN or ±inf in either log-prob makes it
    non-finite), else 0. Non-finite tokens are dropped from ``valid`` and counted
    (``Mismatch.nonfinite``); they never reach a correction or a loss. No gradient flows.

    Cost: on the CPU the common case (every difference finite, none beyond ±20) is decided by
    one ``aminmax`` read back on the host, after which ``valid`` is ``mask`` itself (do not
    modify it in place while the record is in use) and nothing is cleaned or clamped; on other
    devices (no read-back) and in the other cases the general path runs (``torch.isfinite``'s
    equivalent, cleaning, clamping). Both give the same record.

    Args:
        old_logp: dense log-probs of the sampled tokens (rollout-time weights).
        rollout_logp: the sparse sampler's log-probs of the same tokens.
        mask: bool, True = the token counts.
        acceptance: optional per-token acceptance rate (non-finite entries are ignored by its
            consumers).
        advantages: optional context for corrections that read it (OPSM).
        logp: optional learner log-probs, context for OPSM (stored detached).
        validate: check types and shapes (set False in a hot loop once inputs are trusted).

    Shapes:
        old_logp, rollout_logp, mask, acceptance, logp: ``[B, T]``; advantages ``[B]`` or
        ``[B, T]`` -> ``Mismatch``.
    """
    if validate:
        check_float_tensor("old_logp", old_logp, ndim=2)
        check_float_tensor("rollout_logp", rollout_logp, ndim=2)
        check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp)
        check_mask(mask, old_logp)
        if acceptance is not None:
            check_float_tensor("acceptance", acceptance, ndim=2)
            check_same_shape(old_logp=old_logp, acceptance=acceptance)
        if advantages is not None:
            check_advantages(advantages, old_logp)
        if logp is not None:
            check_float_tensor("logp", logp, ndim=2)
            check_same_shape(old_logp=old_logp, logp=logp)
    with torch.no_grad():
        raw = old_logp.detach().float() - rollout_logp.detach().float()
        cache = _host_fast_path(raw, mask)
        if cache is not None:  # every entry finite (CPU): raw is the record's log-ratio already
            valid = mask
        else:
            valid, scratch = finite_in_scratch(raw, mask)
            valid_f = float_into_(scratch, valid)
            # the buffer is free once lr is masked: ratio_m1 takes it
            cache = {"_spare": valid_f, "valid_f": valid_f, "valid_count": count_float(valid_f, valid)}
            # in place: clean, clamp, zero outside the valid tokens (a multiply, not torch.where)
            raw.nan_to_num_(0.0, 0.0, 0.0).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).mul_(valid_f)
    return Mismatch(log_ratio=raw, valid=valid, mask=mask, old_logp=old_logp, rollout_logp=rollout_logp,
                    acceptance=acceptance, advantages=advantages,
                    logp=None if logp is None else logp.detach(), cache=cache)


def _host_fast_path(raw: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor] | None:
    r"""On the CPU, where reading a value back costs nothing: zero ``raw`` outside ``mask`` in
    place (a NaN or ±inf stays non-finite: \(\pm\infty \cdot 0\) is NaN) and take its extremes
    (``aminmax`` propagates NaN and ±inf). When both are finite, ``raw`` is the record's
    log-ratio (no cleaning; clamped only if an extreme lies beyond ±``LOG_RATIO_CLAMP``) and
    the returned cache holds the float mask, the counts (every masked-in token is valid) and
    the extremes the metrics read. Otherwise ``None``: the general path runs on ``raw``
    (masked, so its non-finite entries inside ``mask`` are where they were)."""
    if raw.device.type != "cpu" or mask.shape != raw.shape or raw.numel() == 0:
        return None
    mask_f = float_into_(torch.empty_like(raw), mask)
    lo, hi = torch.aminmax(raw.mul_(mask_f))
    lo_v, hi_v = lo.item(), hi.item()
    if not (math.isfinite(lo_v) and math.isfinite(hi_v)):
        return None
    if lo_v < -LOG_RATIO_CLAMP or hi_v > LOG_RATIO_CLAMP:
        lo, hi = torch.aminmax(raw.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    n = count_float(mask_f, mask)
    return {"_spare": mask_f, "valid_f": mask_f, "valid_count": n, "input_count": n,
            "log_ratio_extremes": (lo, hi)}


def _holders(cache: dict, key: str) -> tuple[int, int]:
    """References to the tensor ``cache[key]`` beyond ``cache``'s own entries, and the number
    of tensors on its storage (as this interpreter and torch count them)."""
    t = cache[key]
    entries = sum(1 for v in cache.values() if v is t)
    return sys.getrefcount(t) - entries, _USE_COUNT(t.untyped_storage()._cdata)


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
# the counts of a tensor held by a cache alone, measured once the same way (Python versions
# count a frame's references differently; torch's count includes the temporary storage object)
_ALONE = _holders({"t": torch.empty(1)}, "t") if _USE_COUNT is not None else None


def _cache_only(cache: dict, key: str) -> bool:
    """Whether the tensor ``cache[key]`` is held by ``cache``'s entries alone: no other
    reference to it (a correction's weights, a caller's variable) and no other tensor on its
    storage (a view). Only such a buffer may be overwritten. Without torch's storage use count
    (a private API, present in the pinned 2.13), never."""
    if _ALONE is None or not isinstance(cache.get(key), torch.Tensor):
        return False
    refs, tensors = _holders(cache, key)
    return refs <= _ALONE[0] and tensors <= _ALONE[1]


def _extremes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d ``(min, max)`` of ``x`` (both 0 when it is empty)."""
    if x.numel() == 0:
        z = torch.zeros((), device=x.device)
        return z, z
    return torch.aminmax(x)
