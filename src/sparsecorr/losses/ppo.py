r"""What a surrogate takes and returns, and the clipped PPO surrogate as plain tensor code.

Per token, with \(\rho_t = e^{\mathrm{clamp}(\text{logp} - \text{old\_logp}, \pm 20)}\),
advantage \(A\), detached IS weight \(w_t\) and clip range \([1-\varepsilon_l, 1+\varepsilon_h]\):

\[
\ell_t = -w_t \cdot \min\big(\rho_t A,\ \mathrm{clip}(\rho_t, 1-\varepsilon_l, 1+\varepsilon_h)\,A\big),
\]

and with dual clip \(c > 1\) (Ye et al. 2020), for \(A < 0\), \(\max(\min(\cdot), cA)\). Both
clips and the dual clip are one clamp with per-entry bounds:
\(\min(\rho A, \mathrm{clip}(\rho)A) = A\,\mathrm{clamp}(\rho, \ell, h)\) with \([\ell, h] =
[0, 1+\varepsilon_h]\) for \(A \ge 0\) and \([1-\varepsilon_l, c]\) for \(A<0\); autograd then
gives \(\partial \ell_t / \partial\,\text{logp}_t = \ell_t\) where the clamp leaves \(\rho_t\)
unchanged and 0 where it moves it. The ratio is handled as \(\rho_t - 1\) (``expm1``) and the
token loss as \(-w_tA + (-w_tA)\,\mathrm{clamp}(\rho_t - 1)\): near the on-policy point, where
PPO runs, the summed loss is a sum of cancelling terms and this keeps its rounding small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._checks import count
from .._masks import and_rows, masked_extremes, rows_count, rows_total, total
from .._ratio import LOG_RATIO_CLAMP, ratio, ratio_m1
from .aggregation import scaled_sum
from .linearize import linearized

__all__ = ["SurrogateInputs", "SurrogateOutput", "learner_log_ratio", "ppo_clip_forward", "ratio_extremes",
           "weighted_loss"]

#: the upper bound for A < 0 without a dual clip: a ratio pinned at e^{+20} counts as clipped
HUGE = math.exp(LOG_RATIO_CLAMP) * (1 - 1e-5)


@dataclass(frozen=True)
class SurrogateInputs:
    r"""What ``sparse_grpo`` hands a surrogate (all finite where ``kept``).

    Attributes:
        logp: learner log-probs (carry the gradient; any float dtype).  ``[B, T]``
        old_logp: float32 detached dense log-probs.  ``[B, T]``
        log_ratio: float32 detached \(\text{logp} - \text{old\_logp}\), 0 where not kept.  ``[B, T]``
        kept: bool, the tokens in the loss, as a token part: the loss's tokens are ``kept``
            on the ``rows`` (``loss_mask``).  ``[B, T]``
        advantages: float32, 0 where non-finite.  ``[B, 1]`` or ``[B, T]``
        weights: float32 detached IS weights \(w_t\) of the correction *before* its batch
            scale, 1 on kept tokens without a correction, 0 where not kept.  ``[B, T]``
        neg_weighted_adv: float32 \(-w_t A\), 0 where not kept.  ``[B, T]``
        scales: row scales of the aggregation, 0 on a row ``rows`` drops.  ``[B]`` or ``[1]``
        weight_scale: the correction's 0-d batch scale \(s\) (``Correction.scale``) or
            ``None``: a surrogate linear in \(w_t\) hands its unscaled token loss to
            [`weighted_loss`][sparsecorr.losses.ppo.weighted_loss], which applies \(s\) to the
            scalar loss (one multiply, no pass over ``[B, T]`` that waits for the scale).
        n: number of kept tokens.  ``[]``
        is_ratio: float32 detached importance ratio
            \(\pi_\text{old}/\pi_\text{rollout}\) as the correction weighted it (``weights``
            times ``weight_scale``),
            for surrogates that fold it into their own ratio (VESPO) instead of multiplying the
            token loss by it; ``None`` without a correction.  ``[B, T]``
        full_metrics: whether the caller reports the full metric set.
        rows: bool, the rows a correction keeps as a whole (a veto's row part,
            ``Correction.factor``), or ``None`` for every row: a row it drops is removed by
            its row scale (``scales``) and by the row-weighted sums ``count`` / ``total``, not
            by a ``[B, T]`` mask, so the token pass never waits for the row test (a
            surrogate's token loss may be non-zero there; ``sparse_grpo`` zeroes the
            ``token_loss`` it returns).  ``[B]``
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    log_ratio: torch.Tensor
    kept: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    neg_weighted_adv: torch.Tensor
    scales: torch.Tensor
    n: torch.Tensor
    is_ratio: torch.Tensor | None = None
    full_metrics: bool = False
    weight_scale: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """bool ``kept`` on the kept ``rows``: the tokens in the loss.  ``[B, T]``"""
        return self.kept if self.rows is None else and_rows(self.kept, self.rows)

    def count(self, mask: torch.Tensor) -> torch.Tensor:
        """0-d float32 number of True entries of a ``[B, T]`` bool ``mask`` within ``kept``,
        on the kept ``rows``."""
        return count(mask) if self.rows is None else rows_count(mask, self.rows)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """0-d sum of a ``[B, T]`` tensor that is 0 off ``kept``, on the kept ``rows``."""
        return total(x) if self.rows is None else rows_total(x, self.rows)


