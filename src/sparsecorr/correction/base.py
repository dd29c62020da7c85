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
from .._masks import row_any
from ..mismatch import MetricPlan, Mismatch

__all__ = ["Correction", "CorrectionFn", "Count", "chain"]

@dataclass(frozen=True)
class Count:
    """A lazy piece metric ``offset + coef * count / denominator``: ``count()`` is computed on
    first access; ``per_token=True`` divides by the source's valid tokens (a fraction of them),
    else the metric is the (scaled) count itself. ``count()`` may also return a tuple of
    ``(0-d tensor, factor)`` terms, the count being their linear combination (an empty tuple:
    0), which the plan forms without a tensor op. Resolved with every other metric in a few
    batched ops (``MetricPlan``)."""

    count: Callable[[], torch.Tensor | tuple[tuple[torch.Tensor, float], ...]]
    per_token: bool = False
    coef: float = 1.0
    offset: float = 0.0


#: a metric value, a function computing it on first access, or a lazy ``Count``
MetricValue = torch.Tensor | Callable[[], torch.Tensor] | Count


@dataclass(frozen=True, eq=False)
class Correction:
    r"""Detached weights, a rejection mask and (lazy) metrics for one batch.

    The weight of kept token \(t\) is ``token_weights[t] * scale`` (each factor optional), 0
    outside ``mask``; keeping the batch-normalisation ``scale`` apart lets the loss fold it into
    the per-row advantages instead of rewriting a ``[B, T]`` tensor.

    Attributes:
        mask: bool, the tokens that stay in the loss. With ``source`` set it must be a subset of
            ``source.valid`` (every library correction guarantees it; the loss trusts it).
        token_weights: float32 weights, 0 outside ``mask``, or ``None`` for weight 1 on every
            kept token (a pure rejection). Read ``weights`` for the final tensor in every case.
        scale: optional 0-d factor applied to every weight (batch normalisation).
        piece_metrics: correction-specific metrics (``correction/truncated_frac`` ...), each a
            0-d tensor or a function computing it on first access.
        source: the ``Mismatch`` it was computed from (for ``nonfinite_count`` and the
            fractions of the input); ``None`` when built by hand.

    Shapes:
        mask, token_weights, weights: ``[B, T]``; scale: ``[]``; sequence_mask: ``[B]``.
    """

    mask: torch.Tensor
    token_weights: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    piece_metrics: Mapping[str, MetricValue] = field(default_factory=dict)
    source: Mismatch | None = None
    #: reductions already computed by the correction ("tokens", "weight_sum"), reused by metrics
    cache: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

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

    @cached_property
    def weights(self) -> torch.Tensor:
        """float32 ``[B, T]`` weights, detached, 0 outside ``mask``."""
        w = self.mask.float() if self.token_weights is None else self.token_weights.detach().float()
        return w if self.scale is None else w * self.scale.detach().reshape(())

    @cached_property
    def sequence_mask(self) -> torch.Tensor:
        """``[B]`` bool: sequences that keep at least one token (pass to ``group_advantages``)."""
        return row_any(self.mask)

    @cached_property
    def tokens(self) -> torch.Tensor:
        """0-d float32: the number of kept tokens."""
        return self.cache["tokens"] if "tokens" in self.cache else count(self.mask)

    @cached_property
    def metrics(self) -> dict[str, torch.Tensor]:
        """Detached 0-d float32 tensors named ``correction/...``: ``kept_token_frac``,
        ``weight_mean``, ``ess``, ``nonfinite_count`` and the piece metrics (``full_metrics``
        adds ``kept_seq_frac`` and the weight extremes)."""
        return self.metrics_at("default")

    @cached_property
    def full_metrics(self) -> dict[str, torch.Tensor]:
        """``metrics`` plus ``kept_seq_frac``, ``weight_min``, ``weight_max`` (two more passes)."""
        return self.metrics_at("full")

    def metrics_at(self, level: str) -> dict[str, torch.Tensor]:
        plan = MetricPlan()
        self.add_metrics(plan, full=level == "full")
        return plan.resolve()  # detached 0-d float32 already

    def add_metrics(self, plan: MetricPlan, *, full: bool = False) -> None:
        """Register every metric of this correction on ``plan`` (``sparse_grpo`` resolves the
        record's, the correction's and the loss's metrics together)."""
        standard_metrics(self, plan, full=full)
        tokens = None
        for name, value in self.piece_metrics.items():
            if isinstance(value, Count):
                if value.per_token and tokens is None:
                    tokens = plan.add(self.source.valid_count if self.source is not None else self.tokens)
                c = value.count()
                terms = c if isinstance(c, tuple) else ((c, 1.0),)
                plan.ratio(name, {plan.add(t): value.coef * k for t, k in terms},
                           tokens if value.per_token else None, offset=value.offset)
            else:
                plan.value(name, value() if callable(value) else value)

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


