r"""Surrogate objectives: one object per method, all with the same call.

A surrogate turns the learner's log-probs, the advantages and the correction's detached
weights \(w_t\) into a per-token loss \(\ell_t\) and its aggregate \(\sum_i r_i \sum_t \ell_{i,t}\)
(\(r_i\): the aggregation's row scales). With \(\rho_t = e^{\text{logp}_t - \text{old\_logp}_t}\):

| object | per-token loss | source |
|---|---|---|
| [`PPOClip`][sparsecorr.losses.PPOClip] | \(-w_t \min(\rho_t A, \mathrm{clip}(\rho_t, 1-\varepsilon_l, 1+\varepsilon_h) A)\), dual clip \(c\) for \(A<0\) | Schulman 2017; DAPO; Ye 2020 |
| [`GSPO`][sparsecorr.losses.GSPO] | the same with the sequence ratio \(s_i = e^{\frac{1}{n_i}\sum_t (\text{logp}-\text{old\_logp})}\) | Zheng et al. 2025 |
| [`CISPO`][sparsecorr.losses.CISPO] | \(-w_t\, \mathrm{sg}[\min(\rho_t, c)]\, A\, \text{logp}_t\) | MiniMax-M1 2025 |
| [`SAPO`][sparsecorr.losses.SAPO] | \(-w_t\, \tfrac{4}{\tau}\sigma(\tau(\rho_t - 1))\, A\), \(\tau = \tau_+\) if \(A>0\) else \(\tau_-\) | SAPO (Qwen, 2025) |

``SURROGATES`` maps names to the classes (``sparse_grpo(surrogate="gspo")`` uses the defaults).
``PPOClip`` runs as one fused autograd node (its gradient is closed form, see
``sparsecorr.losses.ppo``); the others use plain autograd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import check_number, count
from ..mismatch import LOG_RATIO_CLAMP
from .aggregation import scaled_sum
from .ppo import SurrogateInputs, SurrogateOutput, ppo_clip_forward

__all__ = ["CISPO", "GSPO", "SAPO", "SURROGATES", "PPOClip", "SurrogateInputs", "SurrogateOutput"]


def _check_eps(name: str, x: object, *, below_one: bool = False) -> None:
    check_number(name, x, low=0, high=1 if below_one else None, high_open=True)


def _check_dual(d: object) -> None:
    check_number("dual_clip", d, low=1, low_open=True, allow_none=True)


@dataclass(frozen=True)
class _Clip:
    """The clip range shared by ``PPOClip`` and ``GSPO``, checked once."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        _check_eps("clip_low", self.clip_low, below_one=True)
        _check_eps("clip_high", self.clip_high)
        _check_dual(self.dual_clip)


@dataclass(frozen=True)
class PPOClip(_Clip):
    r"""Clipped PPO surrogate (GRPO, DAPO, Sparse-RL, TRL's ``grpo``/``dapo``/``bnpo``/``dr_grpo``).

    Args:
        clip_low: \(\varepsilon_l\) (0.2 PPO and DAPO).
        clip_high: \(\varepsilon_h\) (0.2 PPO; 0.28 DAPO and Sparrow).
        dual_clip: \(c > 1\): for \(A<0\) the objective is also bounded by \(cA\) (Ye et al.
            2020). TRL's two-sided clip ``delta`` is the same bound (``min(\rho,\delta)``
            on the unclipped branch), tested against TRL.
    """

    def __call__(self, x: SurrogateInputs) -> SurrogateOutput:
        return ppo_clip_forward(x, clip_low=self.clip_low, clip_high=self.clip_high,
                                dual_clip=self.dual_clip)


