r"""The shared mismatch record: built once per batch, read by metrics, corrections and the loss.

Every consumer of the sparse-to-dense mismatch needs the same three things: the per-token
log-ratio \(\ell_t = \text{old\_logp}_t - \text{rollout\_logp}_t\), which tokens are valid
(masked in and finite) and how many were dropped as non-finite. [`measure`][sparsecorr.mismatch.measure]
computes them once, as plain tensor code, into a frozen [`Mismatch`][sparsecorr.mismatch.Mismatch];
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

from dataclasses import dataclass

import torch

from .._checks import (
    check_advantages,
    check_float_tensor,
    check_mask,
    check_same_shape,
    count,
    count_int,
)
from .._masks import extremes, row_any, total
from .._ratio import LOG_RATIO_CLAMP, clamp_log_ratio

__all__ = ["LOG_RATIO_CLAMP", "Mismatch", "measure"]


@dataclass(frozen=True, eq=False)
class Mismatch:
    r"""Per-token sampler/learner mismatch of one batch (build it with ``measure``).

    A frozen record with no cache: every derived quantity below is a plain function of the
    fields, computed when read (under ``torch.compile`` a value read twice is computed once).

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
        advantages: optional ``[B]``, ``[B, 1]`` or ``[B, T]`` advantages, context for
            corrections that read them (OPSM); set by ``sparse_grpo`` or ``with_context``.
        logp: optional detached learner log-probs, context for OPSM (drift to the current
            policy); set by ``sparse_grpo`` or ``with_context``.

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

    @property
    def shape(self) -> torch.Size:
        return self.log_ratio.shape

    @property
    def ratio(self) -> torch.Tensor:
        r"""float32 \(\rho_t = e^{\ell_t}\), 1 where ``valid`` is False.  ``[B, T]``"""
        return torch.exp(self.log_ratio)

    @property
    def ratio_m1(self) -> torch.Tensor:
        r"""float32 \(\rho_t - 1 = \mathrm{expm1}(\ell_t)\), exactly 0 where ``valid`` is False
        (``expm1`` keeps a small \(\ell_t\) exact for the \(k_3\) metric).  ``[B, T]``"""
        return torch.expm1(self.log_ratio)

    @property
    def log_ratio_sum(self) -> torch.Tensor:
        r"""0-d float32 \(\sum_t \ell_t\) over the valid tokens."""
        return total(self.log_ratio)

    @property
    def log_ratio_extremes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """0-d ``(min, max)`` of ``log_ratio`` over every entry (0 at the non-valid ones; both 0
        for an empty batch)."""
        return _extremes(self.log_ratio)

    @property
    def valid_f(self) -> torch.Tensor:
        """float32 ``valid`` (1/0).  ``[B, T]``"""
        return self.valid.float()

    @property
    def valid_count(self) -> torch.Tensor:
        """0-d int64: number of valid tokens."""
        return count_int(self.valid)

    @property
    def input_count(self) -> torch.Tensor:
        """0-d int64: number of masked-in tokens."""
        return count_int(self.mask)

    @property
    def tokens(self) -> torch.Tensor:
        """0-d float32: number of valid tokens."""
        return count(self.valid)

    @property
    def input_tokens(self) -> torch.Tensor:
        """0-d float32: number of masked-in tokens."""
        return count(self.mask)

    @property
    def nonfinite(self) -> torch.Tensor:
        """0-d float32: masked-in tokens whose log-ratio was NaN or ±inf."""
        return count(self.mask & ~self.valid)

    @property
    def valid_rows(self) -> torch.Tensor:
        """``[B]`` bool: rows with at least one valid token."""
        return row_any(self.valid)

    @property
    def input_rows(self) -> torch.Tensor:
        """``[B]`` bool: rows with at least one masked-in token."""
        return row_any(self.mask)

    def with_context(
        self, *, advantages: torch.Tensor | None = None, logp: torch.Tensor | None = None,
        validate: bool = True,
    ) -> Mismatch:
        """A copy (no tensor copied) carrying ``advantages`` / detached ``logp`` for corrections
        that read them (OPSM). ``validate=False`` skips the shape checks (inputs already
        checked, as ``sparse_grpo`` does)."""
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
                        logp=logp if logp is not None else self.logp)


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
    Three element-wise ops and no host read: the same code on every device, compile-clean.

    Args:
        old_logp: dense log-probs of the sampled tokens (rollout-time weights).
        rollout_logp: the sparse sampler's log-probs of the same tokens.
        mask: bool, True = the token counts.
        acceptance: optional per-token acceptance rate (non-finite entries are ignored by its
            consumers).
        advantages: optional context for corrections that read it (OPSM): ``[B]``, ``[B, 1]``
            or ``[B, T]``.
        logp: optional learner log-probs, context for OPSM (stored detached).
        validate: check types and shapes (host-side checks of shapes and dtypes only).

    Shapes:
        old_logp, rollout_logp, mask, acceptance, logp: ``[B, T]``; advantages ``[B]``,
        ``[B, 1]`` or ``[B, T]`` -> ``Mismatch``.
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
    raw = old_logp.detach().float() - rollout_logp.detach().float()  # [B, T]
    valid = mask & torch.isfinite(raw)  # [B, T]
    log_ratio = torch.where(valid, clamp_log_ratio(raw), 0.0)  # [B, T], 0 off valid (NaN-safe)
    return Mismatch(log_ratio=log_ratio, valid=valid, mask=mask, old_logp=old_logp,
                    rollout_logp=rollout_logp, acceptance=acceptance, advantages=advantages,
                    logp=None if logp is None else logp.detach())


def _extremes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d ``(min, max)`` of ``x`` (both 0 when it is empty; the test is on the static shape)."""
    if x.numel() == 0:
        z = torch.zeros((), device=x.device)
        return z, z
    return extremes(x)
