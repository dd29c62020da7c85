r"""The correction interface: inputs, the ``Correction`` result, composition.

A *correction* is any callable ``(CorrectionInputs) -> Correction``. It turns the per-token
sparse-to-dense mismatch \(\ell_t = \text{old\_logp}_t - \text{rollout\_logp}_t\) into detached
importance weights \(w_t\) and a rejection mask; the loss
(:func:`sparsecorr.losses.sparse_grpo`) multiplies each kept token's PPO term by \(w_t\) and
drops rejected tokens from both its numerator and denominator. Corrections compose with
[`chain`][sparsecorr.correction.chain] (weights multiply, masks AND, metrics merge), in the
spirit of optax's composable gradient transformations.

Non-finite rollout (or dense) log-probs never reach a loss: every correction starts from
``clean_mask = mask & isfinite(old_logp) & isfinite(rollout_logp)`` and counts what it removed
in ``correction/nonfinite_count``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._checks import check_float_tensor, check_mask, check_same_shape, count, finite

__all__ = [
    "Chain",
    "Correction",
    "CorrectionFn",
    "CorrectionInputs",
    "chain",
    "finalize",
    "prepare",
    "transform_of",
]

LOG_CLAMP = 20.0


@dataclass(frozen=True)
class CorrectionInputs:
    """What a correction may read. Tensors are ``[B, T]`` unless noted.

    Attributes:
        old_logp: dense model log-probs of the sampled tokens (rollout-time weights).
        rollout_logp: sparse sampler log-probs of the same tokens.
        mask: bool, True = the token counts.
        acceptance: optional per-token acceptance rate in [0, 1] (Sparrow; ``sparse_tail``).
        advantages: optional ``[B]`` or ``[B, T]`` advantages (OPSM).
        logp: optional detached learner log-probs (OPSM reads the current policy when given).
    """

    old_logp: torch.Tensor
    rollout_logp: torch.Tensor
    mask: torch.Tensor
    acceptance: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    logp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_float_tensor("old_logp", self.old_logp, ndim=2)
        check_float_tensor("rollout_logp", self.rollout_logp)
        check_same_shape(old_logp=self.old_logp, rollout_logp=self.rollout_logp,
                         acceptance=self.acceptance, logp=self.logp)
        check_mask(self.mask, self.old_logp)
        if self.advantages is not None and self.advantages.shape not in (
            self.old_logp.shape, self.old_logp.shape[:1]
        ):
            raise ValueError(
                f"advantages: expected shape {tuple(self.old_logp.shape[:1])} or "
                f"{tuple(self.old_logp.shape)}, got {tuple(self.advantages.shape)}"
            )


@dataclass(frozen=True)
class Correction:
    """Detached weights, a rejection mask and metrics for one batch.

    Attributes:
        weights: ``[B, T]`` float32, detached, 0 where ``mask`` is False.
        mask: ``[B, T]`` bool, a subset of the input mask (non-finite tokens removed).
        metrics: detached 0-d tensors named ``correction/...``.

    Shapes:
        weights, mask: ``[B, T]``; ``sequence_mask``: ``[B]``.
    """

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, torch.Tensor]

    @property
    def sequence_mask(self) -> torch.Tensor:
        """``[B]`` bool: sequences that keep at least one token (pass to ``group_advantages``)."""
        return self.mask.any(dim=-1)


CorrectionFn = Callable[[CorrectionInputs], Correction]


def prepare(inputs: CorrectionInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_ratio, clean_mask, nonfinite_count)`` shared by every correction.

    ``log_ratio`` is float32, clamped to ±20, 0 where ``clean_mask`` is False. A token is
    clean when it is masked in and ``old_logp - rollout_logp`` is finite (NaN or ±inf in either
    log-prob makes the difference non-finite).
    """
    raw = inputs.old_logp.detach().float() - inputs.rollout_logp.detach().float()
    clean = inputs.mask & finite(raw)
    lr = torch.where(clean, raw.clamp(-LOG_CLAMP, LOG_CLAMP), 0.0)
    return lr, clean, count(inputs.mask) - count(clean)


