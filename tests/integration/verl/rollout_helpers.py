"""Shared pieces of the ``rollout.name=sparsecorr`` tests: the tiny model saved where verl's
``HFModelConfig`` reads it, verl's real rollout / model configs, an in-process server, and the
direct ``sparsecorr.decoding.generate`` call a served request must equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.verl.real_verl import load_verl
from tests.models import tiny_model

#: a sparse policy small enough that the tiny model's prompts get compressed
ENGINE = {"policy": "rkv", "policy_kwargs": {"window": 3, "buffer": 2}, "budget": 6, "backend": "torch"}
PROMPTS = ([5, 9, 14, 3, 7, 11, 20, 6, 8], [12, 4, 33, 17])


def need_verl_and_ray():
    """Skip without Ray (``make test-lowest`` installs it beside verl 0.9.1) or verl."""
    pytest.importorskip("ray", reason="Ray (verl's requirement): make test-lowest installs it")
    load_verl()


def save_tiny(path: Path, *, max_position_embeddings: int = 64) -> Path:
    """The tiny Qwen3 (float32, EOS id 2) as a Hugging Face checkpoint directory."""
    model = tiny_model("qwen3", max_position_embeddings=max_position_embeddings)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return path


def rollout_config(*, engine: dict | None = None, **fields):
    """verl's real ``RolloutConfig`` for ``name=sparsecorr`` (one GPU per replica)."""
    from verl.workers.config import RolloutConfig

    base = dict(name="sparsecorr", tensor_model_parallel_size=1, prompt_length=16, response_length=6,
                max_num_seqs=8, seed=0, engine_kwargs={"sparsecorr": dict(ENGINE if engine is None else engine)})
    base.update(fields)
    return RolloutConfig(**base)


def model_config(path: Path):
    """verl's real ``HFModelConfig`` of the saved tiny model (no tokenizer needed)."""
    from verl.workers.config import HFModelConfig

    return HFModelConfig(path=str(path), load_tokenizer=False)


def make_server(ckpt: Path, *, engine: dict | None = None, **fields):
    """An in-process ``SparseCorrServer`` over the saved checkpoint (hybrid mode)."""
    from sparsecorr_verl.rollout import SparseCorrServer
    from verl.workers.rollout.replica import RolloutMode

    return SparseCorrServer(config=rollout_config(engine=engine, **fields), model_config=model_config(ckpt),
                            rollout_mode=RolloutMode.HYBRID)


def policy_copy(ckpt: Path):
    """The checkpoint loaded as the server loads it (CPU)."""
    from sparsecorr_verl.rollout import load_policy_copy

    return load_policy_copy(str(ckpt), device=torch.device("cpu"))


def direct(model, prompts, *, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
           top_k: int | None = None, top_p: float | None = None, engine: dict | None = None):
    """One ``generate`` call on ``prompts`` (right-padded): per row the tokens and log-probs up
    to its length."""
    from sparsecorr.decoding import generate, get_policy

    engine = dict(ENGINE if engine is None else engine)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
        mask[i, :len(p)] = 1
    out = generate(model, ids, mask, policy=get_policy(engine["policy"], **engine.get("policy_kwargs", {})),
                   budget=engine.get("budget"), backend=engine.get("backend", "auto"),
                   max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   logprobs_topk=0, eos_token_id=2,
                   generator=None if seed is None else torch.Generator().manual_seed(seed))
    n = out.lengths.tolist()
    return [(out.tokens[i, :n[i]].tolist(), out.rollout_logp[i, :n[i]].tolist()) for i in range(len(prompts))]
