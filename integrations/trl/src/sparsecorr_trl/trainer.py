r"""``SparseGRPOTrainer``: TRL's ``GRPOTrainer`` with the loss replaced by ``sparse_grpo``.

The learner log-probs \(\log\pi_\theta\) come from TRL's own forward pass; the loss is
``sparsecorr.losses.sparse_grpo(logp, old_logp, advantages, mask, rollout_logp=...,
correction=...)`` with the aggregation matching TRL's ``loss_type``. When TRL's vLLM path
records the sampler's log-probs (``sampling_per_token_logps``) they become ``rollout_logp``
and TRL's built-in ``vllm_importance_sampling_correction`` is switched off, so the rollout
mismatch is corrected exactly once (by the sparsecorr preset).

Shapes:
    all per-token tensors are ``[B, T]`` over completion tokens; advantages ``[B]``.
"""

from __future__ import annotations

from typing import Any

import torch

from sparsecorr.losses import sparse_grpo
from sparsecorr_trl.config import SparseCorrConfig, validate_grpo_args

SUPPORTED_TRL = ("1.16",)


def check_trl_version(version: str | None = None) -> str:
    """Raise ValueError unless the TRL version (default: installed) is a supported release."""
    if version is None:
        import trl

        version = trl.__version__
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_TRL):
        raise ValueError(f"trl version: expected {SUPPORTED_TRL}.x, got {version!r}")
    return version


def _trainer_base():
    from trl import GRPOTrainer

    return GRPOTrainer


class SparseGRPOTrainer(_trainer_base()):
    """``GRPOTrainer`` whose every loss goes through ``sparsecorr.losses.sparse_grpo``.

    Positional and keyword arguments are those of ``trl.GRPOTrainer``.

    Args:
        sparsecorr_config: what to correct and log (default ``SparseCorrConfig()``:
            the ``sparse_rl`` preset).

    Raises:
        ValueError: on an unsupported TRL version or a config that would skip the correction
            (``use_liger_loss=True``, an unsupported ``loss_type``, sequence-level ratios).
    """

    def __init__(self, *args: Any, sparsecorr_config: SparseCorrConfig | None = None,
                 **kwargs: Any) -> None:
        check_trl_version()
        grpo_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        self.sparsecorr_config = sparsecorr_config or SparseCorrConfig()
        self.sparsecorr_aggregation = validate_grpo_args(grpo_args)
        self.sparsecorr_correction = self.sparsecorr_config.build()
        super().__init__(*args, **kwargs)
        # sparsecorr applies the rollout correction; TRL's own would apply it a second time
        self.vllm_importance_sampling_correction = False

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logp, _, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=False)
        mask = completion_mask.bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_logp is None else old_logp
        rollout_logp = inputs.get("sampling_per_token_logps")
        out = sparse_grpo(
            logp, old_logp, inputs["advantages"], mask,
            rollout_logp=rollout_logp,
            correction=self.sparsecorr_correction if rollout_logp is not None else None,
            clip_low=self.epsilon_low, clip_high=self.epsilon_high,
            aggregation=self.sparsecorr_aggregation,
            norm_length=float(self.max_completion_length),
            ref_logp=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            kl_coef=float(self.beta),
        )
        self._log_sparsecorr(out.metrics)
        if rollout_logp is not None:
            self._observe_acceptance(old_logp, rollout_logp, mask)
        mode = "train" if self.model.training else "eval"
        scale = getattr(self, "current_gradient_accumulation_steps", 1) if mode == "train" else 1.0
        return out.loss / scale

    def _callbacks(self):
        from sparsecorr_trl.callback import SparseCorrCallback

        return [c for c in self.callback_handler.callbacks if isinstance(c, SparseCorrCallback)]

    def _observe_acceptance(self, old_logp, rollout_logp, mask) -> None:
        lr = (old_logp.detach().float() - rollout_logp.float()).clamp(-20.0, 20.0)
        acceptance = torch.exp(lr.clamp(max=0.0))
        ok = mask & (rollout_logp.abs() < float("inf"))
        for cb in self._callbacks():
            cb.observe(acceptance, ok)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        for cb in self._callbacks():
            cb.load_checkpoint(resume_from_checkpoint)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        for cb in self._callbacks():
            logs.update(cb.schedule_metrics())
        super().log(logs, *args, **kwargs)

    def _log_sparsecorr(self, metrics: dict[str, torch.Tensor]) -> None:
        if not self.sparsecorr_config.log_metrics:
            return
        mode = "train" if self.model.training else "eval"
        for name, value in metrics.items():
            # one host sync per logged metric, at logging granularity (as TRL's own metrics)
            self._metrics[mode][f"sparsecorr/{name}"].append(float(value))
