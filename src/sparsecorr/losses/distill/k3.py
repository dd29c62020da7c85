r"""DistillSparse (Sparrow, Zhou et al. 2026, arXiv 2606.08446 §DistillSparse): sampled-token
k3 estimator and the adapter loss.

The sparse sampler with LoRA adapter \(\varphi\) samples tokens; the dense model \(\theta\) is
frozen during the adapter update. With \(d_t = \text{dense\_logp}_t - \text{sparse\_logp}_t\),

\[
k_3 = e^{d_t} - d_t - 1 \;\ge 0, \qquad \mathbb{E}_{y\sim q}[k_3] = \mathrm{KL}(q\,\|\,p),
\]

an unbiased estimator of the reverse KL(sparse ‖ dense) on tokens sampled from the sparse policy
(Schulman 2020). The adapter loss is \(L = L_\text{PPO}^\text{sparse} + \lambda\,\overline{k_3}\),
\(\lambda = 10^{-3}\), where the PPO ratio is between the current sparse+\(\varphi\) policy and the
sampler at rollout time (the samples are on-policy for it: no IS correction).
"""

from __future__ import annotations

import torch

from ..._checks import check_float_tensor, check_mask, check_positive, check_same_shape
from ..._checks import finite as finite_
from ...mismatch import kl_k3
from ..aggregation import Aggregation
from ..grpo import sparse_grpo
from ..output import LossOutput

__all__ = ["distill_sparse_loss", "sparse_kl_k3", "topk_kl"]


def sparse_kl_k3(sparse_logp: torch.Tensor, dense_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Per-token \(k_3\) of DistillSparse; gradient flows to ``sparse_logp`` only.

    ``dense_logp`` is detached; the log-difference is clamped to ±20; masked or non-finite
    positions give 0.

    Shapes:
        sparse_logp, dense_logp, mask: ``[B, T]`` -> ``[B, T]`` float32 (≥ 0).
    """
    check_float_tensor("sparse_logp", sparse_logp)
    check_float_tensor("dense_logp", dense_logp)
    return kl_k3(dense_logp.detach(), sparse_logp, mask)


def topk_kl(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    direction: str = "forward",
    renormalize: bool = True,
) -> torch.Tensor:
    r"""KL restricted to a shared top-k support (e.g. a ``RolloutBatch``'s top-k token ids).

    Both inputs are log-probs over the *same* ``K`` token ids per position (gather the other
    engine's log-probs at the sampler's top-k ids). With ``renormalize=True`` each is
    renormalised over the support, \(\hat p = \mathrm{softmax}_k(\log p)\), and the result is the
    KL between the two restricted distributions (≥ 0). With ``renormalize=False`` it is the
    truncated sum \(\sum_{k} p_k(\log p_k - \log q_k)\) over the support (a biased estimate
    that ignores the mass outside it). ``direction="forward"`` is KL(teacher ‖ student),
    ``"reverse"`` KL(student ‖ teacher). Gradient flows to ``student_logp``.

    Shapes:
        student_logp, teacher_logp: ``[B, T, K]``; mask: ``[B, T]`` -> ``[B, T]`` float32.
    """
    check_float_tensor("student_logp", student_logp, ndim=3)
    check_float_tensor("teacher_logp", teacher_logp, ndim=3)
    check_same_shape(student_logp=student_logp, teacher_logp=teacher_logp)
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction: expected one of ['forward', 'reverse'], got {direction!r}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != student_logp.shape[:2]:
        raise ValueError(f"mask: expected a bool tensor of shape {tuple(student_logp.shape[:2])}, "
                         f"got {getattr(mask, 'dtype', type(mask))} {tuple(getattr(mask, 'shape', ()))}")
    m = mask[..., None]
    s = torch.where(m, student_logp.float(), 0.0)
    t = torch.where(m, teacher_logp.detach().float(), 0.0)
    if renormalize:
        s, t = torch.log_softmax(s, dim=-1), torch.log_softmax(t, dim=-1)
    p, q = (t, s) if direction == "forward" else (s, t)
    terms = torch.where(p == float("-inf"), 0.0, p.exp() * (p - q))  # 0 log 0 = 0
    return torch.where(mask, terms.sum(-1), 0.0)


def distill_sparse_loss(
    sparse_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    dense_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_weight: float = 1e-3,
    surrogate: str | object = "ppo",
    aggregation: str | Aggregation = "token-mean",
) -> LossOutput:
    r"""The DistillSparse adapter loss \(L_\text{PPO}^\text{sparse} + \lambda\,k_3\).

    Args:
        sparse_logp: current sparse+adapter log-probs (gradient flows to the adapter).
        rollout_logp: the sampler's log-probs at rollout time (PPO's "old" policy here).
        dense_logp: frozen dense log-probs (``old_logp`` of the dense update).
        advantages: ``[B]`` or ``[B, T]``.
        mask: bool, True = the token counts. Tokens with a non-finite ``rollout_logp`` or
            ``dense_logp`` are dropped and counted (``distill/nonfinite``).
        kl_weight: \(\lambda\) (paper: 1e-3).
        surrogate: as in [`sparse_grpo`][sparsecorr.losses.sparse_grpo] (``PPOClip(...)``).
        aggregation: as in ``sparse_grpo`` (an ``Aggregation`` carries global counts); the k3
            term is aggregated the same way, over the same kept tokens.

    Returns:
        ``LossOutput``; metrics: the PPO term's ``loss/*`` plus ``distill/kl_k3_mean``,
        ``distill/kl_loss``, ``distill/nonfinite``.

    Shapes:
        sparse_logp, rollout_logp, dense_logp, mask: ``[B, T]``; advantages ``[B]`` or
        ``[B, T]`` -> loss ``[]``.
    """
    check_positive("kl_weight", kl_weight, allow_zero=True)
    check_float_tensor("sparse_logp", sparse_logp, ndim=2)
    check_mask(mask, sparse_logp)
    check_float_tensor("rollout_logp", rollout_logp, ndim=2)
    check_float_tensor("dense_logp", dense_logp, ndim=2)
    check_same_shape(sparse_logp=sparse_logp, rollout_logp=rollout_logp, dense_logp=dense_logp)
    agg = Aggregation(aggregation) if isinstance(aggregation, str) else aggregation
    finite = finite_(rollout_logp) & finite_(dense_logp)
    pg = sparse_grpo(sparse_logp, rollout_logp, advantages, mask & finite, surrogate=surrogate,
                     aggregation=agg)
    kept = pg.mask  # also without the tokens a non-finite sparse_logp or advantage dropped
    k3 = sparse_kl_k3(sparse_logp, dense_logp, kept)
    kl_loss = (torch.where(kept, k3, 0.0).sum(dim=1) * agg.row_scales(kept)).sum()
    metrics = dict(pg.metrics)
    with torch.no_grad():
        metrics["distill/kl_k3_mean"] = k3.detach().sum() / kept.sum().clamp(min=1)
        metrics["distill/kl_loss"] = kl_loss.detach()
        metrics["distill/nonfinite"] = (mask & ~finite).sum().float()
    return LossOutput(loss=pg.loss + kl_weight * kl_loss, token_loss=pg.token_loss + kl_weight * k3,
                      metrics={k: v.detach().float().reshape(()) for k, v in metrics.items()}, mask=kept)
