r"""The clipped PPO surrogate as one fused autograd node, and the surrogate call's records.

Per token, with \(\rho_t = e^{\mathrm{clamp}(\text{logp} - \text{old\_logp}, \pm 20)}\),
advantage \(A\), detached IS weight \(w_t\) and clip range \([1-\varepsilon_l, 1+\varepsilon_h]\):

\[
\ell_t = -w_t \cdot \min\big(\rho_t A,\ \mathrm{clip}(\rho_t, 1-\varepsilon_l, 1+\varepsilon_h)\,A\big),
\]

and with dual clip \(c > 1\) (Ye et al. 2020), for \(A < 0\), \(\max(\min(\cdot), cA)\). Both
clips and the dual clip collapse into one clamp with per-entry bounds:
\(\min(\rho A, \mathrm{clip}(\rho)A) = A\,\mathrm{clamp}(\rho, \ell, h)\) with \([\ell, h] =
[0, 1+\varepsilon_h]\) for \(A \ge 0\) and \([1-\varepsilon_l, c]\) for \(A<0\). The gradient is
closed form,

\[
\frac{\partial \ell_t}{\partial\, \text{logp}_t} = -w_t\, A\, \rho_t \cdot
\mathbb{1}[\text{the clamp leaves } \rho_t \text{ unchanged}] = \ell_t \cdot \mathbb{1}[\cdot],
\]

so the forward pass keeps one ``[B, T]`` tensor for backward instead of the half-dozen
intermediates plain autograd would save. The ratio is handled as \(\rho_t - 1 =
\mathrm{expm1}(\cdot)\), which is exactly 0 on tokens outside the loss: the mean ratio over a few
kept tokens in a large batch is then exact (no cancellation against the padding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._checks import count
from ..mismatch import LOG_RATIO_CLAMP

__all__ = ["SurrogateInputs", "SurrogateOutput", "ppo_clip_forward"]

_HUGE_M1 = math.exp(LOG_RATIO_CLAMP) * (1 - 1e-6) - 1.0  # a pinned e^{+20} ratio counts as clipped


@dataclass(frozen=True)
class SurrogateInputs:
    r"""What ``sparse_grpo`` hands a surrogate (all finite where ``kept``).

    Attributes:
        logp: learner log-probs (carry the gradient; any float dtype).
        old_logp: float32 detached dense log-probs.
        log_ratio: float32 detached \(\text{logp} - \text{old\_logp}\), 0 where not kept.
        kept: bool, the tokens in the loss.
        advantages: float32 ``[B, 1]`` or ``[B, T]``.
        neg_weighted_adv: float32 ``[B, T]`` \(-w_t A\), 0 where not kept.
        scales: ``[B]`` row scales of the aggregation.
        n: 0-d number of kept tokens.
        full_metrics: also report the expensive metrics (ratio extremes).
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    log_ratio: torch.Tensor
    kept: torch.Tensor
    advantages: torch.Tensor
    neg_weighted_adv: torch.Tensor
    scales: torch.Tensor
    n: torch.Tensor
    full_metrics: bool = False


@dataclass(frozen=True)
class SurrogateOutput:
    """``token_loss`` ``[B, T]`` and ``loss`` ``[]`` (both carry the gradient) and lazy metrics
    (``name -> tensor or function``, resolved by ``sparse_grpo`` when it reports metrics)."""

    token_loss: torch.Tensor
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor | Callable[[], torch.Tensor]] = field(default_factory=dict)


class _PPOClip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, log_ratio, neg_wa, lo_m1, hi_m1, scales):
        with torch.no_grad():
            em1 = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expm1_()  # rho - 1, 0 off-loss
            clipped = torch.clamp(em1, lo_m1, hi_m1)
            active = clipped == em1
            token_loss = torch.addcmul(neg_wa, clipped, neg_wa)  # (1 + clipped) * (-w A)
            loss = (token_loss.sum(dim=1) * scales).sum()
            grad = torch.where(active, token_loss, 0.0)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad, scales)
        ctx.logp_dtype = logp.dtype
        ctx.mark_non_differentiable(em1, active)
        return token_loss, loss, em1, active

    @staticmethod
    def backward(ctx, g_token_loss, g_loss, *_):
        grad, scales = ctx.saved_tensors
        coef = None
        if g_loss is not None:
            coef = scales[:, None] * g_loss
        if g_token_loss is not None:
            coef = g_token_loss if coef is None else coef + g_token_loss
        if coef is None:
            return (None,) * 6
        return (coef * grad).to(ctx.logp_dtype), None, None, None, None, None


def ppo_clip_forward(x: SurrogateInputs, *, clip_low: float, clip_high: float,
                     dual_clip: float | None) -> SurrogateOutput:
    """Token-level weighted clipped surrogate, its aggregate and lazy metrics (``PPOClip``)."""
    pos = x.advantages >= 0
    lo = torch.where(pos, -1.0, -clip_low)
    hi = torch.where(pos, clip_high, _HUGE_M1 if dual_clip is None else dual_clip - 1.0)
    token_loss, loss, em1, active = _PPOClip.apply(x.logp, x.log_ratio, x.neg_weighted_adv, lo, hi,
                                                    x.scales)
    return SurrogateOutput(token_loss, loss, _ppo_metrics(x, em1, active, dual_clip))


def _ppo_metrics(x: SurrogateInputs, em1: torch.Tensor, active: torch.Tensor, dual_clip) -> dict:
    n1 = x.n.clamp(min=1.0)
    adv = x.advantages
    state: dict[str, torch.Tensor] = {}

    def clipped() -> tuple[torch.Tensor, torch.Tensor]:
        # off-loss entries are active (rho - 1 = 0 lies inside every clamp)
        if "all" not in state:
            rows = active.shape[1] - count(active, dim=1)
            state["all"] = rows.sum()
            state["neg"] = ((rows * (adv[:, 0] < 0)).sum() if adv.shape[1] == 1
                            else count(~active & (adv < 0)))
        return state["all"], state["neg"]

    def dual() -> torch.Tensor:
        return count(~active & (adv < 0) & (em1 > 0))

    out = {
        "loss/clip_frac_high": lambda: (clipped()[0] - clipped()[1]) / n1,
        "loss/clip_frac_low": (lambda: clipped()[1] / n1) if dual_clip is None
        else (lambda: (clipped()[1] - dual()) / n1),
        "loss/ratio_mean": lambda: 1.0 + em1.sum() / n1,
        "loss/ppo_kl_k1_mean": lambda: -x.log_ratio.sum() / n1,
    }
    if dual_clip is not None:
        out["loss/clip_frac_dual"] = lambda: dual() / n1
    if x.full_metrics:
        out.update(ratio_extremes(em1, x.kept, x.n))
    return out


def ratio_extremes(em1: torch.Tensor, kept: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """``loss/ratio_min`` / ``loss/ratio_max`` over kept tokens (NaN when none), from
    \\(\\rho - 1\\) (0 off the loss)."""
    mean = em1.sum() / n.clamp(min=1)
    lo, hi = torch.aminmax(torch.where(kept, em1, mean)) if em1.numel() else (mean, mean)
    nan = torch.full((), float("nan"), device=em1.device)
    return {"loss/ratio_min": torch.where(n > 0, 1.0 + lo, nan),
            "loss/ratio_max": torch.where(n > 0, 1.0 + hi, nan)}
