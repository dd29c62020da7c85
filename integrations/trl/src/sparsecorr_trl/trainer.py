r"""``SparseGRPOTrainer``: TRL's ``GRPOTrainer`` with sparse rollouts, the rollout correction in
the generate-and-score step and the loss written with ``sparse_grpo``.

With sparsecorr off (``SparseCorrConfig(correction=None)``, TRL's generation) it trains
exactly as stock ``trl.GRPOTrainer`` 1.16 (``tests/integration/trl/test_parity.py``): the loss
of every accepted ``loss_type`` is ``sparse_grpo`` with TRL's window counts
(``sparsecorr_trl.loss``), TRL's metrics are computed beside it (``sparsecorr_trl.metrics``) and
every ``GRPOConfig`` option is honoured or rejected (``sparsecorr_trl.options``).

Rollouts: with ``SparseCorrConfig.policy`` set (and ``use_vllm=False``) the trainer samples
with ``sparsecorr.decoding.generate`` under that KV policy and budget or schedule (the live
schedule of a ``SparseCorrCallback`` when there is one), on the policy's full parameters
gathered once per rollout under FSDP v1/v2 and DeepSpeed ZeRO-3 and without its training hooks
(``sparsecorr_trl.gather``), and records the sampler's log-prob of
every token (and its top-k when the acceptance is needed); without it, TRL generates (vLLM
records the log-probs; transformers' generate does not, and then nothing needs correcting).

Order: after TRL's generate-and-score step, ``sparsecorr_trl.score`` computes the correction of
the whole generation batch from the dense ``old_logp`` (and the acceptance), re-derives the
advantages without the rollouts it rejected whole and re-counts ``num_items_in_batch``; the
correction's mask and weights travel with the batch to ``_compute_loss``. TRL's own
``vllm_importance_sampling_correction`` is switched off when a correction is set, so the
mismatch is corrected once. Optional DistillSparse (``distill=True``): a LoRA adapter active
only while sampling, updated after every policy backward pass (``sparsecorr_trl.distill``).
Checkpoints carry the sampler's state (``sparsecorr_trl.checkpoint``).

Shapes:
    all per-token tensors are ``[B, T]`` over completion tokens; advantages ``[B]``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from sparsecorr.correction import Correction
from sparsecorr.losses import dense_mode, sparse_adapter
from sparsecorr.mismatch import measure
from sparsecorr_trl.checkpoint import (
    load_policy,
    load_sampler_state,
    sampler_file,
    save_policy,
    save_sampler_state,
)
from sparsecorr_trl.config import SparseCorrConfig
from sparsecorr_trl.corrections import needs_acceptance, with_group
from sparsecorr_trl.gather import rollout_model
from sparsecorr_trl.loss import AGGREGATION_BY_LOSS_TYPE, LossSpec, aggregation, trl_loss
from sparsecorr_trl.metrics import entropy_bonus, log_sparsecorr, trl_metrics
from sparsecorr_trl.options import check_trl_version, validate_grpo_args
from sparsecorr_trl.rollout import sampling_kwargs, sparse_rollouts
from sparsecorr_trl.score import score_rollouts

#: multimodal inputs TRL's forward takes from the batch
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                 "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                 "mm_token_type_ids", "image_position_ids")


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
        ValueError: on an unsupported TRL version, a ``GRPOConfig`` value it cannot honour
            exactly (``sparsecorr_trl.options.RULES``, naming the option), or an acceptance
            reader (controller, ``sparse_tail``) with vLLM rollouts.
    """

    def __init__(self, *args: Any, sparsecorr_config: SparseCorrConfig | None = None,
                 **kwargs: Any) -> None:
        check_trl_version()
        grpo_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        cfg = self.sparsecorr_config = sparsecorr_config or SparseCorrConfig()
        if grpo_args is not None:
            validate_grpo_args(grpo_args, cfg)
        self.sparsecorr_correction = cfg.build()
        self.sparsecorr_policy = cfg.build_policy()
        self.sparsecorr_budget = cfg.build_budget()
        if cfg.distill:
            args, kwargs = self._wrap_adapter(args, kwargs)
        super().__init__(*args, **kwargs)
        validate_grpo_args(self.args, cfg)
        self._sparsecorr_loss_spec = LossSpec.from_args(self.args)
        if self.sparsecorr_correction is not None:
            # sparsecorr applies the rollout correction; TRL's own would apply it a second time
            self.vllm_importance_sampling_correction = False
            if self.accelerator.num_processes > 1:  # batch statistics over every process
                import torch.distributed as dist

                self.sparsecorr_correction = with_group(self.sparsecorr_correction,
                                                        dist.group.WORLD)
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
        self._sparsecorr_topk = None
        self.sparsecorr_rollout_engine: dict[str, str] | None = None  # backend, cuda_graph, fused of the last rollout
        self._sparsecorr_needs_acceptance = bool(
            cfg.acceptance or self._callbacks() or needs_acceptance(self.sparsecorr_correction))
        if self._sparsecorr_needs_acceptance and self.sparsecorr_policy is None and self.use_vllm:
            raise ValueError("policy: the acceptance rate (controller, sparse_tail) needs the "
                             "sparse sampler's top-k log-probs, got policy=None with vLLM")
        self._sparsecorr_adapter_step = None
        if cfg.distill:
            from sparsecorr_trl.distill import AdapterStep

            self._sparsecorr_adapter_step = AdapterStep(
                self.accelerator.unwrap_model(self.model), lr=cfg.distill_lr,
                kl_weight=cfg.distill_kl_weight)

    def _wrap_adapter(self, args, kwargs):
        """Wrap the policy in the DistillSparse LoRA adapter before TRL sees it."""
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
        needs = self._sparsecorr_needs_acceptance or bool(self._callbacks())  # added later too
        topk = self.sparsecorr_config.acceptance_topk if needs else 0
        if topk and self._sparsecorr_topk is not None:
            raise ValueError("max_tool_calling_iterations: the acceptance rate (controller, "
                             "sparse_tail) needs one sampler call per generation batch, got a "
                             "multi-turn tool loop")
        # shards gathered once for the whole rollout; no checkpointing or input-grad hooks
        with rollout_model(self) as model:
            out = sparse_rollouts(
                model, prompt_ids, policy=self.sparsecorr_policy,
                budget=self.sparsecorr_live_budget, max_new_tokens=self.max_completion_length,
                eos_token_id=list(self.eos_token_ids), pad_token_id=self._tokenizer.pad_token_id or 0,
                generator=self._sparsecorr_generator, sampling=sampling_kwargs(self.args),
                logprobs_topk=topk, cuda_graph=self.sparsecorr_config.cuda_graph,
                backend=self.sparsecorr_config.backend, fused_step=self.sparsecorr_config.fused_step,
                max_num_seqs=self.sparsecorr_config.sparse_max_num_seqs)
        self.sparsecorr_rollout_engine = {"backend": out.backend, "cuda_graph": out.cuda_graph, "fused": out.fused}
        if topk:
            self._sparsecorr_topk = (out.topk_logp, out.topk_ids)
        if self.sparsecorr_config.log_metrics:
            for name, value in out.stats.as_metrics().items():
                self._metrics[mode][name].append(value)
        return out.completions, out.logprobs

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._sparsecorr_rewards = rewards  # all processes; the correction may re-derive advantages
        return rewards

    def _generate_and_score_completions(self, inputs):
        self._sparsecorr_topk = None
        out = super()._generate_and_score_completions(inputs)
        if "sampling_per_token_logps" in out and (self.sparsecorr_correction is not None
                                                  or self._sparsecorr_topk is not None):
            out = score_rollouts(self, out, topk=self._sparsecorr_topk)
        self._sparsecorr_topk = None
        return out

    def _sparsecorr_dense_context(self, model):
        """Every dense forward runs with the DistillSparse adapter off."""
        return dense_mode(model) if self.sparsecorr_config.distill else contextlib.nullcontext()

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if not self.sparsecorr_config.distill:  # no adapter: no unwrap_model per forward
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        # DistillSparse: every learner forward is the dense model (adapter off)
        with self._sparsecorr_dense_context(self.accelerator.unwrap_model(model)):
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
            aggregation=AGGREGATION_BY_LOSS_TYPE[self.loss_type][0])
        for name, value in metrics.items():
            self._metrics["train"][f"sparsecorr/{name}"].append(value)

    def _compute_loss(self, model, inputs):
        train = self.model.training
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        logp, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].size(1), compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in _FORWARD_KEYS})
        advantages = inputs["advantages"]
        adv2d = advantages[:, None] if advantages.dim() == 1 else advantages
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_logp is None else old_logp
        self._sparsecorr_dense_logp = inputs.get("sparsecorr_old_logp", old_logp).detach()
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        factor = None
        if self.off_policy_mask_threshold is not None:
            factor = self.get_off_policy_mask(
                advantages=adv2d, per_token_logps=logp,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_logp),
                mask=mask, off_policy_threshold=self.off_policy_mask_threshold)
        if entropy_mask is not None:
            factor = entropy_mask.float() if factor is None else factor * entropy_mask
        grad_accum = self.current_gradient_accumulation_steps if train else 1
        spec = self._sparsecorr_loss_spec
        agg, divisor = aggregation(
            spec, mask=mask, num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes, grad_accum=grad_accum,
            steps_per_generation=self.args.steps_per_generation, train=train)
        bool_mask = mask.bool()
        mm, corr = self._sparsecorr_loss_correction(inputs, old_logp, bool_mask)
        parts = trl_loss(spec, logp, old_logp, advantages, bool_mask, agg=agg, divisor=divisor,
                         factor=factor, ref_logp=inputs.get("ref_per_token_logps"),
                         mismatch=mm, correction=corr)
        loss = parts.loss
        logged: dict[str, float] = {}
        if self._entropy_bonus_enabled:
            acting = mask if entropy_mask is None else mask * entropy_mask
            term, logged = entropy_bonus(self, entropies, acting, train=train, grad_accum=grad_accum)
            loss = loss - term
            logged["policy_loss"] = self.accelerator.gather(parts.policy_loss).nanmean().item()
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / grad_accum
            logged["aux_loss"] = self.accelerator.gather_for_metrics(aux_loss).mean().item()
        logged.update(trl_metrics(
            self.accelerator, loss_type=spec.loss_type, ratio=parts.ratio, advantages=adv2d,
            mask=mask, entropies=entropies, per_token_kl=parts.per_token_kl,
            clip_low=spec.clip_low, clip_high=spec.clip_high, sums=parts.sums))
        mode = "train" if train else "eval"
        for name, value in logged.items():
            self._metrics[mode][name].append(value)
        self._log_sparsecorr(parts.metrics)
        return loss

    def _sparsecorr_loss_correction(self, inputs, old_logp, mask):
        """The ``Correction`` computed once per generation batch (``sparsecorr_trl.score``),
        rebuilt for this micro-batch from the mask and weights carried in the batch (no
        second ``measure``: the record's and the correction's metrics were logged there);
        ``(None, None)`` without sampler log-probs. A batch that did not go through the
        generate-and-score step (no carried mask) is measured here."""
        if "sparsecorr_mask" in inputs:
            return None, Correction(mask=inputs["sparsecorr_mask"],
                                    token_weights=inputs.get("sparsecorr_weights"))
        rollout_logp = inputs.get("sampling_per_token_logps")
        if rollout_logp is None:
            return None, None
        return measure(inputs.get("sparsecorr_old_logp", old_logp), rollout_logp, mask,
                       validate=False), None

    def _callbacks(self):
        from sparsecorr_trl.callback import SparseCorrCallback

        return [c for c in self.callback_handler.callbacks if isinstance(c, SparseCorrCallback)]

    def _sampler_checkpoint(self, directory):
        return sampler_file(directory, self.args.process_index, self.args.world_size)

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        step = self._sparsecorr_adapter_step
        save_sampler_state(self._sampler_checkpoint(output_dir), self._sparsecorr_generator,
                           None if step is None else step.optimizer)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        if checkpoint is not None:
            step = self._sparsecorr_adapter_step
            load_sampler_state(self._sampler_checkpoint(checkpoint), self._sparsecorr_generator,
                               None if step is None else step.optimizer)

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        if self.sparsecorr_config.distill:  # Trainer saved only the adapter of the PEFT model
            save_policy(output_dir or self.args.output_dir,
                        self.accelerator.unwrap_model(self.model))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.sparsecorr_config.distill:
            load_policy(resume_from_checkpoint, self.accelerator.unwrap_model(self.model))
        for cb in self._callbacks():
            cb.load_checkpoint(resume_from_checkpoint)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        for cb in self._callbacks():
            logs.update(cb.schedule_metrics())
        super().log(logs, *args, **kwargs)

    def _log_sparsecorr(self, metrics: dict[str, torch.Tensor]) -> None:
        if self.sparsecorr_config.log_metrics:
            log_sparsecorr(self, metrics)  # one read back to the host for all of them
