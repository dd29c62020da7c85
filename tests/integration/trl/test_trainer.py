"""SparseGRPOTrainer's configuration surface: TRL versions, every GRPOConfig option (honoured or
rejected), ``SparseCorrConfig(correction=...)``, the loss against ``sparse_grpo`` by hand, and
the controller callback (tiny Qwen3, TRL 1.16's real GRPOTrainer machinery, no network)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("trl")
from sparsecorr_trl import (
    SparseCorrCallback,
    SparseCorrConfig,
    SparseGRPOTrainer,
    check_trl_version,
    validate_grpo_args,
)
from sparsecorr_trl.options import PARITY, RULES, TRL, classify
from trl import GRPOConfig

from sparsecorr.correction import Correction, chain, sparse_rl, tis, trl, veto
from sparsecorr.losses import Aggregation, PPOClip, sparse_grpo
from sparsecorr.mismatch import measure
from sparsecorr.schedules import BudgetSchedule, TailController
from tests.integration.trl import parity


def _tokenizer():
    return parity.tokenizer()


def _trainer(tmp_path, callbacks=None, config=None, **overrides):
    torch.manual_seed(0)
    cfg = dict(parity.BASE, output_dir=str(tmp_path), max_steps=2, loss_type="grpo",
               learning_rate=1e-3, optim="adamw_torch")
    cfg.update(overrides)
    return SparseGRPOTrainer(model=parity.model(), reward_funcs=parity.reward,
                             args=GRPOConfig(**cfg), train_dataset=parity.dataset(),
                             processing_class=_tokenizer(), callbacks=callbacks,
                             sparsecorr_config=config or SparseCorrConfig("sparse_rl"))


def test_version_check():
    assert check_trl_version().startswith("1.16")
    with pytest.raises(ValueError, match="trl version"):
        check_trl_version("1.15.2")


def test_every_grpo_config_field_is_honoured_or_rejected():
    """A GRPOConfig field of a new TRL release fails here until it is put in the table."""
    own = {f.name for f in dataclasses.fields(GRPOConfig)}
    kinds = {name: classify(name) for name in own}
    from transformers import TrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    grpo_only = own - inherited
    assert grpo_only <= set(PARITY) | set(TRL) | {r.field for r in RULES}, \
        sorted(grpo_only - set(PARITY) - set(TRL))
    assert set(PARITY) <= own and set(TRL) <= own and {r.field for r in RULES} <= own
    assert not set(PARITY) & set(TRL)
    assert kinds["loss_type"] == "parity" and kinds["use_vllm"] == "trl"
    with pytest.raises(ValueError, match=r"sparsecorr_trl\.options"):
        classify("a_field_from_the_future")


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.field)
def test_each_rejected_value_raises_naming_the_option(rule):
    args = GRPOConfig(**{**parity.BASE, "output_dir": "/tmp/unused"})
    config = SparseCorrConfig(**rule.config_example) if rule.config_example else None
    validate_grpo_args(args, config)  # the base config is accepted
    for name, value in rule.example.items():
        setattr(args, name, value)
    with pytest.raises(ValueError, match=rule.field):
        validate_grpo_args(args, config)


@pytest.mark.parametrize("overrides, match", [
    (dict(delta=1.1), "delta"),
])
def test_trainer_init_rejects(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, **overrides)


def test_trl_preset_matches_trl_default():
    args = GRPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False)
    ours = trl(mode=args.vllm_importance_sampling_mode,
               clip_min=args.vllm_importance_sampling_clip_min,
               clip_max=args.vllm_importance_sampling_clip_max)
    assert ours == trl()


class _Halve:
    """A user's own correction: every token weighted 1/2."""

    def __call__(self, mm):
        return Correction(mask=mm.valid, token_weights=mm.valid.float() / 2, source=mm)


@pytest.mark.parametrize("correction, kwargs, expect", [
    ("sparse_rl", {}, "sparse_rl"),
    ("tis", {"cap": 3.0}, tis(cap=3.0)),
    (tis(cap=1.5), {}, tis(cap=1.5)),
    (chain(tis(cap=2.0), veto(1e-4)), {}, chain(tis(cap=2.0), veto(1e-4))),
    (None, {}, None),
    ("none", {}, None),
])
def test_correction_accepts_names_numbers_and_objects(correction, kwargs, expect):
    built = SparseCorrConfig(correction=correction, correction_kwargs=kwargs).build()
    if expect == "sparse_rl":
        assert built == sparse_rl()
    else:
        assert built == expect
    own = _Halve()
    assert SparseCorrConfig(correction=own).build() is own


@pytest.mark.parametrize("correction, kwargs, match", [
    ("nope", {}, "nope"),
    (3.0, {}, "correction"),
    (tis(), {"cap": 2.0}, "correction_kwargs"),
    (None, {"cap": 2.0}, "correction_kwargs"),
    (Correction(mask=torch.ones(1, 2, dtype=torch.bool)), {}, "Correction record"),
])
def test_correction_rejects_what_it_cannot_use(correction, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseCorrConfig(correction=correction, correction_kwargs=kwargs)


def test_training_logs_metrics_and_loss_matches_hand(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    assert any(k.startswith("sparsecorr/") for k in logged), logged
    assert {"entropy", "clip_ratio/low_mean", "clip_ratio/high_max"} <= logged
    # a micro-batch as the generate-and-score step leaves it (the correction computed there,
    # its mask and weights carried with the batch): the loss is sparse_grpo's by hand
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
    mm = measure(old, roll, cmask.bool())
    corr = sparse_rl()(mm)
    inputs = dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=comp,
                  completion_mask=cmask, advantages=adv, old_per_token_logps=old,
                  sampling_per_token_logps=roll, sparsecorr_old_logp=old,
                  sparsecorr_mask=corr.mask, sparsecorr_weights=corr.weights)
    with torch.no_grad():
        got = trainer._compute_loss(trainer.model, inputs)
    want = sparse_grpo(logp, old, adv, cmask.bool(), mismatch=mm, correction=corr,
                       surrogate=PPOClip(clip_low=0.2, clip_high=0.2),
                       aggregation=Aggregation("seq-mean-token-mean", num_sequences=b)).loss
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


def test_callback_rejects_non_controller():
    with pytest.raises(ValueError, match="controller"):
        SparseCorrCallback(object())


def test_with_group_binds_every_batch_statistic():
    from sparsecorr_trl.corrections import with_group

    group = object()
    bound = with_group(chain(tis(cap=2.0), sparse_rl()), group)
    assert bound.pieces[1].group is group and bound.pieces[0] == tis(cap=2.0)
    assert with_group(sparse_rl(), None) == sparse_rl()
    assert with_group(tis(), group) == tis()
    own = _Halve()
    assert with_group(own, group) is own


def test_the_docs_table_lists_every_option():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs/integrations/trl.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines()
            if line.startswith("| `")}
    named = set(PARITY) | set(TRL) | {r.field for r in RULES}
    assert named <= rows, sorted(named - rows)
    for rule in RULES:
        assert f"rejected: {rule.values}" in text, rule.field