@dataclass(frozen=True)
class GSPO(_Clip):
    r"""GSPO (Zheng et al. 2025): one length-normalised ratio per sequence, tight clip
    (\(\varepsilon_l = 3\times10^{-4}\), \(\varepsilon_h = 4\times10^{-4}\))."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def __call__(self, x: SurrogateInputs) -> SurrogateOutput:
        kept, adv = x.kept, x.advantages
        raw = torch.where(kept, x.logp.float() - x.old_logp, 0.0)
        n_i = count(kept, dim=1, keepdim=True).clamp(min=1)
        ratio = (raw.sum(dim=1, keepdim=True) / n_i).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        pos = adv >= 0
        lo = torch.where(pos, 0.0, 1.0 - self.clip_low)
        big = math.exp(LOG_RATIO_CLAMP) if self.dual_clip is None else self.dual_clip
        hi = torch.where(pos, 1.0 + self.clip_high, big)
        clipped = torch.clamp(ratio, lo, hi)
        token_loss = torch.where(kept, x.neg_weighted_adv * clipped, 0.0)
        loss = scaled_sum(token_loss, x.scales)
        r, unclipped = ratio.detach(), (clipped.detach() == ratio.detach())
        return SurrogateOutput(token_loss, loss, sums=_ratio_sums(x, r.expand_as(kept), unclipped.expand_as(kept)),
                               kl_ratio=ratio)


@dataclass(frozen=True)
class CISPO:
    r"""CISPO (MiniMax-M1, 2025; TRL ``loss_type="cispo"``): REINFORCE on \(\text{logp}\) with the
    importance ratio truncated at ``cap`` and detached, so every token keeps a gradient."""

    cap: float = 5.0

    def __post_init__(self) -> None:
        check_number("cap", self.cap, low=0, low_open=True)

    def __call__(self, x: SurrogateInputs) -> SurrogateOutput:
        r = x.log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        coef = torch.clamp(r, max=self.cap) * x.neg_weighted_adv  # detached
        token_loss = torch.where(x.kept, coef * x.logp.float(), 0.0)
        loss = scaled_sum(token_loss, x.scales)
        return SurrogateOutput(token_loss, loss, sums=_ratio_sums(x, r, (r <= self.cap) | ~x.kept))


@dataclass(frozen=True)
class SAPO:
    r"""SAPO's soft gate (TRL ``loss_type="sapo"``): \(\frac{4}{\tau}\sigma(\tau(\rho - 1))\)
    replaces the hard clip, with \(\tau_+\) for positive and \(\tau_-\) for negative advantages
    (TRL defaults 1.0 and 1.05)."""

    temperature_pos: float = 1.0
    temperature_neg: float = 1.05

    def __post_init__(self) -> None:
        for name in ("temperature_pos", "temperature_neg"):
            check_number(name, getattr(self, name), low=0, low_open=True)

    def __call__(self, x: SurrogateInputs) -> SurrogateOutput:
        lr = torch.where(x.kept, x.logp.float() - x.old_logp, 0.0)
        rho = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        tau = torch.where(x.advantages > 0, self.temperature_pos, self.temperature_neg)
        gate = torch.sigmoid(tau * (rho - 1.0)) * (4.0 / tau)
        token_loss = torch.where(x.kept, x.neg_weighted_adv * gate, 0.0)
        loss = scaled_sum(token_loss, x.scales)
        r = rho.detach()
        return SurrogateOutput(token_loss, loss, sums=_ratio_sums(x, r, None))


def _ratio_sums(x: SurrogateInputs, ratio: torch.Tensor, unclipped: torch.Tensor | None):
    """Kept-token sums for ``loss/ratio_mean``, ``loss/clip_frac`` and ``loss/ppo_kl_k1_mean``."""
    def sums() -> dict[str, torch.Tensor]:
        out = {"loss/ratio_mean": torch.where(x.kept, ratio, 0.0).sum(),
               "loss/ppo_kl_k1_mean": -x.log_ratio.sum()}
        if unclipped is not None:
            out["loss/clip_frac"] = count(x.kept & ~unclipped)
        return out
    return sums


#: surrogate name -> class (``sparse_grpo(surrogate=NAME)`` builds it with its defaults)
SURROGATES = {"ppo": PPOClip, "gspo": GSPO, "cispo": CISPO, "sapo": SAPO}
