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
from dataclasses import dataclass
from functools import lru_cache

import torch

from .._masks import as_float
from ..mismatch import LOG_RATIO_CLAMP

__all__ = ["SurrogateInputs", "SurrogateOutput", "ppo_clip_forward"]

_HUGE_M1 = math.exp(LOG_RATIO_CLAMP) * (1 - 1e-6) - 1.0  # a pinned e^{+20} ratio counts as clipped


@dataclass(frozen=True)
class SurrogateInputs:
    r"""What ``sparse_grpo`` hands a surrogate (all finite where ``kept``).

    Attributes:
        logp: learner log-probs (carry the gradient; any float dtype).
        old_logp: float32 detached dense log-probs.
        log_ratio: float32 detached \(\text{logp} - \text{old\_logp}\), 0 where not kept; a
            scratch copy the surrogate may overwrite (``PPOClip`` does, to save a buffer).
        kept: bool, the tokens in the loss.
        advantages: float32 ``[B, 1]`` or ``[B, T]``.
        neg_weighted_adv: float32 ``[B, T]`` \(-w_t A\), 0 where not kept.
        scales: ``[B]`` row scales of the aggregation.
        n: 0-d number of kept tokens.
        metrics: whether the caller will read the metrics (``PPOClip`` counts its clipped tokens
            during the forward pass only then).
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    log_ratio: torch.Tensor
    kept: torch.Tensor
    advantages: torch.Tensor
    neg_weighted_adv: torch.Tensor
    scales: torch.Tensor
    n: torch.Tensor
    metrics: bool = True


@dataclass(frozen=True)
class SurrogateOutput:
    """``token_loss`` ``[B, T]`` and ``loss`` ``[]`` (both carry the gradient), and the metrics,
    computed only when ``sparse_grpo`` reports them:

    - ``sums()``: ``name -> numerator``, the metric being the numerator divided by the
      kept-token count (all divided at once); a numerator is a 0-d sum over the kept tokens,
      or a tuple of ``(sum, coefficient)`` pairs (a linear combination; the key ``"n"`` stands
      for the kept-token count itself);
    - ``extra()``: ``name -> 0-d value`` for anything else (``metrics="full"``).

    ``kl_ratio``: the importance ratio, with its gradient, that ``KLPenalty(bias_correction=True)``
    multiplies the k3 term by when the surrogate's ratio is not per token (GSPO: the sequence
    ratio, ``[B, 1]``); ``None`` for the token ratio.
    """

    token_loss: torch.Tensor
    loss: torch.Tensor
    sums: Callable[[], dict[str, torch.Tensor]] = dict
    extra: Callable[[], dict[str, torch.Tensor]] = dict
    kl_ratio: torch.Tensor | None = None


class _PPOClip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, log_ratio, neg_wa, lo_m1, hi_m1, scales, neg_rows, dual):
        with torch.no_grad():
            lr_sum = log_ratio.sum()
            # in place on the caller's scratch copy: rho - 1, exactly 0 off the loss
            em1 = log_ratio.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expm1_()
            # clamp(em1, lo, hi) with per-row bounds, as max then min: the broadcasting
            # tensor-bound clamp is 4x slower on the CPU
            clipped = torch.maximum(em1, lo_m1)
            torch.minimum(clipped, hi_m1, out=clipped)
            # 1 where the clamp moved rho (no gradient), 0 where it did not: float arithmetic,
            # not a bool comparison (those take torch's slow CPU path)
            moved = torch.sub(em1, clipped).sign_().abs_()
            stats = _clip_counts(moved, em1, neg_rows, dual) if neg_rows is not None else lr_sum
            token_loss = clipped.add_(1.0).mul_(neg_wa)  # (1 + clipped) * (-w A), in place
            loss = (token_loss.sum(dim=1) * scales).sum()
            grad = moved.neg_().add_(1.0).mul_(token_loss)  # token_loss where unclipped, in place
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad, scales)
        ctx.logp_dtype = logp.dtype
        ctx.mark_non_differentiable(em1, lr_sum, stats)
        return token_loss, loss, em1, lr_sum, stats

    @staticmethod
    def backward(ctx, g_token_loss, g_loss, *_):
        grad, scales = ctx.saved_tensors
        coef = None
        if g_loss is not None:
            coef = scales[:, None] * g_loss
        if g_token_loss is not None:
            coef = g_token_loss if coef is None else coef + g_token_loss
        if coef is None:
            return (None,) * 8
        return (coef * grad).to(ctx.logp_dtype), None, None, None, None, None, None, None


def _clip_counts(moved: torch.Tensor, em1: torch.Tensor, neg: torch.Tensor, dual: bool) -> torch.Tensor:
    """``[all, negative-advantage, dual]`` clipped-token counts (``neg``: float 1 where A < 0,
    ``[B, 1]`` or ``[B, T]``)."""
    if neg.shape[1] == 1:
        rows = moved.sum(dim=1)
        c_all, c_neg = rows.sum(), torch.dot(rows, neg.reshape(-1))
    else:
        c_all, c_neg = moved.sum(), torch.dot(moved.reshape(-1), neg.reshape(-1))
    c_dual = (moved * neg * as_float(em1 > 0)).sum() if dual else c_all.new_zeros(())
    return torch.stack([c_all, c_neg, c_dual])


@lru_cache(maxsize=64)
def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A cached 0-d float32 tensor (no tensor creation per call)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def ppo_clip_forward(x: SurrogateInputs, *, clip_low: float, clip_high: float,
                     dual_clip: float | None) -> SurrogateOutput:
    """Token-level weighted clipped surrogate, its aggregate and lazy metrics (``PPOClip``)."""
    pos = x.advantages >= 0
    dev = pos.device
    lo = torch.where(pos, _constant(-1.0, dev), _constant(-clip_low, dev))
    big = _HUGE_M1 if dual_clip is None else dual_clip - 1.0
    hi = torch.where(pos, _constant(clip_high, dev), _constant(big, dev))
    neg = as_float(~pos) if x.metrics else None
    token_loss, loss, em1, lr_sum, stats = _PPOClip.apply(
        x.logp, x.log_ratio, x.neg_weighted_adv, lo, hi, x.scales, neg, dual_clip is not None)
    return SurrogateOutput(token_loss, loss, sums=lambda: _ppo_sums(x.n, em1, lr_sum, stats, dual_clip),
                           extra=lambda: ratio_extremes(em1, x.kept, x.n))


def _ppo_sums(n, em1: torch.Tensor, lr_sum: torch.Tensor, stats: torch.Tensor, dual_clip) -> dict:
    """Kept-token sums of the PPO metrics: clipped tokens by side, the ratio, ``-log ratio``."""
    c_all, c_neg, c_dual = stats.unbind()
    out = {"loss/clip_frac_high": ((c_all, 1.0), (c_neg, -1.0)), "loss/clip_frac_low": c_neg,
           "loss/ratio_mean": (("n", 1.0), (em1.sum(), 1.0)),
           "loss/ppo_kl_k1_mean": ((lr_sum, -1.0),)}
    if dual_clip is not None:
        out["loss/clip_frac_low"] = ((c_neg, 1.0), (c_dual, -1.0))
        out["loss/clip_frac_dual"] = c_dual
    return out


def ratio_extremes(em1: torch.Tensor, kept: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """``loss/ratio_min`` / ``loss/ratio_max`` over kept tokens (NaN when none), from
    \\(\\rho - 1\\) (0 off the loss)."""
    mean = em1.sum() / n.clamp(min=1)
    lo, hi = torch.aminmax(torch.where(kept, em1, mean)) if em1.numel() else (mean, mean)
    nan = torch.full((), float("nan"), device=em1.device)
    return {"loss/ratio_min": torch.where(n > 0, 1.0 + lo, nan),
            "loss/ratio_max": torch.where(n > 0, 1.0 + hi, nan)}
