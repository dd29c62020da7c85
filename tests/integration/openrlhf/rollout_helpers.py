"""Test-only helpers of the sparse rollout actor's tests: a tiny Qwen3 checkpoint with a
word-level tokenizer, a stand-in for vLLM's ``SamplingParams`` (vLLM does not install on the
CPU; OpenRLHF's executors only read and set its attributes and deep-copy it), and a direct
``generate`` to compare with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.models import tiny_model

ENGINE = {"policy": "streaming_llm", "policy_kwargs": {"sink": 2}, "budget": 8, "backend": "torch"}


def word_tokenizer():
    """Words ``w3`` .. ``w127`` over the tiny model's 128 ids (EOS ``<eos>`` = 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, 128)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def save_tiny(path: Path, *, max_position_embeddings: int = 128, seed: int = 0) -> Path:
    """The tiny Qwen3 (float32, EOS id 2) and its tokenizer as a checkpoint directory."""
    model = tiny_model("qwen3", max_position_embeddings=max_position_embeddings, seed=seed)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@dataclass
class SamplingParams:
    """vLLM's ``SamplingParams`` fields OpenRLHF sets or reads, with vLLM's defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    n: int = 1
    stop: list[str] = field(default_factory=list)


def openrlhf_params(**kw) -> SamplingParams:
    """What OpenRLHF's samples generator builds (``_dispatch_prompts_to_vllm``) with a rollout
    correction on: ``top_k=-1``, ``min_tokens=1``, ``skip_special_tokens=False``, ``logprobs=1``."""
    return SamplingParams(**{"top_k": -1, "min_tokens": 1, "skip_special_tokens": False, "logprobs": 1, **kw})


def direct(model, prompt, *, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
           engine: dict | None = None, eos: tuple[int, ...] = (2,)):
    """One ``generate`` call on one prompt (stopping at ``eos``): its tokens and log-probs."""
    from sparsecorr.decoding import generate
    from sparsecorr.sampler import SamplerSpec

    spec = SamplerSpec(**(ENGINE if engine is None else engine))
    out = generate(model, torch.tensor([prompt]), **spec.generate_kwargs("cpu"), max_new_tokens=max_new_tokens,
                   temperature=temperature, logprobs_topk=0, eos_token_id=list(eos),
                   generator=None if seed is None else torch.Generator().manual_seed(seed))
    n = int(out.lengths[0])
    return out.tokens[0, :n].tolist(), out.rollout_logp[0, :n].tolist()


def need_openrlhf_executors():
    """Skip unless OpenRLHF's executors import (``openrlhf.utils.agent`` needs ``aiohttp``, and
    ``openrlhf.utils`` ``pylatexenc``: ``make test-lowest`` installs both)."""
    for name in ("aiohttp", "pylatexenc"):
        pytest.importorskip(name, reason=f"{name} (OpenRLHF's executors import it): make test-lowest installs it")
    pytest.importorskip("openrlhf.utils.agent", reason="OpenRLHF 0.11.2's executors")


def need_ray():
    pytest.importorskip("ray", reason="Ray (OpenRLHF's requirement): make test-lowest installs it")
