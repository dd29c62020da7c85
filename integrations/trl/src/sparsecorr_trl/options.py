"""Every ``GRPOConfig`` option of TRL 1.16: honoured exactly, or rejected at init.

Three kinds of option (``docs/integrations/trl.md`` prints this table):

- ``PARITY``: read by the loss or the step that ``SparseGRPOTrainer`` replaces, and covered by
  the parity matrix against stock ``trl.GRPOTrainer`` (``tests/integration/trl/test_parity.py``
  sets each one to a non-default value in at least one cell).
- ``TRL``: read only by TRL code that ``SparseGRPOTrainer`` inherits unchanged (model loading,
  data, reward aggregation, TRL's own generation, logging), so it acts as in stock TRL.
- ``RULES``: values rejected at init with a ``ValueError`` naming the option (some options are
  also in ``PARITY``/``TRL`` for their other values).

Fields ``GRPOConfig`` inherits from ``transformers.TrainingArguments`` act through the
``transformers.Trainer`` base, untouched, except those named here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparsecorr_trl.loss import AGGREGATION_BY_LOSS_TYPE, PPO_LOSS_TYPES

SUPPORTED_TRL = ("1.16",)

#: exactly as stock TRL, shown by the parity matrix
PARITY: dict[str, str] = {
    "loss_type": "every accepted type, through sparse_grpo's aggregations",
    "gradient_accumulation_steps": "window token counts of dapo, GA division of the others",
    "steps_per_generation": "window token counts; old log-probs recomputed by TRL",
    "generation_batch_size": "the same window as steps_per_generation",
    "num_iterations": "PPO ratio against TRL's old log-probs",
    "beta": "k3 KL to the reference model",
    "use_bias_correction_kl": "the KL term times the PPO ratio, with its gradient",
    "mask_truncated_completions": "emptied rows count 0 in grpo/dr_grpo/luspo",
    "epsilon": "lower clip",
    "epsilon_high": "upper clip",
    "delta": "two-sided clip = sparse_grpo's dual clip (needs delta > 1 + epsilon_high)",
    "importance_sampling_level": "'token', or 'sequence' (GSPO ratio) with the PPO loss types",
    "router_aux_loss_coef": "MoE load-balancing loss, added as TRL adds it (tiny Qwen3-MoE)",
    "sapo_temperature_pos": "SAPO's gate temperature for positive advantages",
    "sapo_temperature_neg": "SAPO's gate temperature for other advantages",
    "vespo_k_pos": "VESPO's gamma power for non-negative advantages",
    "vespo_lambda_pos": "VESPO's gamma decay for non-negative advantages",
    "vespo_k_neg": "VESPO's gamma power for negative advantages",
    "vespo_lambda_neg": "VESPO's gamma decay for negative advantages",
    "off_policy_mask_threshold": "OPSM: zeroes a sequence's loss, keeps it in the denominator",
    "top_entropy_quantile": "entropy mask: zeroes a token's loss, keeps it in the denominator",
    "entropy_coef": "entropy bonus (mean entropy over the tokens the loss acts on)",
    "use_adaptive_entropy": "TRL's entropy-coefficient controller, its state and checkpoint",
    "entropy_coef_min": "adaptive entropy bound",
    "entropy_coef_max": "adaptive entropy bound",
    "entropy_coef_delta": "adaptive entropy step",
    "entropy_target": "adaptive entropy target",
    "max_completion_length": "generation budget and the dr_grpo length",
    "scale_rewards": "TRL's advantages",
    "multi_objective_aggregation": "TRL's advantages",
    "sync_ref_model": "TRL's reference-model sync callback",
    "ref_model_sync_steps": "TRL's reference-model sync callback",
    "ref_model_mixup_alpha": "TRL's reference-model sync callback",
}

#: read only by TRL code SparseGRPOTrainer does not touch
TRL: dict[str, str] = {
    "model_init_kwargs": "model loading", "trust_remote_code": "model loading",
    "disable_dropout": "model setup", "cast_lm_head_to_fp32": "model setup",
    "learning_rate": "optimizer", "remove_unused_columns": "data",
    "num_generations": "data and advantages", "num_generations_eval": "evaluation",
    "shuffle_dataset": "data", "pad_to_multiple_of": "padding", "reward_weights": "rewards",
    "chat_template_kwargs": "prompt formatting", "max_tool_calling_iterations": "tool loop",
    "temperature": "TRL's generation and the sparse sampler",
    "top_p": "TRL's generation and the sparse sampler",
    "top_k": "TRL's generation and the sparse sampler",
    "min_p": "TRL's generation", "repetition_penalty": "TRL's generation",
    "generation_kwargs": "TRL's generation", "cache_implementation": "TRL's generation",
    "ds3_gather_for_generation": "TRL's generation under DeepSpeed ZeRO-3",
    "fsdp": "FSDP v1 / v2 sharding; the sparse sampler gathers the shards once per rollout",
    "deepspeed": "DeepSpeed; under ZeRO-3 the sparse sampler gathers the parameters once per "
                 "rollout (TRL's gather for its own generation)",
    "use_transformers_continuous_batching": "TRL's generation",
    "transformers_continuous_batching_config": "TRL's generation",
    "use_transformers_paged": "deprecated alias of use_transformers_continuous_batching",
    "use_vllm": "TRL's vLLM generation (not installed here: untested)",
    **{name: "TRL's vLLM generation (untested)" for name in (
        "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
        "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
        "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
        "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size")},
    **{name: "TRL's vLLM importance sampling; switched off when a sparsecorr correction is "
             "set (sparsecorr corrects once; the trl(mode=...) preset is the same rule)"
       for name in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
                    "vllm_importance_sampling_cap")},
    "log_completions": "logging", "log_multimodal": "logging",
    "num_completions_to_print": "logging", "log_unique_prompts": "logging",
    "log_completions_hub_repo": "logging",
}


@dataclass(frozen=True)
class Rule:
    """A rejected value: ``field`` names the option, ``values`` says which, ``why`` the reason.

    ``applies(args, config)`` is True when the rule rejects this configuration; ``example``
    (attributes set on a ``GRPOConfig``) with ``config_example`` (``SparseCorrConfig``
    arguments) triggers it, for the tests.
    """

    field: str
    values: str
    why: str
    applies: Callable[[Any, Any], bool]
    example: dict
    config_example: dict = dataclasses.field(default_factory=dict)


def _sparse(config) -> bool:
    return config is not None and config.policy is not None


_POLICY = {"policy": "streaming_llm", "budget": 4}

RULES: tuple[Rule, ...] = (
    Rule("loss_type", f"anything but {sorted(AGGREGATION_BY_LOSS_TYPE)}",
         "a loss type without a sparse_grpo surrogate (every TRL 1.16 loss type has one)",
         lambda a, c: a.loss_type not in AGGREGATION_BY_LOSS_TYPE, {"loss_type": "reinforce"}),
    Rule("importance_sampling_level", "'sequence' with cispo, sapo or vespo",
         "sparse_grpo's sequence ratio (GSPO) is the clipped PPO surrogate only",
         lambda a, c: a.importance_sampling_level != "token" and a.loss_type not in PPO_LOSS_TYPES,
         {"importance_sampling_level": "sequence", "loss_type": "cispo"}),
    Rule("delta", "<= 1 + epsilon_high with a PPO loss type",
         "TRL's two-sided clip equals the dual clip only above the upper clip",
         lambda a, c: (a.delta is not None and a.loss_type in PPO_LOSS_TYPES
                       and a.delta <= 1 + (a.epsilon_high or a.epsilon)),
         {"delta": 1.1, "epsilon": 0.2}),
    Rule("use_vllm", "True with a sparse policy", "sparsecorr generates the rollouts",
         lambda a, c: _sparse(c) and a.use_vllm, {"use_vllm": True}, _POLICY),
    Rule("use_transformers_continuous_batching", "True with a sparse policy",
         "sparsecorr generates the rollouts",
         lambda a, c: _sparse(c) and a.use_transformers_continuous_batching,
         {"use_transformers_continuous_batching": True}, _POLICY),
    Rule("min_p", "set with a sparse policy", "the sparse sampler has no min-p: its recorded "
         "log-probs would not be those of the sampled distribution",
         lambda a, c: _sparse(c) and a.min_p not in (None, 0.0), {"min_p": 0.1}, _POLICY),
    Rule("repetition_penalty", "!= 1 with a sparse policy", "the sparse sampler has none",
         lambda a, c: _sparse(c) and a.repetition_penalty != 1.0,
         {"repetition_penalty": 1.2}, _POLICY),
    Rule("generation_kwargs", "non-empty with a sparse policy", "the sparse sampler takes only "
         "temperature, top_k, top_p and max_completion_length",
         lambda a, c: _sparse(c) and bool(a.generation_kwargs),
         {"generation_kwargs": {"do_sample": True}}, _POLICY),
    Rule("cache_implementation", "set with a sparse policy", "the sparse sampler owns the cache",
         lambda a, c: _sparse(c) and a.cache_implementation is not None,
         {"cache_implementation": "static"}, _POLICY),
    Rule("ds3_gather_for_generation", "False under DeepSpeed with a sparse policy",
         "the sparse sampler reads the full parameters for the whole rollout (its CUDA graphs and "
         "fused step capture them); without the gather ZeRO-3 would all-gather every layer at "
         "every decode step", lambda a, c: _sparse(c) and bool(a.deepspeed)
         and not a.ds3_gather_for_generation,
         {"deepspeed": "ds_config.json", "ds3_gather_for_generation": False}, _POLICY),
    Rule("fsdp", "set with distill=True", "DistillSparse's adapter step runs its own forward, "
         "backward and optimizer on the unwrapped model, outside FSDP's sharded step",
         lambda a, c: c is not None and c.distill and bool(a.fsdp), {"fsdp": "full_shard"},
         {**_POLICY, "distill": True}),
    Rule("deepspeed", "set with distill=True", "DistillSparse's adapter step runs its own "
         "forward, backward and optimizer on the unwrapped model, outside DeepSpeed's engine",
         lambda a, c: c is not None and c.distill and bool(a.deepspeed),
         {"deepspeed": "ds_config.json"}, {**_POLICY, "distill": True}),
    Rule("beta", "!= 0 with distill=True", "TRL would take the adapter-disabled model, which is "
         "the trained one, as the reference", lambda a, c: c is not None and c.distill and a.beta != 0,
         {"beta": 0.1}, {**_POLICY, "distill": True}),
)


def check_trl_version(version: str | None = None) -> str:
    """Raise ValueError unless the TRL version (default: installed) is a supported release."""
    if version is None:
        import trl

        version = trl.__version__
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_TRL):
        raise ValueError(f"trl version: expected {SUPPORTED_TRL}.x, got {version!r}")
    return version


def validate_grpo_args(args: Any, config: Any = None) -> None:
    """Raise ``ValueError`` naming the option when ``args`` (a ``GRPOConfig``) sets a value that
    ``SparseGRPOTrainer`` cannot honour exactly (``RULES``)."""
    for rule in RULES:
        if rule.applies(args, config):
            raise ValueError(f"{rule.field}: expected not {rule.values} ({rule.why}), got "
                             f"{getattr(args, rule.field, None)!r}")


def classify(name: str) -> str:
    """``"parity"``, ``"trl"``, ``"rules"`` or ``"inherited"`` (a ``TrainingArguments`` field
    not named here); raises ValueError for a field this table does not know."""
    from transformers import TrainingArguments

    if name in PARITY:
        return "parity"
    if name in TRL:
        return "trl"
    if any(r.field == name for r in RULES):
        return "rules"
    if name in {f.name for f in dataclasses.fields(TrainingArguments)}:
        return "inherited"
    raise ValueError(f"name: {name!r} is not a GRPOConfig option sparsecorr_trl knows (TRL "
                     f"{SUPPORTED_TRL}); add it to sparsecorr_trl.options")
