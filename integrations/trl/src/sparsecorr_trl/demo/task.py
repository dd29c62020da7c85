r"""The demo's recall task and model.

The prompt is ``[BOS, key, filler...]`` (``P`` tokens); the correct response recites the
prompt after BOS over and over: response token ``t`` must equal ``prompt[1 + t mod (P-1)]``,
the token ``P-1`` positions back. The reward is the fraction of response tokens that do. Every
answer token depends on a token a full period back, so a KV budget whose recent window is
shorter than the period (StreamingLLM keeps ``sink`` first tokens and the most recent ones)
cannot answer, and the acceptance between that sparse sampler and the dense model collapses
once the context outgrows the budget, while a budget a little above the period is as good as
dense at any length.

Shapes:
    prompts ``[B, P]`` int64; responses and masks ``[B, T]``; rewards ``[B]`` float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

ASSET = Path(__file__).resolve().parent / "assets" / "demo_model"
VOCAB = 64
#: the prompt length and the response length the shipped model was pre-trained on
PROMPT_LEN = 16
RESPONSE_LEN = 32
#: filler tokens from this id on are the "hard" half the shipped model recites less reliably
HARD_FROM = 39
FIRST_KEY = 4
N_KEYS = 10
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def vocabulary() -> list[str]:
    """Token strings by id: 4 specials, keys ``k0``..``k9`` (ids 4-13), filler ``w14``..``w63``."""
    keys = [f"k{i}" for i in range(N_KEYS)]
    filler = [f"w{i}" for i in range(FIRST_KEY + N_KEYS, VOCAB)]
    return [*SPECIALS, *keys, *filler]


def build_tokenizer():
    """The demo's word-level tokenizer (whitespace-separated tokens, no added BOS/EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def demo_tokenizer():
    """The shipped tokenizer (``AutoTokenizer.from_pretrained`` on the asset directory), else
    one built in memory."""
    from transformers import AutoTokenizer

    if (ASSET / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(ASSET)
    return build_tokenizer()


def prompt_text(prompts: torch.Tensor) -> list[str]:
    """Prompt token ids ``[n, P]`` as the text the tokenizer maps back to the same ids."""
    words = vocabulary()
    return [" ".join(words[i] for i in row.tolist()) for row in prompts]


def recall_reward_text(prompts: list[str], completions: list[str], **_) -> list[float]:
    """TRL reward function: `recall_reward` on the prompt and completion texts."""
    out = []
    for prompt, text in zip(prompts, completions):
        source, words = prompt.split()[1:], text.split()
        hits = sum(w == source[t % len(source)] for t, w in enumerate(words))
        out.append(hits / max(1, len(words)))
    return out


def demo_model(seed: int = 0, *, pretrained: bool = True):
    """The tiny Qwen3: the shipped pre-trained weights (``sparsecorr_trl/demo/assets/demo_model``, made by
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


def copy_targets(prompts: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]`` correct responses: ``prompts[:, 1:]`` repeated."""
    source = prompts[:, 1:]
    return source[:, torch.arange(length) % source.shape[1]]


def recall_reward(prompts: torch.Tensor, responses: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """Fraction of response tokens equal to `copy_targets` (the prompt recited)."""
    hit = (responses == copy_targets(prompts, responses.shape[1]).to(responses.device)) & mask
    return hit.sum(1).float() / mask.sum(1).clamp(min=1).float()
