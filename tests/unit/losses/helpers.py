"""Build ``sparse_grpo``'s surrogate and aggregation objects from the flat parameters the loop
reference (``tests.unit.losses.reference``) takes, so one parametrisation drives both."""

from __future__ import annotations

from sparsecorr.losses import GSPO, Aggregation, KLPenalty, PPOClip, sparse_grpo


def surrogate(*, clip_low=0.2, clip_high=0.2, dual_clip=None, ratio_level="token"):
    cls = PPOClip if ratio_level == "token" else GSPO
    return cls(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)


def grpo(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
         ratio_level="token", aggregation="token-mean", num_tokens=None, num_sequences=None,
         norm_length=None, kl_coef=0.0, **kw):
    """``sparse_grpo`` with the reference's flat parameters."""
    return sparse_grpo(
        logp, old_logp, advantages, mask,
        surrogate=surrogate(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                            ratio_level=ratio_level),
        aggregation=Aggregation(aggregation, num_tokens=num_tokens, num_sequences=num_sequences,
                                norm_length=norm_length),
        kl=KLPenalty(kl_coef), **kw)