#: the one correction protocol
CorrectionFn = Callable[[Mismatch], Correction]


def standard_metrics(c: Correction, plan: MetricPlan, *, full: bool = False) -> None:
    """Register the metrics every correction reports on ``plan``: one dot product over
    ``[B, T]`` (the counts and the weight sum are cached), three more passes with ``full``."""
    src = c.source
    kept = c.tokens
    w = c.token_weights
    if w is None:
        s1, s2 = kept, kept
    else:
        flat = w.detach().float().reshape(-1)
        s1 = c.cache["weight_sum"] if "weight_sum" in c.cache else flat.sum()
        s2 = torch.dot(flat, flat)
    k_kept = plan.add(kept)
    k_in = plan.add(count(c.mask) if src is None else src.input_count)
    k_w = plan.add(s1 if c.scale is None else s1 * c.scale.detach().reshape(()))
    k_ess_num, k_ess_den = plan.add(s1.square()), plan.add(kept * s2)
    plan.ratio("correction/kept_token_frac", {k_kept: 1.0}, k_in)
    plan.ratio("correction/weight_mean", {k_w: 1.0}, k_kept)
    # normalised ESS (sum w)^2 / (n sum w^2), 0 when nothing is kept
    plan.ratio("correction/ess", {k_ess_num: 1.0}, k_ess_den)
    plan.ratio("correction/nonfinite_count", plan.difference(src.input_count, src.valid_count)
               if src is not None else {})
    if full:
        rows_in = row_any(c.mask) if src is None else src.input_rows
        plan.ratio("correction/kept_seq_frac", {plan.add(count(c.sequence_mask & rows_in)): 1.0},
                   plan.add(count(rows_in)))
        ww = c.weights
        mean = s1 / kept.clamp(min=1) if c.scale is None else s1 * c.scale.reshape(()) / kept.clamp(min=1)
        lo, hi = torch.aminmax(torch.where(c.mask, ww, mean)) if ww.numel() else (mean, mean)
        plan.extreme("correction/weight_min", lo.neg(), empty=k_kept, sign=-1.0)
        plan.extreme("correction/weight_max", hi, empty=k_kept)


@dataclass(frozen=True)
class Chain:
    """Several corrections applied to the same record: weights multiply, masks AND.

    Piece metrics merge (a later piece wins a name clash); the standard metrics are computed
    once, lazily, on the combined result. Build with [`chain`][sparsecorr.correction.chain].
    """

    pieces: tuple[CorrectionFn, ...]

    def __call__(self, mm: Mismatch) -> Correction:
        mask, weights, scale, metrics = None, None, None, {}
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
            if c.scale is not None:
                scale = c.scale if scale is None else scale * c.scale
            metrics.update(c.piece_metrics)
        if weights is not None and mask_only:
            # every weight piece is 0 outside its own mask; a pure rejection is not
            weights = torch.where(mask, weights, 0.0)
        return Correction(mask=mask, token_weights=weights, scale=scale, piece_metrics=metrics, source=mm)


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