@dataclass(frozen=True)
class SurrogateOutput:
    """``token_loss`` ``[B, T]`` and ``loss`` ``[]`` (both carry the gradient, taken in the
    forward pass by [`linearized`][sparsecorr.losses.linearize.linearized]), the detached
    ratio the surrogate used (``ratio``: ``[B, T]`` per token, ``[B, 1]`` per sequence; what
    the glue logs instead of recomputing it) and ``sums()``: the 0-d sums and counts of its
    metrics (``reduce_metrics`` conventions; computed only when read).

    ``kl_ratio``: the importance ratio as a function of the float32 learner log-probs
    (``z -> [B, T]`` or ``[B, 1]``, differentiable) that ``KLPenalty(bias_correction=True)``
    multiplies the k3 term by.
    """

    token_loss: torch.Tensor
    loss: torch.Tensor
    ratio: torch.Tensor
    kl_ratio: Callable[[torch.Tensor], torch.Tensor]
    sums: Callable[[], dict[str, torch.Tensor]] = dict


def weighted_loss(x: SurrogateInputs, token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(token_loss, loss)`` of a surrogate linear in \(w_t\) from its token loss before the
    correction's batch scale \(s\): \(s\,\ell_t\) and \(s \sum_i r_i \sum_t \ell_{i,t}\)
    (\(s\) multiplies the scalar, so the loss's reduction does not wait for it).
    ``[B, T]`` -> ``[B, T]``, ``[]``"""
    loss = scaled_sum(token_loss, x.scales)
    if x.weight_scale is None:
        return token_loss, loss
    return token_loss * x.weight_scale, loss * x.weight_scale


def learner_log_ratio(x: SurrogateInputs, z: torch.Tensor) -> torch.Tensor:
    r"""\(\text{logp} - \text{old\_logp}\) of the float32 log-probs ``z``, 0 where not kept.  ``[B, T]``"""
    return torch.where(x.kept, z - x.old_logp, 0.0)


def token_ratio(x: SurrogateInputs) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""\(z \mapsto \rho_t\), 1 where not kept (a surrogate's ``kl_ratio``).  ``[B, T]``"""
    return lambda z: ratio(learner_log_ratio(x, z))


def ppo_clip_forward(x: SurrogateInputs, *, clip_low: float, clip_high: float,
                     dual_clip: float | None) -> SurrogateOutput:
    """Token-level weighted clipped surrogate, its aggregate and its metric sums (``PPOClip``)."""
    adv = x.advantages  # [B, 1] or [B, T]
    pos = adv >= 0
    lo_m1 = torch.where(pos, -1.0, -clip_low)  # [B, 1] or [B, T]: the bounds on rho - 1
    hi_m1 = torch.where(pos, clip_high, (HUGE if dual_clip is None else dual_clip) - 1.0)

    def token_loss(z: torch.Tensor):
        rho_m1 = ratio_m1(learner_log_ratio(x, z))  # [B, T], 0 off kept
        clipped_m1 = torch.clamp(rho_m1, lo_m1, hi_m1)  # [B, T]
        # (1 + clipped)(-w A): the on-policy part -w A exactly, the ratio's move beside it
        return torch.where(x.kept, x.neg_weighted_adv + x.neg_weighted_adv * clipped_m1, 0.0), rho_m1

    tl, r = linearized(token_loss, x.logp)  # [B, T]; r = rho - 1, detached
    token_loss_, loss = weighted_loss(x, tl)

    def sums() -> dict[str, torch.Tensor]:
        above, below = x.kept & (r > hi_m1), x.kept & (r < lo_m1)
        out = {"loss/clip_frac_low": x.count(below), "loss/clip_frac_high": x.count(above & pos)}
        if dual_clip is not None:
            out["loss/clip_frac_dual"] = x.count(above & ~pos)
        else:  # a ratio pinned at e^{+20} on an A < 0 token counts as clipped above
            out["loss/clip_frac_high"] = x.count(above)
        out["loss/ratio_mean"] = x.n + x.total(r)  # rho - 1 is 0 off the kept tokens
        out["loss/ppo_kl_k1_mean"] = -x.total(x.log_ratio)
        if x.full_metrics:
            out.update(ratio_extremes(r + 1.0, x.loss_mask, x.n))
        return out

    return SurrogateOutput(token_loss_, loss, ratio=r + 1.0, kl_ratio=token_ratio(x), sums=sums)


def ratio_sums(x: SurrogateInputs, r: torch.Tensor) -> dict[str, torch.Tensor]:
    """``loss/ratio_mean`` and ``loss/ppo_kl_k1_mean`` as kept-token sums (their ``#n`` counts
    are added by ``sparse_grpo``)."""
    return {"loss/ratio_mean": x.total(torch.where(x.kept, r, 0.0)),
            "loss/ppo_kl_k1_mean": -x.total(x.log_ratio)}


def ratio_extremes(r: torch.Tensor, kept: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """``loss/ratio_min`` / ``loss/ratio_max`` over kept tokens (NaN when none)."""
    lo, hi = masked_extremes(r, kept)
    return {"loss/ratio_min#min": lo, "loss/ratio_min#n": n, "loss/ratio_max#max": hi, "loss/ratio_max#n": n}
