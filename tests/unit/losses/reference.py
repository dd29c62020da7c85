"""Plain Python loop references for the losses (test-only; deliberately unvectorised)."""

from __future__ import annotations

import math

import torch


def loop_grpo_loss(logp, old_logp, adv, mask, weights=None, *, clip_low=0.2, clip_high=0.2,
                   dual_clip=None, ratio_level="token", aggregation="token-mean",
                   ref_logp=None, kl_coef=0.0, norm_length=None):
    """The clipped decoupled PPO loss written token by token (autograd through ``logp``)."""
    b, t = mask.shape
    rows = []
    for i in range(b):
        kept = [j for j in range(t) if bool(mask[i, j])]
        a = float(adv[i]) if adv.dim() == 1 else None
        seq_ratio = None
        if ratio_level == "sequence" and kept:
            seq_ratio = torch.exp(sum(logp[i, j] - old_logp[i, j] for j in kept) / len(kept))
        terms = []
        for j in kept:
            aij = a if a is not None else float(adv[i, j])
            ratio = seq_ratio if seq_ratio is not None else torch.exp(logp[i, j] - old_logp[i, j])
            clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
            obj = torch.minimum(ratio * aij, clipped * aij)
            if dual_clip is not None and aij < 0:
                obj = torch.maximum(obj, torch.tensor(dual_clip * aij))
            w = 1.0 if weights is None else float(weights[i, j])
            term = -w * obj
            if kl_coef:
                d = ref_logp[i, j] - logp[i, j]
                term = term + kl_coef * (torch.exp(d) - d - 1)
            terms.append(term)
        rows.append(terms)
    n_tok = sum(len(r) for r in rows)
    nonempty = [r for r in rows if r]
    if aggregation == "token-mean":
        return sum(sum(r) for r in nonempty) / max(n_tok, 1)
    length = t if norm_length is None else norm_length
    per_seq = {
        "seq-mean-token-mean": lambda r: sum(r) / len(r),
        "seq-mean-token-sum": lambda r: sum(r),
        "seq-mean-token-sum-norm": lambda r: sum(r) / length,
    }[aggregation]
    return sum(per_seq(r) for r in nonempty) / max(len(nonempty), 1)


def loop_group_advantages(rewards, group_size, normalize="std", eps=1e-6, valid=None):
    out = []
    for g in range(0, len(rewards), group_size):
        members = [k for k in range(g, g + group_size) if valid is None or bool(valid[k])]
        vals = [float(rewards[k]) for k in members]
        mean = sum(vals) / len(vals) if vals else 0.0
        var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
        for k in range(g, g + group_size):
            if k not in members:
                out.append(0.0)
            elif normalize == "std":
                out.append((float(rewards[k]) - mean) / (math.sqrt(var) + eps))
            else:
                out.append(float(rewards[k]) - mean)
    return torch.tensor(out)
