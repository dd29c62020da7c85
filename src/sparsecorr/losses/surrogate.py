r"""The clipped PPO surrogate, fused into one autograd node at token level.

Per token, with \(\rho_t = e^{\mathrm{clamp}(\text{logp} - \text{old\_logp}, \pm 20)}\), advantage
\(A\), IS weight \(w_t\) (detached) and clip range \([1-\varepsilon_l, 1+\varepsilon_h]\):

\[
\ell_t = -w_t \cdot \min\big(\rho_t A,\ \mathrm{clip}(\rho_t, 1-\varepsilon_l, 1+\varepsilon_h)\,A\big),
\]

and with dual clip \(c > 1\) (Ye et al. 2020), for \(A < 0\) the objective is further bounded
below: \(\max(\min(\cdot), cA)\). The gradient is closed form,

\[
\frac{\partial \ell_t}{\partial\, \text{logp}_t} = -w_t\, A\, \rho_t \cdot
\mathbb{1}[\text{unclipped branch active}],
\]

so [`clipped_surrogate`][sparsecorr.losses.surrogate.clipped_surrogate] computes it during the
forward pass and keeps only that one ``[B, T]`` float32 tensor for backward, instead of the
half-dozen intermediates plain autograd would save (the loss is memory-bound on CPU and GPU).
Both clips and the dual clip collapse into one clamp with per-entry bounds
(:func:`ratio_bounds`): \(\min(\rho A, \mathrm{clip}(\rho)A) = A\,\mathrm{clamp}(\rho, \ell,
h)\), and the unclipped branch is active exactly where the clamp leaves \(\rho\) unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..mismatch import LOG_RATIO_CLAMP

__all__ = ["Surrogate", "clipped_surrogate", "ratio_bounds"]


_EDGE = 1e-6  # keeps ratios pinned at e^{±20} on the clipped side (no gradient, as in autograd)


def ratio_bounds(
    advantages: torch.Tensor, *, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Per-entry clamp bounds \([\ell, h]\) with \(\min(\rho A, \mathrm{clip}(\rho) A) =
    A\cdot\mathrm{clamp}(\rho, \ell, h)\).

    For \(A \ge 0\): \([0, 1+\varepsilon_h]\); for \(A < 0\): \([1-\varepsilon_l, c]\) with
    \(c\) the dual clip (the dual bound \(\max(\cdot, cA) = A \min(\cdot, c)\) for
    \(A<0\)), else \(e^{20}\). The bounds are nudged inside \(e^{\pm 20}\) so a ratio pinned
    by the ±20 log clamp counts as clipped (zero gradient, like autograd through ``clamp``).

    Shapes:
        advantages: ``[B, 1]`` or ``[B, T]`` -> two tensors of the same shape.
    """
    pos = advantages >= 0
    tiny = math.exp(-LOG_RATIO_CLAMP) * (1 + _EDGE)
    huge = math.exp(LOG_RATIO_CLAMP) * (1 - _EDGE) if dual_clip is None else float(dual_clip)
    lo = torch.where(pos, tiny, 1.0 - clip_low)
    hi = torch.where(pos, 1.0 + clip_high, huge)
    return lo, hi


@dataclass(frozen=True)
class Surrogate:
    r"""What :func:`clipped_surrogate` returns.

    Attributes:
        token_loss: ``[B, T]`` float32, 0 where not kept; carries the gradient to ``logp``.
        loss: ``[]`` \(\sum_i r_i \sum_t \ell_{i,t}\) for the given row scales; carries the
            gradient (cheaper to backpropagate than ``token_loss``).
        ratio: ``[B, T]`` detached PPO ratio, 1 where not kept.
        unclipped: ``[B, T]`` bool, True where the unclipped branch is active (the gradient
            flows); True where not kept.
        log_ratio_sum: ``[]`` sum of ``logp - old_logp`` over kept tokens.
        ratio_sum: ``[]`` sum of ``ratio`` over all entries (kept ones plus 1 per other entry).
    """

    token_loss: torch.Tensor
    loss: torch.Tensor
    ratio: torch.Tensor
    unclipped: torch.Tensor
    log_ratio_sum: torch.Tensor
    ratio_sum: torch.Tensor


class _Surrogate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, kept, neg_wa, lo, hi, scales):
        with torch.no_grad():
            raw = torch.where(kept, logp.float() - old_logp, 0.0)
            log_ratio_sum = raw.sum()
            ratio = raw.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp_()
            ratio_sum = ratio.sum()
            clipped_ratio = torch.clamp(ratio, lo, hi)
            active = clipped_ratio == ratio
            token_loss = clipped_ratio.mul_(neg_wa)
            loss = (token_loss.sum(dim=1) * scales).sum()
            grad = torch.where(active, token_loss, 0.0)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad, scales)
        ctx.logp_dtype = logp.dtype
        ctx.mark_non_differentiable(ratio, active, log_ratio_sum, ratio_sum)
        return token_loss, loss, ratio, active, log_ratio_sum, ratio_sum

    @staticmethod
    def backward(ctx, g_token_loss, g_loss, *_):
        grad, scales = ctx.saved_tensors
        coef = None
        if g_loss is not None:
            coef = scales[:, None] * g_loss
        if g_token_loss is not None:
            coef = g_token_loss if coef is None else coef + g_token_loss
        if coef is None:
            return (None,) * 7
        return (coef * grad).to(ctx.logp_dtype), None, None, None, None, None, None


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    kept: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor | None,
    scales: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> Surrogate:
    r"""Token-level weighted clipped surrogate and its aggregate, one fused autograd node.

    Masked positions may hold anything (NaN included): they give 0 and no gradient.

    Args:
        logp: learner log-probs (any float dtype; the gradient comes back in it).
        old_logp: float32 dense log-probs.
        kept: bool, the tokens in the loss.
        advantages: float32, finite where kept.
        weights: float32 IS weights, 0 where not kept; None = 1 on kept tokens.
        scales: ``[B]`` row scales of the aggregation
            ([`row_scales`][sparsecorr.losses.aggregation.row_scales]).
        clip_low: \(\varepsilon_l\), as in [`sparse_grpo`][sparsecorr.losses.sparse_grpo].
        clip_high: \(\varepsilon_h\).
        dual_clip: \(c > 1\) or None.

    Shapes:
        logp, old_logp, kept, weights: ``[B, T]``; advantages ``[B, T]`` or ``[B, 1]``;
        scales ``[B]``.
    """
    lo, hi = ratio_bounds(advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    neg_adv = advantages.neg()
    neg_wa = torch.where(kept, neg_adv, 0.0) if weights is None else weights * neg_adv
    return Surrogate(*_Surrogate.apply(logp, old_logp, kept, neg_wa, lo, hi, scales))
