r"""The sampler probe: how far an arm's sparse sampler is from its dense model, measured the same
way for corrected and uncorrected arms.

The trainer logs the correction's statistics only where a correction runs, so an uncorrected
arm would show nothing of what ``sparse_rl()`` would have rejected. The probe samples
``samples`` rollouts per held-out prompt with the arm's KV policy and budget (temperature 1,
the full next-token distribution recorded, the vocabulary being 64 words), teacher-forces the
dense model on them and reports:

- ``probe_reward``: the sampler's reward on those rollouts;
- ``probe_accept_q05``: Sparrow's tail statistic, the 5 % quantile over tokens of the exact
  acceptance \(\alpha_t = \sum_v \min(p_t(v), q_t(v))\) (``p`` dense, ``q`` sparse; Zhou et
  al., 2026, METHODS §2);
- ``probe_log_ratio_q05``: the 5 % quantile of \(\ell_t = \log p_t(y_t) - \log q_t(y_t)\);
- ``probe_rejected_frac``, ``probe_vetoed_frac``, ``probe_ess``: what ``sparse_rl()`` (Luo et
  al., 2026, METHODS §1) does to these rollouts: the fraction of tokens its band
  \([0.5, 1.5]\) rejects, the fraction of sequences its veto (\(r_t < 10^{-4}\)) drops, and the
  normalised effective sample size of its weights over the kept tokens.

Shapes:
    prompts ``[N, P]``; rollouts ``[N * samples, T]``; every statistic a float.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from sparsecorr._modes import eval_mode
from sparsecorr.correction import sparse_rl
from sparsecorr.decoding import generate, get_policy
from sparsecorr.mismatch import measure
from sparsecorr.mismatch.quantiles import masked_quantile

from .task import VOCAB, recall_reward

__all__ = ["PROBE_KEYS", "probe_sampler", "sampler_of"]

PROBE_KEYS = ("probe_reward", "probe_accept_q05", "probe_log_ratio_q05", "probe_rejected_frac",
              "probe_vetoed_frac", "probe_ess")


def sampler_of(config: dict[str, Any]) -> tuple[Any, Any] | None:
    """``(policy, budget)`` of an arm's ``SparseCorrConfig`` keywords; None for a dense arm."""
    if config.get("policy") in (None, "dense"):
        return None
    from sparsecorr.schedules import BudgetSchedule

    policy = get_policy(config["policy"], **config.get("policy_kwargs", {}))
    budget = (BudgetSchedule.load(config["schedule"]) if config.get("schedule") is not None
              else config["budget"])
    return policy, budget


def _acceptance(dense_logp: torch.Tensor, topk_logp: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """Exact \\(\\sum_v \\min(p, q)\\) ``[B, T]`` from the dense log-probs ``[B, T, V]`` and the
    sampler's top-V log-probs ``[B, T, V]`` (all of its distribution)."""
    q = torch.zeros_like(dense_logp).scatter(-1, topk_ids, topk_logp.exp())
    return torch.minimum(dense_logp.exp(), q).sum(-1)


def probe_sampler(model, prompts: torch.Tensor, *, policy, budget, max_new_tokens: int,
                  samples: int = 2, seed: int = 0,
                  dense: AbstractContextManager | None = None,
                  sparse: AbstractContextManager | None = None) -> dict[str, float]:
    """The statistics of `PROBE_KEYS` for ``model`` sampled with ``policy`` at ``budget``.

    Args:
        dense, sparse: context managers entered around the dense forward and the sparse
            sampling (DistillSparse: the adapter off for the dense model; on, or off to measure
            the sampler without it).
    """
    ids = prompts.repeat_interleave(samples, 0)
    g = torch.Generator().manual_seed(seed)
    with eval_mode(model), torch.no_grad():
        with sparse or nullcontext():
            batch = generate(model, ids, policy=policy, budget=budget, temperature=1.0,
                             max_new_tokens=max_new_tokens, logprobs_topk=VOCAB, generator=g)
        with dense or nullcontext():
            logits = model(torch.cat([ids, batch.tokens], 1)).logits
    p_len = ids.shape[1]
    dense_logp = torch.log_softmax(logits[:, p_len - 1:-1].float(), -1)
    old = dense_logp.gather(-1, batch.tokens[..., None])[..., 0]
    mask = batch.mask
    accept = _acceptance(dense_logp, batch.topk_logp, batch.topk_ids)
    mm = measure(old, batch.rollout_logp, mask)
    metrics = sparse_rl()(mm).metrics
    return {
        "probe_reward": float(recall_reward(ids, batch.tokens, mask).mean()),
        "probe_accept_q05": float(masked_quantile(accept, mask, 0.05)),
        "probe_log_ratio_q05": float(masked_quantile(old - batch.rollout_logp, mask, 0.05)),
        "probe_rejected_frac": float(metrics["correction/band_rejected_frac"]),
        "probe_vetoed_frac": float(metrics["correction/vetoed_seqs"]) / max(1, ids.shape[0]),
        "probe_ess": float(metrics["correction/ess"]),
    }
