r"""The correction protocol: ``Mismatch -> Correction``, and composition with ``chain``.

A *correction* is any callable that takes the batch's [`Mismatch`][sparsecorr.mismatch.Mismatch]
record (built once by [`measure`][sparsecorr.mismatch.measure]) and returns a
[`Correction`][sparsecorr.correction.Correction]: detached importance weights \(w_t\) and a
rejection mask over the sparse-to-dense mismatch \(\ell_t = \text{old\_logp}_t -
\text{rollout\_logp}_t\). The loss ([`sparse_grpo`][sparsecorr.losses.sparse_grpo]) multiplies
each kept token's surrogate by \(w_t\) and drops rejected tokens from both its numerator and
denominator. Corrections compose with [`chain`][sparsecorr.correction.chain] (weights multiply,
masks AND, metrics merge), in the spirit of optax's composable gradient transformations.

Non-finite log-probs never reach a loss: a correction keeps only tokens of ``Mismatch.valid``
and the standard metrics count the rest (``correction/nonfinite_count``). Metrics are computed
lazily, on first access of ``Correction.metrics``, so a loss that does not log pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .._checks import count
from ..mismatch import Mismatch

__all__ = ["Correction", "CorrectionFn", "chain"]

#: a metric value, or a function computing it on first access (metrics are lazy)
MetricValue = torch.Tensor | Callable[[], torch.Tensor]


@dataclass(frozen=True, eq=False)
class Correction:
    r"""Detached weights, a rejection mask and (lazy) metrics for one batch.

    Attributes:
        mask: bool, the tokens that stay in the loss (a subset of the source's valid tokens).
        token_weights: float32 weights, 0 outside ``mask``, or ``None`` for weight 1 on every
            kept token (a pure rejection). Read ``weights`` for a tensor in every case.
        piece_metrics: correction-specific metrics (``correction/truncated_frac`` ...), each a
            0-d tensor or a function computing it on first access.
        source: the ``Mismatch`` it was computed from (for ``nonfinite_count`` and the
            fractions of the input); ``None`` when built by hand.

    Shapes:
        mask, token_weights, weights: ``[B, T]``; sequence_mask: ``[B]``.
    """

    mask: torch.Tensor
    token_weights: torch.Tensor | None = None
    piece_metrics: Mapping[str, MetricValue] = field(default_factory=dict)
    source: Mismatch | None = None

    def __post_init__(self) -> None:
        m = self.mask
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() != 2:
            raise ValueError(f"mask: expected a [B, T] bool tensor, got "
                             f"{getattr(m, 'dtype', type(m).__name__)} {tuple(getattr(m, 'shape', ()))}")
        w = self.token_weights
        if w is not None and (not isinstance(w, torch.Tensor) or tuple(w.shape) != tuple(m.shape)
                              or not w.is_floating_point()):
            raise ValueError(f"token_weights: expected None or a float tensor of shape "
                             f"{tuple(m.shape)}, got {getattr(w, 'dtype', type(w).__name__)} "
                             f"{tuple(getattr(w, 'shape', ()))}")

    @cached_property
    def weights(self) -> torch.Tensor:
        """float32 ``[B, T]`` weights, detached, 0 outside ``mask``."""
        if self.token_weights is None:
            return self.mask.float()
        return self.token_weights.detach().float()

    @cached_property
    def sequence_mask(self) -> torch.Tensor:
        """``[B]`` bool: sequences that keep at least one token (pass to ``group_advantages``)."""
        return self.mask.any(dim=-1)

    @cached_property
    def metrics(self) -> dict[str, torch.Tensor]:
        """Detached 0-d float32 tensors: the standard metrics (``kept_token_frac``,
        ``kept_seq_frac``, ``ess``, ``weight_mean``/``weight_min``/``weight_max``,
        ``nonfinite_count``) and the piece metrics, all named ``correction/...``."""
        out = standard_metrics(self)
        for name, value in self.piece_metrics.items():
            out[name] = value() if callable(value) else value
        return {k: v.detach().float().reshape(()) for k, v in out.items()}

    def reweight(self, factor: torch.Tensor) -> Correction:
        """The same correction with every weight multiplied by ``factor`` (detached); the mask
        is unchanged. For rules that zero a token's loss but keep it in the denominator (TRL's
        entropy mask and OPSM)."""
        if not isinstance(factor, torch.Tensor) or tuple(factor.shape) != tuple(self.mask.shape):
            raise ValueError(f"factor: expected a tensor of shape {tuple(self.mask.shape)}, got "
                             f"{tuple(getattr(factor, 'shape', ())) or type(factor).__name__}")
        w = self.weights * factor.detach().float()
        return Correction(mask=self.mask, token_weights=w, piece_metrics=self.piece_metrics,
                          source=self.source)


#: the one correction protocol
CorrectionFn = Callable[[Mismatch], Correction]


def standard_metrics(c: Correction) -> dict[str, torch.Tensor]:
    """The metrics every correction reports, in five reductions over ``[B, T]``."""
    with torch.no_grad():
        w, mask = c.weights, c.mask
        kept = count(mask)
        kept1 = kept.clamp(min=1)
        flat = w.reshape(-1)
        s1, s2 = flat.sum(), torch.dot(flat, flat)
        mean = s1 / kept1
        # outside the mask put the mean, which lies inside [min, max] of the kept weights
        lo, hi = torch.aminmax(torch.where(mask, w, mean)) if w.numel() else (mean, mean)
        src = c.source
        n_in = count(mask) if src is None else src.input_tokens
        rows_in = mask.any(-1) if src is None else src.input_rows
        nan = torch.full((), float("nan"), device=w.device)
        return {
            "correction/kept_token_frac": kept / n_in.clamp(min=1),
            "correction/kept_seq_frac": count(c.sequence_mask & rows_in) / count(rows_in).clamp(min=1),
            # normalised ESS (sum w)^2 / (n sum w^2), 0 when nothing is kept
            "correction/ess": torch.where(s2 > 0, s1.square() / (kept * s2).clamp(min=1e-30), 0.0),
            "correction/weight_mean": mean,
            "correction/weight_min": torch.where(kept > 0, lo, nan),
            "correction/weight_max": torch.where(kept > 0, hi, nan),
            "correction/nonfinite_count": torch.zeros(()) if src is None else src.nonfinite,
        }


def frac(part: torch.Tensor, whole: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A lazy metric: ``count(part) / count(whole)`` (0 when ``whole`` is empty)."""
    return lambda: count(part) / count(whole).clamp(min=1)


