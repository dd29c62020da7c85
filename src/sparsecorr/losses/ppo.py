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
intermediates plain autograd would save. The ratio is handled as \(\rho_t - 1\) (``_fastexp.exp_``
then ``- 1``, 3x cheaper than ``expm1`` on the CPU; off by a few float32 ulp of 1, which neither
the clip nor the mean ratio can see), exactly 0 on tokens outside the loss: the mean
ratio over a few kept tokens in a large batch has no cancellation against the padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from .._fastexp import exp_
from ..mismatch import LOG_RATIO_CLAMP
from .aggregation import scaled_sum

__all__ = ["SurrogateInputs", "SurrogateOutput", "ppo_clip_forward"]

_HUGE_M1 = math.exp(LOG_RATIO_CLAMP) * (1 - 1e-5) - 1.0  # a pinned e^{+20} ratio counts as clipped
# (1e-5: far above the few ulp of ``exp_``, far below the next ratio a clamp at 20 could give)


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
        scales: ``[B]`` (or ``[1]``, one for every row) row scales of the aggregation.
        n: 0-d number of kept tokens.
        metrics: whether the caller will read the metrics (``PPOClip`` counts its clipped tokens
            during the forward pass only then).
        full_metrics: whether it will read the full set (``PPOClip`` then keeps \(\rho - 1\)
            for the ratio extremes instead of reusing its buffer).
        log_ratio_sum: 0-d sum of ``log_ratio`` when the caller already has it (else None).
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
    full_metrics: bool = False
    log_ratio_sum: torch.Tensor | None = None


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
    def forward(ctx, logp, log_ratio, neg_wa, lo_m1, hi_m1, scales, level, neg_rows, lr_sum):
        with torch.no_grad():
            sums = {}
            if level:
                sums["lr"] = log_ratio.sum() if lr_sum is None else lr_sum
            # in place on the caller's scratch copy: rho - 1, exactly 0 off the loss
            em1 = exp_(log_ratio.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).sub_(1.0)
            if level:
                sums["em1"] = em1.sum()
            # clamp(em1, lo, hi) with per-row bounds, as max then min: the broadcasting
            # tensor-bound clamp is 4x slower on the CPU
            clipped = torch.maximum(em1, lo_m1)
            torch.minimum(clipped, hi_m1, out=clipped)
            # the clamp's move, in the scratch buffer (kept apart only for the full metrics,
            # which read rho): its sign is -1 below the range, +1 above, 0 where rho is unclipped
            side = torch.sub(em1, clipped, out=None if level == 2 else em1).sign_()
            if level:
                sums["side"] = side.sum()  # clipped above - clipped below
                if neg_rows is not None:  # dual-clipped: above the range on an A < 0 token
                    sums["dual"] = torch.mul(side.clamp(min=0.0), neg_rows).sum()
            moved = side.abs_()  # 1 where the clamp moved rho (no gradient), else 0
            if level:
                sums["moved"] = moved.sum()
            token_loss = torch.addcmul(neg_wa, clipped, neg_wa, out=clipped)  # (1 + clipped)(-w A)
            loss = scaled_sum(token_loss, scales)
            # token_loss where unclipped, (1 - moved) * token_loss, in the scratch buffer again
            grad = torch.addcmul(token_loss, moved, token_loss, value=-1.0, out=moved)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad, scales)
        ctx.logp_dtype = logp.dtype
        ratio = em1 if level == 2 else None
        if ratio is not None:
            ctx.mark_non_differentiable(ratio)
        return token_loss, loss, ratio, sums

    @staticmethod
    def backward(ctx, g_token_loss, g_loss, *_):
        grad, scales = ctx.saved_tensors
        coef = None
        if g_loss is not None:
            coef = scales.reshape(-1, 1) * g_loss
        if g_token_loss is not None:
            coef = g_token_loss if coef is None else coef + g_token_loss
        if coef is None:
            return (None,) * 9
        return (coef * grad).to(ctx.logp_dtype), *(None,) * 8


@lru_cache(maxsize=64)
def _tables(clip_low: float, clip_high: float, big: float, device: torch.device):
    """``[2, 1]`` columns ``lo - 1``, ``hi - 1`` for A >= 0 and for A < 0."""
    pos = torch.tensor([[-1.0], [clip_high]], device=device)
    neg = torch.tensor([[-clip_low], [big]], device=device)
    return pos, neg


def ppo_clip_forward(x: SurrogateInputs, *, clip_low: float, clip_high: float,
                     dual_clip: float | None) -> SurrogateOutput:
    """Token-level weighted clipped surrogate, its aggregate and lazy metrics (``PPOClip``)."""
    adv = x.advantages
    big = _HUGE_M1 if dual_clip is None else dual_clip - 1.0
    t_pos, t_neg = _tables(clip_low, clip_high, big, adv.device)
    if adv.shape[1] == 1:  # per row: one [2, B] table gives both bounds
        lo, hi = torch.where(adv.reshape(1, -1) >= 0, t_pos, t_neg).unbind(0)
        lo, hi = lo.reshape(-1, 1), hi.reshape(-1, 1)
    else:
        pos = adv >= 0
        lo, hi = torch.where(pos, t_pos[0], t_neg[0]), torch.where(pos, t_pos[1], t_neg[1])
    level = 0 if not x.metrics else (2 if x.full_metrics else 1)
    neg_rows = (adv < 0).float() if level and dual_clip is not None else None
    token_loss, loss, em1, sums = _PPOClip.apply(
        x.logp, x.log_ratio, x.neg_weighted_adv, lo, hi, x.scales, level, neg_rows, x.log_ratio_sum)
    return SurrogateOutput(token_loss, loss, sums=lambda: _ppo_sums(sums, dual_clip),
                           extra=lambda: ratio_extremes(em1, x.kept, x.n) if em1 is not None else {})


def _ppo_sums(s: dict, dual_clip) -> dict:
    r"""Kept-token sums of the PPO metrics: clipped tokens by side, the ratio, ``-log ratio``.
    Below the range = ``(moved - side) / 2``, above = ``(moved + side) / 2`` (above includes the
    dual-clipped tokens and a ratio pinned at \(e^{20}\))."""
    high = ((s["moved"], 0.5), (s["side"], 0.5))
    out = {"loss/clip_frac_high": high, "loss/clip_frac_low": ((s["moved"], 0.5), (s["side"], -0.5)),
           "loss/ratio_mean": (("n", 1.0), (s["em1"], 1.0)),
           "loss/ppo_kl_k1_mean": ((s["lr"], -1.0),)}
    if dual_clip is not None:
        out["loss/clip_frac_high"] = (*high, (s["dual"], -1.0))
        out["loss/clip_frac_dual"] = s["dual"]
    return out


def ratio_extremes(em1: torch.Tensor, kept: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """``loss/ratio_min`` / ``loss/ratio_max`` over kept tokens (NaN when none), from
    \\(\\rho - 1\\) (0 off the loss)."""
    mean = em1.sum() / n.clamp(min=1)
    lo, hi = torch.aminmax(torch.where(kept, em1, mean)) if em1.numel() else (mean, mean)
    nan = torch.full((), float("nan"), device=em1.device)
    return {"loss/ratio_min": torch.where(n > 0, 1.0 + lo, nan),
            "loss/ratio_max": torch.where(n > 0, 1.0 + hi, nan)}
