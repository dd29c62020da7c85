r"""``SparsePolicyLoss``: a drop-in for OpenRLHF 0.11's ``openrlhf.models.loss.PolicyLoss``.

Same constructor keywords, same ``forward`` signature and the same return value
``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``; the loss is computed by
[`sparse_grpo`][sparsecorr.losses.sparse_grpo] with any sparsecorr correction.

- With ``correction=None`` and OpenRLHF's own ``is_correction_*`` keywords, the correction is
  ``sparsecorr.correction.openrlhf(level, mode, gating, threshold)``, which reproduces
  OpenRLHF's (tested: same loss and gradient), so switching changes nothing; then pass
  ``correction=sparse_rl()`` or ``sparse_tail(...)``.
- OpenRLHF's data-parallel normalisation is preserved: ``batch_num_tokens`` (token mode) and
  ``global_batch_size`` (sample mode) are the global totals, and ``dp_size`` compensates for
  DeepSpeed's gradient averaging, exactly as ``aggregate_loss`` does: the loss is invariant to
  how the batch is sharded.
- Metrics (mismatch incl. tail quantiles of the log-ratio, and correction) are kept in
  `SparsePolicyLoss.last_metrics`; when the hook has attached an experience's ``info``
  dict they are written into it, and OpenRLHF's actor forwards ``info`` to its loggers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sparsecorr.correction import CorrectionFn, get_preset, openrlhf
from sparsecorr.losses import GSPO, Aggregation, PPOClip, sparse_grpo
from sparsecorr.mismatch import measure, mismatch_quantiles

__all__ = ["SparsePolicyLoss"]


@torch.no_grad()
def _vllm_kl(rollout_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""OpenRLHF's ``vllm_kl``: \(\frac{1}{|M|}\sum_{t \in M} (\text{rollout\_logp}_t -
    \text{old\_logp}_t)\) over the loss's tokens \(M\) where that difference is finite.

    Unclamped, as OpenRLHF computes it: a finite log-prob beyond the record's ±20 log-ratio clamp
    moves it as much as it moves OpenRLHF's (the record's ``mismatch/kl_k1_mean`` is the clamped
    mean). A non-finite difference (a ``-inf`` log-prob) is left out, where OpenRLHF's mean
    becomes non-finite; the loss leaves that token out too and counts it
    (``correction/nonfinite_count``).

    Shapes:
        rollout_logp, old_logp, mask: ``[B, T]`` -> 0-d (float32, or float64 for float64 inputs).
    """
    dtype = torch.promote_types(torch.promote_types(rollout_logp.dtype, old_logp.dtype), torch.float32)
    diff = rollout_logp.to(dtype) - old_logp.to(dtype)  # [B, T]
    ok = mask & torch.isfinite(diff)  # [B, T]
    return torch.where(ok, diff, 0.0).sum() / ok.sum().clamp(min=1)


