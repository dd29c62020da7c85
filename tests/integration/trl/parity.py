"""Parity harness: run stock ``trl.GRPOTrainer`` and ``SparseGRPOTrainer`` on the same tiny Qwen3,
seed, data and config, and compare what they log and what they train.

Everything is built in-process (nothing is downloaded). The model is ``tests.models.tiny_model``
with the end-of-sequence row of the LM head shifted towards the mean hidden state, so that about
one completion in two ends with EOS inside a 6-token budget (``mask_truncated_completions`` then
empties some rows and keeps others) and completion lengths vary (the window token counts of
``dapo`` matter).
"""

from __future__ import annotations

import math
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from trl import GRPOConfig, GRPOTrainer

from tests.models import tiny_model

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 =?"
EOS_ID = 2

#: logged keys that measure time, not training
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")

#: defaults of every parity run (tests override single fields)
BASE = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
            max_steps=3, logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=0,
            save_strategy="no", learning_rate=0.3, optim="sgd", disable_tqdm=True,
            temperature=1.0)


def tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over ``CHARS`` (ids 4..), with pad 0, bos 1, eos 2, unk 3."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({c: i + 4 for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


_SAVED: dict[tuple, Path] = {}


def _tiny_moe(seed: int) -> torch.nn.Module:
    """A tiny Qwen3-MoE (4 experts, 2 per token) with a load-balancing loss coefficient."""
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, router_aux_loss_coef=0.05,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).eval()


def model(*, eos_shift: float = 2.0, seed: int = 0, moe: bool = False) -> torch.nn.Module:
    """The tiny Qwen3 (vocab 64; a Qwen3-MoE with ``moe=True``) with a likelier EOS, in train
    mode.

    It is saved once per process (safetensors) and loaded from there, so that its
    ``config._name_or_path`` points at the initial weights: that is where TRL loads its
    reference model from when ``beta != 0``.
    """
    key = (eos_shift, seed, moe)
    cls = Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM
    if key not in _SAVED:
        m = _tiny_moe(seed) if moe else tiny_model("qwen3", vocab_size=64, seed=seed)
        ids = torch.randint(4, 4 + len(CHARS), (32, 8), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            h = m.model(ids).last_hidden_state.reshape(-1, m.config.hidden_size).mean(0)
            m.lm_head.weight[EOS_ID] += eos_shift * h / h.norm() ** 2
        path = Path(tempfile.mkdtemp(prefix="sparsecorr-parity-"))
        # written by hand: save_pretrained writes nothing on non-main processes
        m.config.architectures = [type(m).__name__]
        m.config.to_json_file(path / "config.json")
        save_file({k: v.contiguous() for k, v in m.state_dict().items()},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
        _SAVED[key] = path
    m = cls.from_pretrained(_SAVED[key], attn_implementation="eager")
    return m.train()


def reward(completions, **kwargs):
    """Distinct characters per completion: varies inside a group, so advantages are non-zero."""
    return [float(len(set(c))) for c in completions]


def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": ["abc =", "xyz =", "key 12 =", "q =", "7 8 9 =",
                                         "hello =", "zz =", "m n ="] * 4})


@dataclass(frozen=True)
class Run:
    """What one training run left: its log rows (one per step, the summary row dropped), its
    final parameters and the trainer."""

    rows: list[dict]
    params: dict[str, torch.Tensor]
    trainer: object


def run(cls=GRPOTrainer, out: str = "/tmp/parity", *, sparsecorr_config=None, model_kwargs=None,
        trainer_kwargs=None, resume_from_checkpoint=None, **overrides) -> Run:
    """Train ``cls`` for ``BASE['max_steps']`` (or the override) steps and return what it logged."""
    cfg = {**BASE, "output_dir": str(out), **overrides}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and not slowed by neighbours
    torch.manual_seed(0)
    try:
        return _train(cls, cfg, sparsecorr_config, model_kwargs, trainer_kwargs,
                      resume_from_checkpoint)
    finally:
        torch.set_num_threads(threads)


def _train(cls, cfg, sparsecorr_config, model_kwargs, trainer_kwargs, resume) -> Run:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = GRPOConfig(**cfg)
        kwargs = dict(model=model(**(model_kwargs or {})), reward_funcs=reward, args=args,
                      train_dataset=dataset(), processing_class=tokenizer())
        kwargs.update(trainer_kwargs or {})
        if sparsecorr_config is not None:
            kwargs["sparsecorr_config"] = sparsecorr_config
        trainer = cls(**kwargs)
        trainer.train(resume_from_checkpoint=resume)
    rows = [r for r in trainer.state.log_history if "train_runtime" not in r]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return Run(rows=rows, params=params, trainer=trainer)


def _close(a, b, *, rtol: float, atol: float) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + rtol * abs(b)


def assert_parity(ref: Run, got: Run, *, rtol: float = 1e-4, atol: float = 1e-6,
                  param_atol: float = 1e-6) -> None:
    """Every key stock TRL logged is logged by ours with an equal value (step by step: loss,
    grad norm, TRL's metrics), and the final parameters are equal within float noise (the runs
    use plain SGD: Adam would turn a rounding difference in a near-zero gradient component into
    a visible step)."""
    assert len(ref.rows) == len(got.rows), (len(ref.rows), len(got.rows))
    for step, (r, g) in enumerate(zip(ref.rows, got.rows, strict=True), start=1):
        missing = sorted(set(r) - set(g))
        assert not missing, f"step {step}: keys TRL logs are missing: {missing}"
        bad = {k: (v, g[k]) for k, v in r.items()
               if k not in TIMING_KEYS and not _close(g[k], v, rtol=rtol, atol=atol)}
        assert not bad, f"step {step}: (TRL, ours) differ: {bad}"
    assert set(ref.params) == set(got.params)
    worst = max(float((ref.params[n] - got.params[n]).abs().max()) for n in ref.params)
    assert worst <= param_atol, f"final parameters differ by up to {worst:.3g}"
