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
| [`VESPO`][sparsecorr.losses.VESPO] | \(-\mathrm{sg}[\varphi(W_i)]\, A\, \text{logp}_t\), \(\varphi(W) = e^{\lambda} W^k e^{-\lambda W}\), \(W_i = \prod_t \rho_t w_t\) | VESPO 2026 (TRL ``loss_type="vespo"``) |

``SURROGATES`` maps names to the classes (``sparse_grpo(surrogate="gspo")`` uses the defaults).
Every surrogate is plain tensor code under autograd. Adding one is one frozen class with
``__call__(SurrogateInputs) -> SurrogateOutput`` and one row in ``SURROGATES``: the
compile-clean, eager-equality and no-host-sync tests run over the registry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import check_number, compile_safe_hash, count
from .._ratio import clamp_log_ratio, ratio
from .aggregation import scaled_sum
from .linearize import linearized
from .ppo import (
    SurrogateInputs,
    SurrogateOutput,
    learner_log_ratio,
    ppo_clip_forward,
    ratio_sums,
    token_ratio,
    weighted_loss,
)

__all__ = ["CISPO", "GSPO", "SAPO", "SURROGATES", "VESPO", "PPOClip", "SurrogateInputs", "SurrogateOutput"]


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


@compile_safe_hash
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


