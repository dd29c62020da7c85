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
and the standard metrics count the rest (``correction/nonfinite_count``). Metrics are data: a
piece names 0-d sums and counts (``metric_sums``, conventions of
[`reduce_metrics`][sparsecorr.mismatch.reduce_metrics]); nothing is computed until they are read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from .._checks import compile_safe_hash, count
from .._masks import and_rows, masked_extremes, row_any, rows_count
from ..mismatch import Mismatch, reduce_metrics

__all__ = ["Correction", "CorrectionFn", "RowFactor", "chain", "kept_sum", "masked_extremes"]

#: a piece metric: a 0-d tensor, or a function computing it when the metrics are read
MetricValue = torch.Tensor | Callable[[], torch.Tensor]


def _check_record(mm: object) -> None:
    if not isinstance(mm, Mismatch):
        raise ValueError(f"mismatch: a correction takes measure(old_logp, rollout_logp, mask)'s "
                         f"Mismatch record, got {type(mm).__name__}")


@dataclass(frozen=True, eq=False)
class RowFactor:
    r"""A correction's mask and weights as a token part times a sequence part (a veto):
    ``mask = token_mask & rows[:, None]``, ``token_weights = where(mask, token_weights, 0)``.

    A sum over the kept tokens is then \(\sum_i \text{rows}_i \sum_t x_{i,t}\) over the token
    part: its row sums need not wait for the row test, so under ``torch.compile`` they are
    made in the same loop over a row as the test itself (``kept_sum``).

    Shapes:
        token_mask, token_weights: ``[B, T]``; rows: ``[B]`` bool.
    """

    token_mask: torch.Tensor
    token_weights: torch.Tensor | None
    rows: torch.Tensor


@dataclass(frozen=True, eq=False)
class Correction:
    r"""Detached weights, a rejection mask and metrics for one batch.

    The weight of kept token \(t\) is ``token_weights[t] * scale`` (each factor optional), 0
    outside ``mask``.

    Attributes:
        mask: bool, the tokens that stay in the loss.
        token_weights: float32 weights, 0 outside ``mask``, or ``None`` for weight 1 on every
            kept token (a pure rejection). Read ``weights`` for the final tensor in every case.
        scale: optional 0-d factor applied to every weight (batch normalisation).
        piece_metrics: correction-specific 0-d sums and counts (``correction/truncated_frac``
            and its ``#n`` count ...), each a tensor or a function computing it when read.
        source: the ``Mismatch`` it was computed from (for ``nonfinite_count`` and the
            fractions of the input); ``None`` when built by hand.
        factor: optional ``RowFactor`` of ``mask`` and ``token_weights`` (set by ``veto`` and
            kept by ``chain``), read by the sums over the kept tokens; ``None``: no factor.

    Shapes:
        mask, token_weights, weights: ``[B, T]``; scale: ``[]``; sequence_mask: ``[B]``.
    """

    mask: torch.Tensor
    token_weights: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    piece_metrics: Mapping[str, MetricValue] = field(default_factory=dict)
    source: Mismatch | None = None
    factor: RowFactor | None = None

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
        if self.scale is not None and (not isinstance(self.scale, torch.Tensor) or self.scale.numel() != 1):
            raise ValueError(f"scale: expected None or a 0-d tensor, got {self.scale!r}")

    @property
    def weights(self) -> torch.Tensor:
        """float32 ``[B, T]`` weights, detached, 0 outside ``mask``."""
        w = self.mask.float() if self.token_weights is None else self.token_weights.detach().float()
        return w if self.scale is None else w * self.scale.detach().reshape(())

    @property
    def sequence_mask(self) -> torch.Tensor:
        """``[B]`` bool: sequences that keep at least one token (pass to ``group_advantages``)."""
        return row_any(self.mask)

    @property
    def tokens(self) -> torch.Tensor:
        """0-d float32: the number of kept tokens."""
        return count(self.mask)

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        """Detached 0-d float32 tensors named ``correction/...``: ``kept_token_frac``,
        ``weight_mean``, ``ess``, ``nonfinite_count`` and the piece metrics (``full_metrics``
        adds ``kept_seq_frac`` and the weight extremes)."""
        return reduce_metrics(self.metric_sums())

    @property
    def full_metrics(self) -> dict[str, torch.Tensor]:
        """``metrics`` plus ``kept_seq_frac``, ``weight_min``, ``weight_max``."""
        return reduce_metrics(self.metric_sums(full=True))

    def metrics_at(self, level: str) -> dict[str, torch.Tensor]:
        return self.full_metrics if level == "full" else self.metrics

    def metric_sums(self, *, full: bool = False) -> dict[str, torch.Tensor]:
        """The 0-d sums and counts of every metric of this correction (reduce them, over ranks
        if need be, with ``reduce_metrics``)."""
        out = standard_sums(self, full=full)
        for name, value in self.piece_metrics.items():
            out[name] = value() if callable(value) else value
        return out

    def reweight(self, factor: torch.Tensor) -> Correction:
        """The same correction with every weight multiplied by ``factor`` (detached); the mask
        is unchanged. For rules that zero a token's loss but keep it in the denominator (TRL's
        entropy mask and OPSM)."""
        if not isinstance(factor, torch.Tensor) or tuple(factor.shape) != tuple(self.mask.shape):
            raise ValueError(f"factor: expected a tensor of shape {tuple(self.mask.shape)}, got "
                             f"{tuple(getattr(factor, 'shape', ())) or type(factor).__name__}")
        w = self.mask.float() if self.token_weights is None else self.token_weights.detach().float()
        return Correction(mask=self.mask, token_weights=w * factor.detach().float(), scale=self.scale,
                          piece_metrics=self.piece_metrics, source=self.source)