def finalize(
    weights: torch.Tensor,
    mask: torch.Tensor,
    inputs: CorrectionInputs,
    extra: dict[str, torch.Tensor] | None = None,
    *,
    nonfinite: torch.Tensor | None = None,
) -> Correction:
    """Build a :class:`Correction` with the standard metrics.

    Standard metrics: ``kept_token_frac`` and ``kept_seq_frac`` (of the input's tokens and
    non-empty sequences), ``ess`` (normalised effective sample size of the kept weights),
    ``weight_mean``/``weight_min``/``weight_max`` over kept tokens, ``nonfinite_count``.
    """
    w = torch.where(mask, weights.detach().float(), 0.0)
    with torch.no_grad():
        kept = count(mask)
        s1, s2 = w.sum(), w.square().sum()
        seq_in = inputs.mask.any(-1)
        big = torch.tensor(float("inf"), device=w.device)
        metrics = {
            "correction/kept_token_frac": kept / count(inputs.mask).clamp(min=1),
            "correction/kept_seq_frac": count(mask.any(-1) & seq_in) / count(seq_in).clamp(min=1),
            # normalised ESS (sum w)^2 / (n sum w^2), 0 when nothing is kept
            "correction/ess": torch.where(s2 > 0, s1.square() / (kept * s2).clamp(min=1e-30), 0.0),
            "correction/weight_mean": s1 / kept.clamp(min=1),
            "correction/weight_min": torch.where(kept > 0, torch.where(mask, w, big).amin(), 0.0),
            "correction/weight_max": w.amax() if w.numel() else torch.zeros(()),
        }
        if nonfinite is None:
            nonfinite = prepare(inputs)[2]
        metrics["correction/nonfinite_count"] = nonfinite
        metrics.update(extra or {})
    return Correction(weights=w, mask=mask,
                      metrics={k: v.detach().float().reshape(()) for k, v in metrics.items()})


def transform_of(piece: CorrectionFn, inputs: CorrectionInputs, lr: torch.Tensor,
                 clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(weights, kept, extra_metrics)`` of one piece, without building a Correction.

    Presets expose ``transform(inputs, lr, clean)`` so a chain prepares the log-ratio once and
    computes the standard metrics once; any other callable is simply called.
    """
    if hasattr(piece, "transform"):
        return piece.transform(inputs, lr, clean)
    c = piece(inputs)
    return c.weights, c.mask & clean, _piece_metrics(c.metrics)


@dataclass(frozen=True)
class Chain:
    """Several corrections applied to the same inputs: weights multiply, masks AND.

    Piece-specific metrics (``truncated_frac``, ``vetoed_seqs``, ...) are merged (a later piece
    wins a name clash); the standard metrics are computed once, on the combined result.
    """

    pieces: tuple[CorrectionFn, ...]

    def transform(self, inputs: CorrectionInputs, lr: torch.Tensor, clean: torch.Tensor):
        weights, mask, extra = None, clean, {}
        for piece in self.pieces:
            w, kept, metrics = transform_of(piece, inputs, lr, clean)
            weights = w if weights is None else weights * w
            mask = mask & kept
            extra.update(metrics)
        return weights, mask, extra

    def __call__(self, inputs: CorrectionInputs) -> Correction:
        lr, clean, nonfinite = prepare(inputs)
        weights, mask, extra = self.transform(inputs, lr, clean)
        return finalize(weights, mask, inputs, extra, nonfinite=nonfinite)


_STANDARD = ("kept_token_frac", "kept_seq_frac", "ess", "weight_mean", "weight_min",
             "weight_max", "nonfinite_count")


def _piece_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in metrics.items() if k.split("/", 1)[-1] not in _STANDARD}


def chain(*corrections: CorrectionFn) -> Chain:
    """Compose corrections: ``chain(tis(cap=2.0), veto(1e-4))``.

    Weights multiply, masks AND, metrics merge; each piece sees the original inputs.
    """
    if not corrections:
        raise ValueError("corrections: expected at least one correction, got none")
    for i, c in enumerate(corrections):
        if not callable(c):
            raise ValueError(f"corrections[{i}]: expected a callable correction, got {type(c).__name__}")
    return Chain(tuple(corrections))
