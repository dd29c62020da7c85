r"""The demo's recall task and model.

The prompt is ``[BOS, key, filler...]``; the reward of a response is the fraction of its
tokens equal to ``key``, so the answer depends on the first prompt tokens, far back once the
generation is long: a small KV budget that evicts them (StreamingLLM keeps ``sink`` first
tokens and a recent window) changes the sampler's distribution and the acceptance decays with
context length.

Shapes:
    prompts ``[B, P]`` int64; responses and masks ``[B, T]``; rewards ``[B]`` float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

ASSET = Path(__file__).resolve().parent.parent / "assets" / "demo_model"
VOCAB = 64
FIRST_KEY = 4


def demo_model(seed: int = 0, *, pretrained: bool = True):
    """The tiny Qwen3: the shipped pre-trained weights (``sparsecorr/assets/demo_model``, made by
    ``scripts/make_demo_model.py``) when present and ``pretrained``, else a seeded random init."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if pretrained and (ASSET / "model.safetensors").is_file():
        return Qwen3ForCausalLM.from_pretrained(ASSET, attn_implementation="eager")
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "eager"
    return Qwen3ForCausalLM(cfg)


def make_prompts(n: int, length: int, *, seed: int) -> torch.Tensor:
    """``[n, length]`` prompts: BOS, a key in ``[4, 14)``, then random filler tokens."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(FIRST_KEY, FIRST_KEY + 10, (n, 1), generator=g)
    filler = torch.randint(FIRST_KEY + 10, VOCAB, (n, length - 2), generator=g)
    return torch.cat([torch.ones(n, 1, dtype=torch.long), keys, filler], 1)


def recall_reward(prompts: torch.Tensor, responses: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """Fraction of response tokens equal to the prompt's key (``prompts[:, 1]``)."""
    hit = (responses == prompts[:, 1:2]) & mask
    return hit.sum(1).float() / mask.sum(1).clamp(min=1).float()
