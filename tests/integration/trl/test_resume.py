"""Resume: 4 steps in one go equal 2 steps, a checkpoint, and 2 resumed steps, with the sparse
sampler on (its generator is checkpointed with the run) and with DistillSparse (the adapter's
optimizer and the whole policy too: TRL's PEFT checkpoint holds only the adapter)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
from sparsecorr_trl import SparseCorrConfig, SparseGRPOTrainer
from sparsecorr_trl.checkpoint import POLICY_FILE, sampler_file
from transformers import TrainerCallback

from tests.integration.trl import parity

SPARSE = dict(policy="streaming_llm", policy_kwargs={"sink": 1}, budget=4)
ARGS = dict(max_steps=4, save_strategy="steps", save_steps=2, optim="adamw_torch",
            learning_rate=1e-2, loss_type="dapo")


class Recording(SparseGRPOTrainer):
    """Keeps every rollout it samples (completion token ids)."""

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        completions, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self.rollouts = [*getattr(self, "rollouts", []), completions]
        return completions, logprobs


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step
        return control


def _run(out, config, *, stop=None, resume=None):
    kwargs = {"callbacks": [StopAt(stop)]} if stop else {}
    return parity.run(Recording, out=out, sparsecorr_config=config, trainer_kwargs=kwargs,
                      resume_from_checkpoint=resume, **ARGS)


@pytest.mark.parametrize("extra", [{}, {"distill": True, "distill_rank": 2, "distill_lr": 1e-2}],
                         ids=["sparse_rl", "distill"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, extra):
    config = SparseCorrConfig("sparse_rl", **SPARSE, **extra)
    whole = _run(tmp_path / "whole", config)
    first = _run(tmp_path / "split", config, stop=2)
    ckpt = tmp_path / "split" / "checkpoint-2"
    assert sampler_file(ckpt, 0, 1).is_file()
    second = _run(tmp_path / "split", config, resume=str(ckpt))
    assert len(whole.trainer.rollouts) == 4
    assert first.trainer.rollouts == whole.trainer.rollouts[:2]
    assert second.trainer.rollouts == whole.trainer.rollouts[2:]
    for name, p in whole.params.items():
        assert torch.equal(p, second.params[name]), name
    # the resumed trainer's log history starts with the checkpoint's two rows
    assert [r["loss"] for r in whole.rows] == [r["loss"] for r in second.rows]


@pytest.mark.parametrize("extra, drop", [
    ({}, "sampler"),
    ({"distill": True, "distill_rank": 2, "distill_lr": 1e-2}, POLICY_FILE),
], ids=["sampler", "policy"])
def test_without_the_sparsecorr_files_the_resumed_run_differs(tmp_path, extra, drop):
    """The test above can fail: drop the sampler's state (or, with DistillSparse, the policy the
    PEFT checkpoint leaves out) and the resumed rollouts change."""
    config = SparseCorrConfig("sparse_rl", **SPARSE, **extra)
    whole = _run(tmp_path / "whole", config)
    _run(tmp_path / "split", config, stop=2)
    ckpt = tmp_path / "split" / "checkpoint-2"
    (sampler_file(ckpt, 0, 1) if drop == "sampler" else ckpt / drop).unlink()
    second = _run(tmp_path / "split", config, resume=str(ckpt))
    assert second.trainer.rollouts != whole.trainer.rollouts[2:]
