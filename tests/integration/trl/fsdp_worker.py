"""One ``SparseGRPOTrainer`` run with sparse rollouts, for the FSDP test (``test_fsdp.py``).

Run as ``accelerate launch --multi_gpu --num_processes N fsdp_worker.py OUT GLOBAL_BATCH V``
(gloo on CPU, FSDP version ``V``) or plain ``python fsdp_worker.py OUT GLOBAL_BATCH 0`` for one
unsharded process. accelerate applies FSDP only on accelerator devices (on the CPU its state
says ``MULTI_CPU``), so the worker sets its state to FSDP before the trainer builds its
``Accelerator``: everything after that, ``fully_shard`` / ``FullyShardedDataParallel`` included,
is accelerate's and the trainer's own code. Every rollout goes through the
trainer's own sparse path (``rollout_model`` + ``sparse_rollouts``), one prompt per sampler call
with the generator seeded by the rollout's *global* index and the step, so every process layout
samples the same global batch from the same weights. The main process writes the log rows, the
rollouts of every process (``log.json``) and the final full parameters (``params.safetensors``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.integration.trl import parity

#: the collectives FSDP v1 and v2 all-gather parameters with (torch 2.11 to 2.14)
_GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")


@contextlib.contextmanager
def _counting_gathers():
    """Counts the parameter all-gathers of one sampler call: ``around`` the whole call, and
    ``in`` the sampler's ``generate`` (``sparse_rollouts``)."""
    import sparsecorr_trl.trainer as trainer_mod

    counts = {"around": 0, "in": 0}
    inside = [False]
    saved = {n: getattr(torch.distributed, n) for n in _GATHERS if hasattr(torch.distributed, n)}
    rollouts = trainer_mod.sparse_rollouts

    def counted(fn):
        def call(*args, **kwargs):
            counts["around"] += 1
            counts["in"] += inside[0]
            return fn(*args, **kwargs)
        return call

    def flagged(*args, **kwargs):
        inside[0] = True
        try:
            return rollouts(*args, **kwargs)
        finally:
            inside[0] = False

    for name, fn in saved.items():
        setattr(torch.distributed, name, counted(fn))
    trainer_mod.sparse_rollouts = flagged
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.distributed, name, fn)
        trainer_mod.sparse_rollouts = rollouts


def _trainer_class(record: list):
    from sparsecorr_trl import SparseGRPOTrainer

    class LayoutFreeSeeds(SparseGRPOTrainer):
        """The sparse sampler, one prompt per call, seeded per global rollout index."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            offset = self.accelerator.process_index * len(prompt_ids)
            completions, logprobs = [], []
            for i, prompt in enumerate(prompt_ids):
                self._sparsecorr_generator = torch.Generator().manual_seed(
                    100_003 * self._step + offset + i)
                with _counting_gathers() as gathers:
                    (c,), (lp,) = super()._generate_single_turn(
                        [prompt], images, multimodal_fields, num_generations, has_tool_images)
                completions.append(c)
                logprobs.append(lp)
                record.append({"step": self._step, "index": offset + i, "completion": c,
                               "logprobs": lp, "engine": self.sparsecorr_rollout_engine,
                               "gathers": gathers["around"], "gathers_in_generate": gathers["in"]})
            return completions, logprobs

    return LayoutFreeSeeds


def _full_params(trainer) -> dict[str, torch.Tensor]:
    """Every parameter whole (FSDP v1 / v2 shards gathered); a collective on every rank."""
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    return {k: v.detach().clone().contiguous() for k, v in (state or {}).items()}


def _force_fsdp(version: int) -> None:
    """Every ``AcceleratorState`` set up from here on says FSDP ``version`` (whole-layer units
    of the tiny Qwen3); transformers' Trainer resets the state before building its own."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Qwen3DecoderLayer"],
        reshard_after_forward=True if version == 2 else "FULL_SHARD")
    setup = AcceleratorState.__init__

    def fsdp_state(self, *args, **kwargs):
        setup(self, *args, **kwargs)
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = plugin

    AcceleratorState.__init__ = fsdp_state


def main(out: str, global_batch: int, fsdp: int) -> None:
    from accelerate import PartialState
    from sparsecorr_trl import SparseCorrConfig

    state = PartialState(cpu=True)  # the first PartialState decides: gloo on CPU
    world = state.num_processes
    if fsdp:
        _force_fsdp(fsdp)
    record: list[dict] = []
    cfg = SparseCorrConfig("sparse_rl", policy="streaming_llm", policy_kwargs={"sink": 1},
                           budget=4)
    run = parity.run(_trainer_class(record), out=out, sparsecorr_config=cfg,
                     per_device_train_batch_size=global_batch // world, loss_type="dapo",
                     max_steps=2, num_generations=4, gradient_checkpointing=True)
    params = _full_params(run.trainer)
    rollouts = [None] * world
    torch.distributed.all_gather_object(rollouts, record) if world > 1 else rollouts.__setitem__(0, record)
    if state.is_main_process:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "log.json").write_text(json.dumps({
            "world": world, "backend": state.backend, "rows": run.rows,
            "rollouts": [r for rank in rollouts for r in rank],
            "fsdp": run.trainer._dist.fsdp_version,
            "wrapped": type(run.trainer.model_wrapped).__name__,
            "distributed_type": str(run.trainer.accelerator.state.distributed_type)}))
        save_file(params, str(Path(out) / "params.safetensors"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        state.wait_for_everyone()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    # skip the interpreter's teardown (see dist_worker.py): the results are on disk
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
