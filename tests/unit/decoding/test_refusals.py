"""Issue 52: the attention the engine does not serve is refused by ``model_spec`` with a
``ValueError`` naming the feature and the family, before any forward (the model is never run:
its forward raises if called), on tiny configs transformers builds in-process."""

from __future__ import annotations

import pytest
import torch
import transformers

from sparsecorr.decoding import Dense, generate, teacher_forced_logprobs
from sparsecorr.decoding.hf import model_spec

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def _mla(cls):
    return cls(**BASE, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
               n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=16)


def _cases():
    t = transformers
    yield "deepseek_v2", lambda: _mla(t.DeepseekV2Config), r"multi-head latent attention \(kv_lora_rank\)"
    yield "deepseek_v3", lambda: _mla(t.DeepseekV3Config), r"multi-head latent attention \(kv_lora_rank\)"
    yield "qwen3_next", lambda: t.Qwen3NextConfig(
        **BASE, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"]), "linear-attention / state-space layers"
    yield "mllama", lambda: t.MllamaTextConfig(**BASE, cross_attention_layers=[1], pad_token_id=0), "cross-attention"
    yield "falcon_mamba", lambda: t.FalconMambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                      state_size=4), "linear-attention / state-space layers"


def _build(make):
    cfg = make()
    if isinstance(cfg, transformers.MllamaTextConfig):
        model = transformers.MllamaForCausalLM(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)

    def no_forward(*a, **k):
        raise AssertionError("the model ran a forward")

    model.forward = no_forward
    return model.eval()


@pytest.mark.parametrize("family,make,feature", list(_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_refused_with_the_feature_and_the_family_before_any_forward(family, make, feature):
    model = _build(make)
    with pytest.raises(ValueError, match=rf"model: {feature} is not supported .*{family}"):
        model_spec(model)
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"model: {feature} is not supported"):
        generate(model, ids, max_new_tokens=2, policy=Dense(), budget=None)
    with pytest.raises(ValueError, match=rf"model: {feature} is not supported"):
        teacher_forced_logprobs(model, ids, ids, policy=Dense(), budget=None)
