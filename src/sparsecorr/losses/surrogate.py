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

import torch

from ..mismatch import LOG_RATIO_CLAMP

__all__ = ["clipped_surrogate", "ratio_bounds"]


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


class _Surrogate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, kept, neg_wa, lo, hi):
        with torch.no_grad():
            raw = torch.where(kept, logp.float() - old_logp, 0.0)
            log_ratio_sum = raw.sum()
            ratio = raw.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp_()
            clipped_ratio = torch.clamp(ratio, lo, hi)
            active = clipped_ratio == ratio
            token_loss = clipped_ratio.mul_(neg_wa)
            grad = torch.where(active, token_loss, 0.0)
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        ctx.mark_non_differentiable(ratio, active, log_ratio_sum)
        return token_loss, ratio, active, log_ratio_sum

    @staticmethod
    def backward(ctx, grad_token_loss, _g_ratio, _g_active, _g_sum):
        (grad,) = ctx.saved_tensors
        return (grad_token_loss * grad).to(ctx.logp_dtype), None, None, None, None, None


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    kept: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-level weighted clipped surrogate, one fused autograd node.

    Masked positions may hold anything (NaN included): they give 0 and no gradient.
    ``advantages`` (finite where kept) and ``weights`` (0 where not kept) are float32.

    Returns:
        ``(token_loss, ratio, unclipped, log_ratio_sum)``: float32 token loss (0 where not
        kept) carrying the gradient to ``logp``; the detached PPO ratio (1 where not kept);
        bool, True where the unclipped branch is active (the gradient flows); the sum of
        ``logp - old_logp`` over kept tokens.

    Shapes:
        logp, old_logp, kept, weights: ``[B, T]``; advantages ``[B, T]`` or ``[B, 1]``.
    """
    lo, hi = ratio_bounds(advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    neg_wa = weights * advantages.neg()
    return _Surrogate.apply(logp, old_logp, kept, neg_wa, lo, hi)