def kept_sum(c: Correction, power: int | None = None, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """0-d sum over ``c``'s kept tokens of ``w ** power`` (``w`` the token weights before the
    scale, 1 without; ``power=None``: the number of kept tokens, float32). With a ``RowFactor``
    the row sums are of the token part, times the kept rows. ``dtype``: the dtype of the sum
    over rows (the row sums are float32)."""
    f = c.factor
    mask, w = (c.mask, c.token_weights) if f is None else (f.token_mask, f.token_weights)
    if power is None:
        return count(mask) if f is None else rows_count(mask, f.rows)
    x = mask.float() if w is None else w.detach().float()  # [B, T], 0 off the token part
    x = x if power == 1 else x.pow(power)
    rows = x.sum(dim=-1)  # [B] float32 (pairwise-summed by torch and by inductor)
    rows = rows if dtype is None else rows.to(dtype)
    return (rows if f is None else rows * f.rows).sum()


#: the one correction protocol
CorrectionFn = Callable[[Mismatch], Correction]


def standard_sums(c: Correction, *, full: bool = False) -> dict[str, torch.Tensor]:
    """The sums and counts of the metrics every correction reports."""
    src = c.source
    kept = kept_sum(c)
    # the sums of the token weights, times the batch scale: a scalar on two sums, no [B, T] pass
    # that waits for the scale (nor for a veto's row test: kept_sum)
    s1, s2 = kept_sum(c, 1), kept_sum(c, 2)
    if c.scale is not None:
        scale = c.scale.detach().reshape(())
        s1, s2 = s1 * scale, s2 * scale.square()
    n_in = count(c.mask) if src is None else src.input_tokens
    out = {
        "correction/kept_token_frac": kept, "correction/kept_token_frac#n": n_in,
        "correction/weight_mean": s1, "correction/weight_mean#n": kept,
        # normalised ESS (sum w)^2 / (n sum w^2), 0 when nothing is kept
        "correction/ess": s1.square(), "correction/ess#n": kept * s2,
        "correction/nonfinite_count": (src.nonfinite if src is not None
                                       else torch.zeros((), device=c.mask.device)),
    }
    if full:
        rows_in = row_any(c.mask) if src is None else src.input_rows
        lo, hi = masked_extremes(c.weights, c.mask)
        out.update({
            "correction/kept_seq_frac": count(c.sequence_mask & rows_in),
            "correction/kept_seq_frac#n": count(rows_in),
            "correction/weight_min#min": lo, "correction/weight_min#n": kept,
            "correction/weight_max#max": hi, "correction/weight_max#n": kept,
        })
    return out


@compile_safe_hash
@dataclass(frozen=True)
class Chain:
    """Several corrections applied to the same record: weights multiply, masks AND.

    Piece metrics merge (a later piece wins a name clash); the standard metrics are computed
    on the combined result. Build with [`chain`][sparsecorr.correction.chain].
    """

    pieces: tuple[CorrectionFn, ...]

    def __call__(self, mm: Mismatch) -> Correction:
        _check_record(mm)
        tokens, rows, weights, scale, metrics = None, None, None, None, {}
        for piece in self.pieces:
            c = piece(mm)
            if not isinstance(c, Correction):
                raise ValueError(f"corrections: expected {piece!r} to return a Correction, got "
                                 f"{type(c).__name__}")
            f = c.factor  # the token parts AND, the row parts AND: mask = tokens & rows
            part, w = (c.mask, c.token_weights) if f is None else (f.token_mask, f.token_weights)
            tokens = part if tokens is None else tokens & part  # [B, T]
            if f is not None:
                rows = f.rows if rows is None else rows & f.rows  # [B]
            if w is not None:
                weights = w if weights is None else weights * w
            if c.scale is not None:
                scale = c.scale if scale is None else scale * c.scale
            metrics.update(c.piece_metrics)
        mask = tokens if rows is None else and_rows(tokens, rows)  # [B, T]
        factor = None
        if rows is not None:
            factor = RowFactor(tokens, None if weights is None else torch.where(tokens, weights, 0.0), rows)
        if weights is not None:  # a pure rejection has no weights: zero them off the final mask
            weights = torch.where(mask, weights, 0.0)
        return Correction(mask=mask, token_weights=weights, scale=scale, piece_metrics=metrics,
                          source=mm, factor=factor)


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