@compile_safe_hash
@dataclass(frozen=True)
class GSPO(_Clip):
    r"""GSPO (Zheng et al. 2025): one length-normalised ratio per sequence, tight clip
    (\(\varepsilon_l = 3\times10^{-4}\), \(\varepsilon_h = 4\times10^{-4}\))."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def __call__(self, x: SurrogateInputs) -> SurrogateOutput:
        kept, adv = x.kept, x.advantages
        n_i = count(kept, dim=1, keepdim=True).clamp(min=1)  # [B, 1]
        pos = adv >= 0
        lo = torch.where(pos, 0.0, 1.0 - self.clip_low)
        big = math.exp(20.0) if self.dual_clip is None else self.dual_clip
        hi = torch.where(pos, 1.0 + self.clip_high, big)

        def seq_ratio(z: torch.Tensor) -> torch.Tensor:  # [B, 1]
            return ratio(learner_log_ratio(x, z).sum(dim=1, keepdim=True) / n_i)

        def token_loss(z: torch.Tensor):
            rho = seq_ratio(z)  # [B, 1]
            clipped = torch.clamp(rho, lo, hi)  # [B, 1] or [B, T]
            return torch.where(kept, x.neg_weighted_adv * clipped, 0.0), (rho, clipped)  # [B, T]

        tl, (r, clipped) = linearized(token_loss, x.logp)
        token_loss_, loss = weighted_loss(x, tl)

        def sums() -> dict[str, torch.Tensor]:
            moved = (clipped != r).expand_as(kept)
            return {**ratio_sums(x, r.expand_as(kept)), "loss/clip_frac": x.count(kept & moved)}

        return SurrogateOutput(token_loss_, loss, ratio=r, kl_ratio=seq_ratio, sums=sums)


@compile_safe_hash
@dataclass(frozen=True)
class CISPO:
    r"""CISPO (MiniMax-M1, 2025; TRL ``loss_type="cispo"``): REINFORCE on \(\text{logp}\) with the
    importance ratio truncated at ``cap`` and detached, so every token keeps a gradient."""

    cap: float = 5.0

    def __post_init__(self) -> None:
        check_number("cap", self.cap, low=0, low_open=True)

    def __call__(self, x: SurrogateInputs) -> SurrogateOutput:
        r = ratio(x.log_ratio)  # [B, T], detached
        coef = torch.clamp(r, max=self.cap) * x.neg_weighted_adv  # [B, T], detached
        tl, _ = linearized(lambda z: (torch.where(x.kept, coef * z, 0.0), ()), x.logp)
        token_loss, loss = weighted_loss(x, tl)

        def sums() -> dict[str, torch.Tensor]:
            return {**ratio_sums(x, r), "loss/clip_frac": x.count(x.kept & (r > self.cap))}

        return SurrogateOutput(token_loss, loss, ratio=r, kl_ratio=token_ratio(x), sums=sums)


@compile_safe_hash
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
        tau = torch.where(x.advantages > 0, self.temperature_pos, self.temperature_neg)
        rho_of = token_ratio(x)

        def token_loss(z: torch.Tensor):
            rho = rho_of(z)  # [B, T]
            gate = torch.sigmoid(tau * (rho - 1.0)) * (4.0 / tau)
            return torch.where(x.kept, x.neg_weighted_adv * gate, 0.0), rho

        tl, r = linearized(token_loss, x.logp)
        token_loss_, loss = weighted_loss(x, tl)
        return SurrogateOutput(token_loss_, loss, ratio=r, kl_ratio=rho_of, sums=lambda: ratio_sums(x, r))


_LOG_1E8 = math.log(1e-8)


@compile_safe_hash
@dataclass(frozen=True)
class VESPO:
    r"""VESPO (TRL 1.16 ``loss_type="vespo"``, arXiv 2602.10693): REINFORCE on
    \(\text{logp}\) scaled by a detached gamma weight of the sequence's importance ratio,

    \[
    \ell_t = -\mathrm{sg}[\varphi(W_i)]\, A\, \text{logp}_t, \qquad
    \varphi(W) = e^{\lambda}\, W^{k}\, e^{-\lambda W}\ (\varphi(1) = 1),
    \]

    \(\log W_i = \mathrm{clamp}\big(\sum_t \mathrm{clamp}(\text{logp}-\text{old\_logp}, \pm 20)
    + \sum_t \mathrm{clamp}(\log w_t, \log 10^{-8}, 20), \log 10^{-8}, 20\big)\), with
    \((k, \lambda) = (k_+, \lambda_+)\) for \(A \ge 0\), else \((k_-, \lambda_-)\). The
    correction's IS weights \(w_t\) (``SurrogateInputs.is_ratio``) enter \(W_i\) instead of
    multiplying the token loss, as in TRL.
    """

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            check_number(name, getattr(self, name), low=0)

    def __call__(self, x: SurrogateInputs) -> SurrogateOutput:
        kept, adv = x.kept, x.advantages
        log_w = clamp_log_ratio(x.log_ratio).sum(dim=-1, keepdim=True)  # [B, 1], detached
        if x.is_ratio is not None:
            log_is = torch.log(x.is_ratio).clamp(_LOG_1E8, 20.0)  # [B, T]; a 0 weight: log 1e-8
            log_w = log_w + torch.where(kept, log_is, 0.0).sum(dim=-1, keepdim=True)
        log_w = log_w.clamp(_LOG_1E8, 20.0)
        pos = adv >= 0
        k = torch.where(pos, self.k_pos, self.k_neg)
        lam = torch.where(pos, self.lambda_pos, self.lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # [B, 1] or [B, T]
        phi = torch.where(torch.isfinite(phi), phi, 0.0)
        coef = -(phi * adv)  # [B, 1] or [B, T], detached
        token_loss, _ = linearized(lambda z: (torch.where(kept, coef * z, 0.0), ()), x.logp)  # [B, T]
        loss = scaled_sum(token_loss, x.scales)
        r = ratio(x.log_ratio)

        def sums() -> dict[str, torch.Tensor]:  # phi per sequence, mean over rows (TRL's metric)
            per_row = phi[:, 0] if phi.shape[1] == 1 else (
                torch.where(kept, phi, 0.0).sum(1) / count(kept, dim=1).clamp(min=1))
            rows = torch.full((), float(kept.shape[0]), device=kept.device)
            return {**ratio_sums(x, r), "loss/vespo_phi_seq_mean": per_row.sum(),
                    "loss/vespo_phi_seq_mean#n": rows}

        return SurrogateOutput(token_loss, loss, ratio=r, kl_ratio=token_ratio(x), sums=sums)


#: surrogate name -> class (``sparse_grpo(surrogate=NAME)`` builds it with its defaults)
SURROGATES = {"ppo": PPOClip, "gspo": GSPO, "cispo": CISPO, "sapo": SAPO, "vespo": VESPO}
