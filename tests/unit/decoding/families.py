"""The decoder families the engine is tried on: one table of tiny random configs (nothing is
downloaded), built in-process from the installed transformers.

Every family gets the same small shape (`COMMON`: 2 layers, hidden 64, 4 query / 2 KV heads of
dim 16, vocab 128) plus what makes it itself: experts for the MoE families, the attention
variants of Gemma 2 (soft-capping, sliding layers), Gemma 3 / GPT-OSS / EXAONE 4 (sliding and full
layers interleaved, learned sinks for GPT-OSS), a sliding window on Mistral and Qwen2. Hybrid
families get 4 layers and a window of `WINDOW` = 8 slots, smaller than prompt + decode in the
tests, so the ring wraps. ``refused`` names the feature the engine must refuse before any
forward (MLA, linear-attention layers, cross-attention).

A family whose config or model class the installed transformers lacks is skipped, naming the
class (CI also runs these tests on transformers 5.9.0 and 5.19.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

__all__ = ["DROP", "FAMILIES", "HYBRID", "REFUSED", "SERVED", "WINDOW", "Family", "build", "family"]

WINDOW = 8
DROP = object()  # a `Family.kwargs` value that leaves a `COMMON` field out (the family's default)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_ALT = ["sliding_attention", "full_attention"] * 2  # 4 layers: sliding, full, sliding, full


@dataclass(frozen=True)
class Family:
    """One row of the table.

    Args:
        name: the test id.
        config / model: transformers class names (config, causal LM).
        kwargs: config fields on top of `COMMON` (`DROP` leaves a `COMMON` field to the family).
        sliding: the layers that attend over a window of `WINDOW` (as the model's own attention).
        softcap / sinks: the attention variants the family has (Gemma 2 / GPT-OSS).
        refused: the feature the engine's ``ValueError`` must name (None: served).
    """

    name: str
    config: str
    model: str
    kwargs: dict = field(default_factory=dict)
    sliding: tuple[int, ...] = ()
    softcap: float | None = None
    sinks: bool = False
    refused: str | None = None

    @property
    def hybrid(self) -> bool:
        return bool(self.sliding)


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaConfig", "LlamaForCausalLM"),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    Family("qwen2-window", "Qwen2Config", "Qwen2ForCausalLM",
           dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
           sliding=(2, 3)),  # Qwen2: layers from max_window_layers on slide
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    Family("qwen3-moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, **_MOE)),
    Family("mistral", "MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    Family("mistral-window", "MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW),
           sliding=(0, 1)),  # every layer slides
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM",
           dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", dict(head_dim=DROP, sliding_window=None)),
    Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", dict(head_dim=DROP)),
    Family("granite", "GraniteConfig", "GraniteForCausalLM", dict(head_dim=DROP)),
    Family("glm4", "Glm4Config", "Glm4ForCausalLM"),
    Family("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", dict(use_sliding_window=False)),
    Family("gemma", "GemmaConfig", "GemmaForCausalLM"),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
           dict(num_hidden_layers=4, sliding_window=WINDOW, layer_types=_ALT, attn_logit_softcapping=2.0,
                final_logit_softcapping=None, query_pre_attn_scalar=16),
           sliding=(0, 2), softcap=2.0),
    Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
           dict(num_hidden_layers=4, sliding_window=WINDOW, layer_types=_ALT, query_pre_attn_scalar=16),
           sliding=(0, 2)),
    Family("gpt-oss", "GptOssConfig", "GptOssForCausalLM",
           dict(num_hidden_layers=4, sliding_window=WINDOW, layer_types=_ALT, num_local_experts=4,
                num_experts_per_tok=2), sliding=(0, 2), sinks=True),
    Family("exaone4", "Exaone4Config", "Exaone4ForCausalLM",
           dict(num_hidden_layers=4, sliding_window=WINDOW, layer_types=_ALT), sliding=(0, 2)),
    Family("seed-oss", "SeedOssConfig", "SeedOssForCausalLM"),
    Family("hunyuan-dense", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM"),
    # refused: no per-head softmax over a K/V cache of one shape
    Family("deepseek-v2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
           dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                first_k_dense_replace=1, head_dim=DROP), refused="latent attention"),
    Family("deepseek-v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
           dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=DROP), refused="latent attention"),
    Family("qwen3-next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
           dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, **_MOE), refused="linear-attention"),
    Family("mllama", "MllamaTextConfig", "MllamaForCausalLM",
           dict(num_hidden_layers=4, cross_attention_layers=[1], head_dim=DROP), refused="cross-attention"),
)
SERVED = tuple(f for f in FAMILIES if f.refused is None)
HYBRID = tuple(f for f in SERVED if f.hybrid)
REFUSED = tuple(f for f in FAMILIES if f.refused is not None)


def family(name: str) -> Family:
    """The table's row called ``name``."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"name: expected one of {[f.name for f in FAMILIES]}, got {name!r}")


def build(family: Family, *, seed: int = 0, dtype: torch.dtype = torch.float32,
          attn_implementation: str = "eager", **overrides):
    """``family``'s tiny random model in eval mode (seeded), or a skip naming the missing class;
    ``overrides``: config fields over the table's (e.g. ``vocab_size`` for a test tokenizer)."""
    import transformers

    cfg_cls, model_cls = getattr(transformers, family.config, None), getattr(transformers, family.model, None)
    if cfg_cls is None or model_cls is None:
        missing = family.config if cfg_cls is None else family.model
        pytest.skip(f"{family.name}: transformers {transformers.__version__} has no {missing}")
    kw = {**COMMON, **family.kwargs, **overrides}
    config = cfg_cls(**{k: v for k, v in kw.items() if v is not DROP})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return model_cls(config).to(dtype).eval()
