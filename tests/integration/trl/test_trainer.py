"""SparseGRPOTrainer on a tiny Qwen3 with TRL 1.16's real GRPOTrainer machinery (no network)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset
from sparsecorr_trl import (
    SparseCorrCallback,
    SparseCorrConfig,
    SparseGRPOTrainer,
    check_trl_version,
    validate_grpo_args,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig

from sparsecorr.correction import sparse_rl, trl
from sparsecorr.losses import Aggregation, PPOClip, sparse_grpo
from sparsecorr.schedules import BudgetSchedule, TailController
from tests.models import tiny_model

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 =?"


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({c: i + 4 for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def _reward(completions, **kwargs):
    return [float(c.count("a")) for c in completions]


def _trainer(tmp_path, callbacks=None, **overrides):
    torch.manual_seed(0)
    data = Dataset.from_dict({"prompt": ["abc =", "xyz =", "key 12 =", "q ="] * 2})
    cfg = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
               max_completion_length=6, max_steps=2, logging_steps=1, report_to=[],
               use_cpu=True, bf16=False, seed=0, save_strategy="no", learning_rate=1e-3, loss_type="grpo")
    cfg.update(overrides)
    args = GRPOConfig(**cfg)
    model = tiny_model("qwen3", vocab_size=64).train()
    return SparseGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                             processing_class=_tokenizer(), callbacks=callbacks,
                             sparsecorr_config=SparseCorrConfig("sparse_rl"))


def test_version_check():
    assert check_trl_version().startswith("1.16")
    with pytest.raises(ValueError, match="trl version"):
        check_trl_version("1.15.2")


def test_liger_loss_is_rejected():
    class Args:
        use_liger_loss = True
        loss_type = "grpo"

    with pytest.raises(ValueError, match="use_liger_loss"):
        validate_grpo_args(Args())


def test_unsupported_loss_type_rejected(tmp_path):
    with pytest.raises(ValueError, match="loss_type"):
        _trainer(tmp_path, loss_type="cispo")


def test_trl_preset_matches_trl_default():
    args = GRPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False)
    ours = trl(mode=args.vllm_importance_sampling_mode,
               clip_min=args.vllm_importance_sampling_clip_min,
               clip_max=args.vllm_importance_sampling_clip_max)
    assert ours == trl()


def test_training_logs_metrics_and_loss_matches_hand(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    assert any(k.startswith("sparsecorr/") for k in logged), logged
    # loss path with sparse rollout log-probs equals sparse_grpo recomputed by hand
    g = torch.Generator().manual_seed(0)
    b, t = 4, 5
    prompt = torch.randint(4, 40, (b, 3), generator=g)
    comp = torch.randint(4, 40, (b, t), generator=g)
    cmask = torch.ones(b, t, dtype=torch.long)
    cmask[0, 3:] = 0
    trainer.model.eval()
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt, comp], 1),
            torch.cat([torch.ones_like(prompt), cmask], 1), t)
    old = logp + 0.05 * torch.randn(b, t, generator=g)
    roll = logp + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    inputs = dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=comp,
                  completion_mask=cmask, advantages=adv, old_per_token_logps=old,
                  sampling_per_token_logps=roll)
    with torch.no_grad():
        got = trainer._compute_loss(trainer.model, inputs)
    want = sparse_grpo(logp, old, adv, cmask.bool(), rollout_logp=roll, correction=sparse_rl(),
                       surrogate=PPOClip(clip_low=0.2, clip_high=0.2),
                       aggregation=Aggregation("seq-mean-token-mean", norm_length=6.0)).loss
    torch.testing.assert_close(got, want)
    assert trainer.vllm_importance_sampling_correction is False


def _controller(budgets):
    return TailController(BudgetSchedule(bin_size=4, budgets=budgets), [2, 4, 8], min_tokens=1)


def test_callback_logs_schedule_and_checkpoint_resume_restores_it(tmp_path):
    cb = SparseCorrCallback(_controller((2, 4, None)))
    trainer = _trainer(tmp_path, callbacks=[cb], save_strategy="steps", save_steps=2)
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    assert "sparsecorr/schedule/bin_0" in logged
    saved = cb.schedule
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "sparsecorr_controller.json").is_file()
    cb.controller = _controller((8, 8, 8))
    assert cb.schedule != saved
    trainer._load_from_checkpoint(str(ckpt))
    assert cb.schedule == saved


def test_callback_observes_rollout_acceptance(tmp_path):
    cb = SparseCorrCallback(_controller((2, 4, None)))
    trainer = _trainer(tmp_path, callbacks=[cb])
    seen = []
    cb.observe = lambda acc, mask, offset=None: seen.append((acc, mask))
    b, t = 2, 4
    comp = torch.randint(4, 40, (b, t))
    roll = torch.full((b, t), -3.0)
    roll[0, 0] = float("-inf")
    inputs = dict(prompt_ids=torch.randint(4, 40, (b, 3)), prompt_mask=torch.ones(b, 3),
                  completion_ids=comp, completion_mask=torch.ones(b, t, dtype=torch.long),
                  advantages=torch.tensor([1.0, -1.0]), sampling_per_token_logps=roll)
    with torch.no_grad():
        trainer._compute_loss(trainer.model, inputs)
    (acc, mask), = seen
    assert acc.shape == (b, t) and bool((acc <= 1).all()) and bool((acc >= 0).all())
    assert not bool(mask[0, 0]) and int(mask.sum()) == b * t - 1


def test_callback_rejects_non_controller():
    with pytest.raises(ValueError, match="controller"):
        SparseCorrCallback(object())
