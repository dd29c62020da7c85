"""The model SparseGRPOTrainer samples from: no training hooks while sampling (so the fused step
runs on a model TRL prepared with gradient checkpointing), both restored exactly after, and the
trainer's ``sparsecorr/rollout/fused`` metric says what ran. On the CPU the graph code path runs
with the eager stand-in runner (the capture itself is tested in tests/gpu)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
from sparsecorr_trl import SparseCorrConfig
from sparsecorr_trl.gather import full_parameters, training_hooks_off

import sparsecorr.decoding.graphs as graphs_mod
from tests.integration.trl.test_sparse_rollouts import _trainer
from tests.models import tiny_model


@pytest.fixture
def cpu_graphs(monkeypatch):
    monkeypatch.setattr(graphs_mod, "CudaGraphRunner", graphs_mod.EagerRunner)
    monkeypatch.setattr(graphs_mod, "check_graph_device", lambda device: None)


def _prepared():
    """A tiny Qwen3 as TRL prepares it: gradient checkpointing (with transformers' input
    require-grads hook on the embedding)."""
    model = tiny_model("qwen3", vocab_size=64).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()  # once more, as TRL and PEFT do: a second hook
    return model


def _state(model):
    embed = model.get_input_embeddings()
    return (len(embed._forward_hooks), model.is_gradient_checkpointing)


def test_training_hooks_off_and_back_exactly():
    model = _prepared()
    before = _state(model)
    assert before == (2, True)  # transformers keeps the first hook registered too
    with training_hooks_off(model) as m:
        assert m is model and _state(model) == (0, False)
        out = model(torch.tensor([[5, 6, 7]])).logits
        assert not out.requires_grad or model.training  # no hook forcing grads on the input
    assert _state(model) == before
    with pytest.raises(RuntimeError, match="inside"), training_hooks_off(model):
        raise RuntimeError("inside")
    assert _state(model) == before  # restored on an exception too, and never doubled
    for _ in range(3):
        with training_hooks_off(model):
            pass
    assert _state(model) == before


def test_full_parameters_of_an_unsharded_model_is_the_model_itself():
    from accelerate import Accelerator

    model = tiny_model("qwen3", vocab_size=64)
    with full_parameters(model, Accelerator(cpu=True)) as m:
        assert m is model


def test_trainer_with_gradient_checkpointing_logs_fused_on(tmp_path, cpu_graphs, monkeypatch):
    """TRL's default (gradient checkpointing on): the rollouts still run the fused graph step on
    a model without training hooks, the metric says so at every step, and each rollout gives the
    trained model back its own hooks, no more."""
    import sparsecorr_trl.trainer as trainer_mod

    cfg = SparseCorrConfig("sparse_rl", policy="streaming_llm", policy_kwargs={"sink": 1}, budget=4,
                           cuda_graph=True)
    trainer = _trainer(tmp_path, cfg, gradient_checkpointing=True)
    seen = {"inside": [], "outside": []}
    rollouts = trainer_mod.sparse_rollouts

    def recorded(model, *args, **kwargs):
        seen["inside"].append(_state(model))
        return rollouts(model, *args, **kwargs)

    monkeypatch.setattr(trainer_mod, "sparse_rollouts", recorded)
    generate = trainer._generate_single_turn

    def outside(*args, **kwargs):
        model = trainer.accelerator.unwrap_model(trainer.model)
        before = _state(model)
        out = generate(*args, **kwargs)
        seen["outside"].append((before, _state(model)))
        return out

    trainer._generate_single_turn = outside
    trainer.train()
    assert trainer.sparsecorr_rollout_engine == {"backend": "torch", "cuda_graph": "on", "fused": "on"}
    logged = [row["sparsecorr/rollout/fused"] for row in trainer.state.log_history
              if "sparsecorr/rollout/fused" in row]
    assert len(logged) == 2 and all(v == 1.0 for v in logged), logged
    assert seen["inside"] == [(0, False)] * 2
    # the same hooks before and after each rollout (TRL's own disable / enable of gradient
    # checkpointing around its log-prob forwards adds hooks between rollouts: not ours)
    assert len(seen["outside"]) == 2
    for before, after in seen["outside"]:
        assert before == after and before[0] >= 1 and before[1], seen["outside"]


def test_sharded_policies_are_accepted_and_zero3_without_the_gather_refused():
    from sparsecorr_trl import validate_grpo_args
    from trl import GRPOConfig

    from tests.integration.trl import parity

    args = GRPOConfig(**{**parity.BASE, "output_dir": "/tmp/unused"})
    cfg = SparseCorrConfig("sparse_rl", policy="streaming_llm", budget=4)
    args.fsdp, args.deepspeed = "full_shard", "ds_config.json"
    validate_grpo_args(args, cfg)  # refused before: now gathered once per rollout
    args.ds3_gather_for_generation = False
    with pytest.raises(ValueError, match=r"ds3_gather_for_generation: expected not False under "
                                         r"DeepSpeed with a sparse policy \(the sparse sampler reads"):
        validate_grpo_args(args, cfg)
    validate_grpo_args(args, SparseCorrConfig("sparse_rl"))  # TRL's generation: TRL's choice
    args.deepspeed = None
    validate_grpo_args(args, cfg)  # the option does nothing without DeepSpeed
    distill = SparseCorrConfig("sparse_rl", policy="streaming_llm", budget=4, distill=True)
    args.beta = 0.0
    with pytest.raises(ValueError, match=r"fsdp: expected not set with distill=True \(DistillSparse"):
        validate_grpo_args(args, distill)
