"""SparseGRPOTrainer's sparse rollouts on a hybrid family (issue #52): a tiny GPT-OSS (sliding-window
layers beside full ones, learned sinks; window 8 < prompt + completion, so the ring wraps) trains
with the sparse sampler, whose recorded log-probs teacher forcing reproduces."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset
from sparsecorr_trl import SparseCorrConfig, SparseGRPOTrainer
from trl import GRPOConfig

from sparsecorr.decoding import StreamingLLM, teacher_forced_logprobs
from tests.integration.trl.test_trainer import _tokenizer
from tests.unit.decoding.families import build, family

GPT_OSS = family("gpt-oss")


def _reward(completions, **kwargs):
    """Distinct characters per completion: varies within a group, so advantages are non-zero."""
    return [float(len(set(c))) for c in completions]


def _model():
    return build(GPT_OSS, vocab_size=64)


def test_gpt_oss_sparse_rollouts_train_and_replay(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=2, logging_steps=1, report_to=[], use_cpu=True,
                      bf16=False, seed=0, save_strategy="no", learning_rate=1e-3, loss_type="grpo")
    cfg = SparseCorrConfig("sparse_rl", policy="streaming_llm", policy_kwargs={"sink": 1}, budget=4)
    torch.manual_seed(0)
    data = Dataset.from_dict({"prompt": ["abc =", "xyz =", "key 12 =", "q ="] * 2})
    trainer = SparseGRPOTrainer(model=_model().train(), reward_funcs=_reward, args=args, train_dataset=data,
                                processing_class=_tokenizer(), sparsecorr_config=cfg)
    seen = []
    inner = trainer._compute_loss

    def wrapped(model, inputs):
        seen.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return inner(model, inputs)

    trainer._compute_loss = wrapped
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n.endswith("sinks")}
    trainer.train()
    assert before and any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)
    batch = seen[0]
    mask = batch["completion_mask"].bool()
    roll = batch["sampling_per_token_logps"]
    assert mask.any() and bool(torch.isfinite(roll[mask]).all()) and bool((roll[mask] <= 0).all())
    # prompt + completion passes the window: the sliding layers' ring wrapped during these rollouts
    assert int(batch["prompt_mask"].sum(1).max() + mask.sum(1).max()) > GPT_OSS.kwargs["sliding_window"]
    # the first batch was sampled before any optimizer step: the initial weights reproduce it
    again = teacher_forced_logprobs(_model(), batch["prompt_ids"], batch["completion_ids"],
                                    policy=StreamingLLM(sink=1), budget=4, attention_mask=batch["prompt_mask"],
                                    response_mask=mask, temperature=trainer.temperature)
    torch.testing.assert_close(again.rollout_logp[mask], roll[mask], atol=1e-4, rtol=0)