def seqs(part: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A lazy metric: the number of True entries of a ``[B]`` mask."""
    return lambda: count(part)


@dataclass(frozen=True)
class Chain:
    """Several corrections applied to the same record: weights multiply, masks AND.

    Piece metrics merge (a later piece wins a name clash); the standard metrics are computed
    once, lazily, on the combined result. Build with [`chain`][sparsecorr.correction.chain].
    """

    pieces: tuple[CorrectionFn, ...]

    def __call__(self, mm: Mismatch) -> Correction:
        mask, weights, metrics = None, None, {}
        mask_only = False
        for piece in self.pieces:
            c = piece(mm)
            if not isinstance(c, Correction):
                raise ValueError(f"corrections: expected {piece!r} to return a Correction, got "
                                 f"{type(c).__name__}")
            mask = c.mask if mask is None else mask & c.mask
            if c.token_weights is None:
                mask_only = True
            else:
                weights = c.token_weights if weights is None else weights * c.token_weights
            metrics.update(c.piece_metrics)
        if weights is not None and mask_only:
            # every weight piece is 0 outside its own mask; a pure rejection is not
            weights = torch.where(mask, weights, 0.0)
        return Correction(mask=mask, token_weights=weights, piece_metrics=metrics, source=mm)


def chain(*corrections: CorrectionFn) -> Chain:
    """Compose corrections: ``chain(tis(cap=2.0), veto(1e-4))``.

    Weights multiply, masks AND, metrics merge; each piece sees the original record.

    Example:
        >>> import torch
        >>> from sparsecorr.correction import chain, tis, veto
        >>> from sparsecorr.mismatch import measure
        >>> old = torch.log(torch.tensor([[0.5, 0.9], [1e-6, 0.5]]))
        >>> roll = torch.log(torch.tensor([[0.25, 0.9], [0.5, 0.5]]))
        >>> c = chain(tis(cap=1.5), veto(1e-4))(measure(old, roll, torch.ones(2, 2, dtype=torch.bool)))
        >>> c.weights
        tensor([[1.5000, 1.0000],
                [0.0000, 0.0000]])
        >>> float(c.metrics["correction/vetoed_seqs"])
        1.0
    """
    if not corrections:
        raise ValueError("corrections: expected at least one correction, got none")
    for i, c in enumerate(corrections):
        if not callable(c):
            raise ValueError(f"corrections[{i}]: expected a callable Mismatch -> Correction, "
                             f"got {type(c).__name__}")
    return Chain(tuple(corrections))