class SparsePolicyLoss(nn.Module):
    """OpenRLHF ``PolicyLoss`` computed by ``sparse_grpo`` with a sparsecorr correction.

    Args:
        clip_eps_low: PPO lower clip ε (OpenRLHF ``eps_clip_low_high[0]``).
        clip_eps_high: PPO upper clip ε.
        dual_clip: dual-clip constant c > 1, or None.
        token_level_loss: token-mean (True) or per-sample mean (False) aggregation.
        policy_loss_type: ``"ppo"`` or ``"gspo"`` (GSPO only without a correction).
        is_correction_level: OpenRLHF's ``off|token|seq`` (used when ``correction`` is None).
        is_correction_mode: OpenRLHF's ``mask|clip``.
        is_correction_gating: OpenRLHF's ``ratio|binary_kl|tv``.
        is_correction_threshold: OpenRLHF's ``(low, high)``.
        correction: a sparsecorr correction (callable) or a preset name for ``get_preset``;
            overrides the ``is_correction_*`` keywords.
        metrics_quantiles: quantiles of the log-ratio reported as ``mismatch/log_ratio_qXX``.
    """

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: Sequence[float] = (0.5, 5.0),
        *,
        correction: CorrectionFn | str | None = None,
        metrics_quantiles: Sequence[float] = (0.01, 0.05, 0.5),
    ) -> None:
        super().__init__()
        if policy_loss_type not in ("ppo", "gspo"):
            raise ValueError(f"policy_loss_type: expected 'ppo' or 'gspo', got {policy_loss_type!r}")
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip: expected None or a number > 1, got {dual_clip!r}")
        if isinstance(correction, str):
            correction = get_preset(correction)
        if correction is None and is_correction_level != "off":
            correction = openrlhf(is_correction_level, is_correction_mode, is_correction_gating,
                                  tuple(is_correction_threshold))
        if policy_loss_type == "gspo" and correction is not None:
            raise ValueError(
                "policy_loss_type: 'gspo' with a correction is not supported (OpenRLHF's GSPO "
                "swaps the reference policy for the rollout instead of reweighting); use 'ppo' "
                "with the correction, or GSPO without one"
            )
        self.clip_eps_low, self.clip_eps_high, self.dual_clip = clip_eps_low, clip_eps_high, dual_clip
        self.token_level_loss = token_level_loss and policy_loss_type != "gspo"
        self.policy_loss_type = policy_loss_type
        self.correction = correction
        self.metrics_quantiles = tuple(metrics_quantiles)
        self.last_metrics: dict[str, torch.Tensor] = {}
        self.info: dict | None = None  # set by the hook to the current experience.info

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | None = None,
        global_batch_size: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Same arguments and return value as OpenRLHF 0.11's ``PolicyLoss.forward``.

        Shapes:
            log_probs, old_log_probs, advantages, action_mask, rollout_log_probs: ``[B, T]``.
        """
        mask = (torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None
                else action_mask.bool())
        if self.correction is not None and rollout_log_probs is None:
            raise ValueError(
                "rollout_log_probs: a correction is configured but the experience carries no "
                "rollout log-probs (enable --rollout.logprobs / vLLM log-probs); refusing to "
                "train silently without it"
            )
        token = self.token_level_loss
        if self.policy_loss_type == "gspo":
            surrogate = GSPO(clip_low=self.clip_eps_low, clip_high=self.clip_eps_high)
        else:
            surrogate = PPOClip(clip_low=self.clip_eps_low, clip_high=self.clip_eps_high,
                                dual_clip=self.dual_clip)
        aggregation = Aggregation(
            "token-mean" if token else "seq-mean-token-mean",
            num_tokens=None if (batch_num_tokens is None or not token) else batch_num_tokens / dp_size,
            num_sequences=None if (global_batch_size is None or token) else global_batch_size / dp_size)
        mm = None
        if rollout_log_probs is not None:
            mm = measure(old_log_probs, rollout_log_probs, mask)
        out = sparse_grpo(log_probs, old_log_probs, advantages, mask, mismatch=mm,
                          correction=self.correction, surrogate=surrogate, aggregation=aggregation)
        if mm is not None and self.metrics_quantiles:  # the moments are in out.metrics already
            out.metrics.update(mismatch_quantiles(mm, self.metrics_quantiles))
        clip_ratio = self._clip_ratio(out, advantages)
        ppo_kl = out.metrics["loss/ppo_kl_k1_mean"]
        vllm_kl = filter_ratio = None
        if self.correction is not None:
            vllm_kl = _vllm_kl(rollout_log_probs, old_log_probs, mask)
            filter_ratio = out.metrics.get(
                "correction/is_filter_ratio", 1.0 - out.metrics.get("correction/kept_token_frac", torch.ones(())))
        self.last_metrics = out.metrics
        if self.info is not None:
            self.info.update(out.metrics)
        return out.loss, clip_ratio, ppo_kl, vllm_kl, filter_ratio

    @torch.no_grad()
    def _clip_ratio(self, out, advantages):
        """OpenRLHF's ``clip_ratio``: the fraction of the loss's tokens whose clipped surrogate
        is the smaller one, read from the ratio the loss used (``out.ratio``: per token for
        PPO; GSPO's sequence ratio, broadcast over the row, as OpenRLHF)."""
        ratio, kept = out.ratio, out.mask  # [B, T] or [B, 1]; [B, T]
        adv = advantages.float() if advantages.dim() == 2 else advantages.float()[:, None]
        clipped = (((adv > 0) & (ratio > 1 + self.clip_eps_high))
                   | ((adv < 0) & (ratio < 1 - self.clip_eps_low)))
        return (clipped & kept).sum() / kept.sum().clamp(min=1)

    def extra_repr(self) -> str:
        return (f"clip=({self.clip_eps_low}, {self.clip_eps_high}), dual_clip={self.dual_clip}, "
                f"token_level_loss={self.token_level_loss}, correction={self.correction!r}")
