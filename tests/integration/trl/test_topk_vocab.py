"""SparseGRPOTrainer with the default ``acceptance_topk`` (20) on a model of 16 tokens (issue 30):
the sampler's top-k is clamped to the vocabulary, so the first generation no longer crashes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset
from sparsecorr_trl import SparseCorrConfig, SparseGRPOTrainer
from trl import GRPOConfig

from tests.integration.trl import parity
from tests.models import tiny_model

V = 16  # ids 0..15: pad, bos, eos, unk and the characters "a".."l" of the parity tokenizer


def test_default_acceptance_topk_on_a_vocabulary_below_20(tmp_path):
    cfg = SparseCorrConfig("sparse_rl", policy="streaming_llm", policy_kwargs={"sink": 1},
                           budget=4, acceptance=True)
    assert cfg.acceptance_topk == 20 > V
    torch.manual_seed(0)
    data = Dataset.from_dict({"prompt": ["abc", "fed", "kij", "gl"] * 2})
    args = GRPOConfig(**dict(parity.BASE, output_dir=str(tmp_path), max_steps=1, loss_type="grpo",
                             learning_rate=1e-3, optim="adamw_torch", max_completion_length=4))
    trainer = SparseGRPOTrainer(model=tiny_model("qwen3", vocab_size=V).train(),
                                reward_funcs=parity.reward, args=args, train_dataset=data,
                                processing_class=parity.tokenizer(), sparsecorr_config=cfg)
    seen = []
    real = trainer._generate_single_turn

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(trainer._sparsecorr_topk)
        return out

    trainer._generate_single_turn = spy
    trainer.train()
    assert seen and seen[0] is not None
    topk_logp, topk_ids = seen[0]
    assert topk_logp.shape[-1] == topk_ids.shape[-1] == V  # clamped: the whole distribution
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in trainer.state.log_history if "loss" in row)
