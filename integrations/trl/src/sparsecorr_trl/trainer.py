r"""``SparseGRPOTrainer``: TRL's ``GRPOTrainer`` with sparse rollouts and the loss replaced by
``sparse_grpo``.

Rollouts: with ``SparseCorrConfig.policy`` set (and ``use_vllm=False``) the trainer samples
with ``sparsecorr.decoding.generate`` under that KV policy and budget or schedule (the live
schedule of a ``SparseCorrCallback`` when there is one) and records the sampler's log-prob of
every token; without it, TRL generates (vLLM records the log-probs; transformers' generate does
not, and then nothing needs correcting). Optional DistillSparse (``distill=True``): a LoRA
adapter active only while sampling, updated after every policy backward pass
(``sparsecorr_trl.distill``).

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

from sparsecorr._checks import finite
from sparsecorr.losses import Aggregation, PPOClip, dense_mode, sparse_adapter, sparse_grpo
from sparsecorr.mismatch import log_ratio
from sparsecorr_trl.config import SparseCorrConfig, validate_grpo_args
from sparsecorr_trl.rollout import sampling_kwargs, sparse_rollouts

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
        cfg = self.sparsecorr_config = sparsecorr_config or SparseCorrConfig()
        self.sparsecorr_aggregation = validate_grpo_args(grpo_args, cfg)
        self.sparsecorr_correction = cfg.build()
        self.sparsecorr_policy = cfg.build_policy()
        self.sparsecorr_budget = cfg.build_budget()
        if cfg.distill:
            args, kwargs = self._wrap_adapter(args, kwargs, grpo_args)
        super().__init__(*args, **kwargs)
        # sparsecorr applies the rollout correction; TRL's own would apply it a second time
        self.vllm_importance_sampling_correction = False
        seed = int(getattr(self.args, "seed", 0)) + 7919 * self.accelerator.process_index
        self._sparsecorr_generator = torch.Generator().manual_seed(seed)
        if cfg.controller and not self._callbacks():
            from sparsecorr.schedules import TailController
            from sparsecorr_trl.callback import SparseCorrCallback

            schedule = self.sparsecorr_budget
            candidates = list(cfg.controller_candidates) or sorted(
                {b for b in schedule.budgets if b is not None})
            if not candidates:
                raise ValueError("controller_candidates: expected budgets (the schedule is dense "
                                 "everywhere), got none")
            self.add_callback(SparseCorrCallback(TailController(schedule, candidates, tau=cfg.tau)))
        self._sparsecorr_adapter_step = None
        if cfg.distill:
            from sparsecorr_trl.distill import AdapterStep

            self._sparsecorr_adapter_step = AdapterStep(
                self.accelerator.unwrap_model(self.model), lr=cfg.distill_lr,
                kl_weight=cfg.distill_kl_weight)

    def _wrap_adapter(self, args, kwargs, grpo_args):
        """Wrap the policy in the DistillSparse LoRA adapter before TRL sees it."""
        if getattr(grpo_args, "beta", 0.0) != 0.0:
            raise ValueError("beta: expected 0.0 with distill=True (TRL would take the "
                             "adapter-disabled, trained model as the reference), got "
                             f"{grpo_args.beta!r}")
        if kwargs.get("peft_config") is not None:
            raise ValueError("peft_config: expected None with distill=True (the sparse adapter "
                             "is the only peft adapter), got a config")
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, str) or model is None:
            raise ValueError("model: expected a model object with distill=True (it is wrapped "
                             f"in the sparse adapter before TRL sees it), got {model!r}")
        cfg = self.sparsecorr_config
        wrapped = sparse_adapter(model, r=cfg.distill_rank, alpha=cfg.distill_alpha)
        if "model" in kwargs:
            kwargs = {**kwargs, "model": wrapped}
        else:
            args = (wrapped, *args[1:])
        return args, kwargs

    @property
    def sparsecorr_live_budget(self):
        """The budget the sampler uses now: the controller's live schedule, else the config's."""
        callbacks = self._callbacks()
        return callbacks[0].schedule if callbacks else self.sparsecorr_budget

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                              has_tool_images=False):
        if self.sparsecorr_policy is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                 num_generations, has_tool_images)
        if images is not None and any(img for img in images if img):
            raise ValueError("images: sparsecorr's sampler is text-only, got image inputs")
        mode = "train" if self.model.training else "eval"
        model = self.accelerator.unwrap_model(self.model)
        completions, logprobs, stats = sparse_rollouts(
            model, prompt_ids, policy=self.sparsecorr_policy, budget=self.sparsecorr_live_budget,
            max_new_tokens=self.max_completion_length, eos_token_id=list(self.eos_token_ids),
            pad_token_id=self._tokenizer.pad_token_id or 0, generator=self._sparsecorr_generator,
            sampling=sampling_kwargs(self.args))
        if self.sparsecorr_config.log_metrics:
            for name, value in stats.as_metrics().items():
                self._metrics[mode][name].append(value)
        return completions, logprobs

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if not self.sparsecorr_config.distill:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        # DistillSparse: every learner forward is the dense model (adapter off)
        with dense_mode(self.accelerator.unwrap_model(model)):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def _prepare_inputs(self, generation_batch):
        prepared = getattr(self, "_sparsecorr_prepared", None)
        if prepared is not None:
            self._sparsecorr_prepared = None
            return prepared
        return super()._prepare_inputs(generation_batch)

    def training_step(self, model, inputs, num_items_in_batch):
        if not self.sparsecorr_config.distill:
            return super().training_step(model, inputs, num_items_in_batch)
        # rollouts with the adapter on; then the whole policy step (forward, and the backward
        # that gradient checkpointing recomputes) with it off: theta is trained dense
        prepared = self._prepare_inputs(inputs)
        self._sparsecorr_prepared = prepared
        with dense_mode(self.accelerator.unwrap_model(model)):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if "sampling_per_token_logps" in prepared:
            self._distill_step(prepared)
        return loss

    def _distill_step(self, inputs) -> None:
        dense_logp = getattr(self, "_sparsecorr_dense_logp", None)
        if dense_logp is None or dense_logp.shape != inputs["completion_ids"].shape:
            return
        metrics = self._sparsecorr_adapter_step(
            self.accelerator.unwrap_model(self.model), prompt_ids=inputs["prompt_ids"],
            prompt_mask=inputs["prompt_mask"], completion_ids=inputs["completion_ids"],
            completion_mask=inputs["completion_mask"],
            rollout_logp=inputs["sampling_per_token_logps"], dense_logp=dense_logp,
            advantages=inputs["advantages"], policy=self.sparsecorr_policy,
            budget=self.sparsecorr_live_budget, sampling=sampling_kwargs(self.args),
            clip_low=self.epsilon_low, clip_high=self.epsilon_high,
            aggregation=self.sparsecorr_aggregation)
        for name, value in metrics.items():
            self._metrics["train"][f"sparsecorr/{name}"].append(value)

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
        self._sparsecorr_dense_logp = old_logp.detach()
        rollout_logp = inputs.get("sampling_per_token_logps")
        out = sparse_grpo(
            logp, old_logp, inputs["advantages"], mask,
            rollout_logp=rollout_logp,
            correction=self.sparsecorr_correction if rollout_logp is not None else None,
            surrogate=PPOClip(clip_low=self.epsilon_low, clip_high=self.epsilon_high),
            aggregation=Aggregation(self.sparsecorr_aggregation,
                                    norm_length=float(self.max_completion_length)),
            ref_logp=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            kl=float(self.beta),
        )
        self._log_sparsecorr(out.metrics)
        if rollout_logp is not None and self.model.training:
            self._observe_acceptance(old_logp, rollout_logp, mask, prompt_mask.sum(1))
        mode = "train" if self.model.training else "eval"
        scale = getattr(self, "current_gradient_accumulation_steps", 1) if mode == "train" else 1.0
        return out.loss / scale

    def _callbacks(self):
        from sparsecorr_trl.callback import SparseCorrCallback

        return [c for c in self.callback_handler.callbacks if isinstance(c, SparseCorrCallback)]

    def _observe_acceptance(self, old_logp, rollout_logp, mask, prompt_lengths) -> None:
        """Feed min(1, pi_old / pi_rollout) per token to the controller, binned by context length."""
        ok = mask & finite(old_logp) & finite(rollout_logp)
        acceptance = torch.exp(log_ratio(old_logp.detach(), rollout_logp, ok).clamp(max=0.0))
        for cb in self._callbacks():
            cb.observe(acceptance, ok, prompt_lengths.long())

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
