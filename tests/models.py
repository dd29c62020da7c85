"""Tiny Hugging Face causal LMs built in-process from configs (nothing is downloaded).

Used by the decoding, schedules, pruning and integration tests. Weights are seeded so every
test sees the same model.
"""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

__all__ = ["ARCHS", "tiny_model", "trainer_prepared"]

ARCHS = ("qwen3", "qwen2", "llama")


def tiny_model(
    arch: str = "qwen3",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
) -> PreTrainedModel:
    """A randomly initialised ``arch`` model ("qwen3", "qwen2" or "llama") in eval mode."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen3":
        config, cls = Qwen3Config(head_dim=head_dim, **common), Qwen3ForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(head_dim=head_dim, **common), LlamaForCausalLM
    else:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    model.eval()
    return model


def trainer_prepared(model: PreTrainedModel, *, train: bool = False) -> PreTrainedModel:
    """``model`` prepared as a trainer prepares the model it trains (TRL's ``GRPOTrainer`` with
    its default ``gradient_checkpointing=True``, through transformers' ``Trainer``): gradient
    checkpointing on (non-reentrant), the input-require-grads forward hook on the input
    embeddings, then eval mode (or train mode with ``train=True``). A peft model gets the same
    calls (peft forwards them to its base model). Returns ``model``."""
    import warnings

    with warnings.catch_warnings():  # transformers 5.24 renames gradient_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model.train() if train else model.eval()
