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
"""

from __future__ import annotations

import torch

from ..mismatch import LOG_RATIO_CLAMP

__all__ = ["clipped_objective", "clipped_surrogate"]


def clipped_objective(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> torch.Tensor:
    r"""\(\min(\rho A, \mathrm{clip}(\rho) A)\), dual-clipped for \(A<0\) (plain autograd).

    Shapes:
        ratio, advantages: broadcastable ``[B, T]`` / ``[B, 1]`` -> ``[B, T]``.
    """
    obj = torch.minimum(ratio * advantages, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages)
    if dual_clip is not None:
        obj = torch.where(advantages < 0, torch.maximum(obj, dual_clip * advantages), obj)
    return obj


class _Surrogate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, advantages, weights, clip_low, clip_high, dual_clip):
        with torch.no_grad():
            raw = logp.float() - old_logp
            ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            s1 = ratio * advantages
            s2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
            active = (s1 <= s2) & (raw.abs() <= LOG_RATIO_CLAMP)
            obj = torch.minimum(s1, s2)
            if dual_clip is not None:
                floor = dual_clip * advantages
                dual = (advantages < 0) & (floor > obj)
                obj = torch.where(dual, floor, obj)
                active &= ~dual
            token_loss = -(weights * obj)
            grad = torch.where(active, -(weights * s1), 0.0)
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        ctx.mark_non_differentiable(ratio)
        return token_loss, ratio

    @staticmethod
    def backward(ctx, grad_token_loss, _grad_ratio):
        (grad,) = ctx.saved_tensors
        return (grad_token_loss * grad).to(ctx.logp_dtype), None, None, None, None, None, None


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level weighted clipped surrogate and the PPO ratio, one fused autograd node.

    ``old_logp``, ``advantages`` and ``weights`` must be float32 and finite wherever it matters
    (callers sanitise masked positions to 0); the gradient flows to ``logp`` only.

    Returns:
        ``(token_loss, ratio)``: float32; ``ratio`` is detached.

    Shapes:
        logp, old_logp, weights: ``[B, T]``; advantages ``[B, T]`` or ``[B, 1]``.
    """
    return _Surrogate.apply(logp, old_logp, advantages, weights, clip_low, clip_high, dual_clip)
