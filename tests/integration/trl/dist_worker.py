"""One training run of ``SparseGRPOTrainer`` for the multi-process test (``test_distributed.py``).

Run as ``accelerate launch --multi_gpu --num_processes N dist_worker.py OUT LOSS_TYPE
GLOBAL_BATCH`` (torchrun-style processes; with ``use_cpu=True`` accelerate joins them in a gloo
group on CPU: ``--cpu`` alone would start one process) or plain ``python`` for one process: each process gets ``GLOBAL_BATCH / N`` rollouts per step.
Rollouts come from a sampler whose randomness depends only on the rollout's *global* index in
the generation batch and the step, so every process layout trains on the same global batch; its
"sampler log-prob" is the dense log-prob plus seeded noise, so ``sparse_rl()`` truncates and
rejects an uneven number of tokens per process. The main process writes the log history
(``log.json``) and the final parameters (``params.safetensors``) to ``OUT``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.integration.trl import parity


def _trainer_class():
    from sparsecorr_trl import SparseGRPOTrainer

    class LayoutFreeSampler(SparseGRPOTrainer):
        """Dense sampling seeded per global rollout index; noisy recorded log-probs."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            model = self.accelerator.unwrap_model(self.model)
            offset = self.accelerator.process_index * len(prompt_ids)
            completions, logprobs = [], []
            for i, prompt in enumerate(prompt_ids):
                g = torch.Generator().manual_seed(100_003 * self._step + offset + i)
                ids, lps = list(prompt), []
                with torch.no_grad():
                    for _ in range(self.max_completion_length):
                        logits = model(torch.tensor([ids])).logits[0, -1].float() / self.temperature
                        logp = logits.log_softmax(-1)
                        token = int(torch.multinomial(logp.exp(), 1, generator=g))
                        ids.append(token)
                        lps.append(float(logp[token]) + 0.5 * float(torch.randn(1, generator=g)))
                        if token in self.eos_token_ids:
                            break
                completions.append(ids[len(prompt):])
                logprobs.append(lps)
            return completions, logprobs

    return LayoutFreeSampler


def main(out: str, loss_type: str, global_batch: int) -> None:
    from accelerate import PartialState
    from sparsecorr_trl import SparseCorrConfig

    state = PartialState(cpu=True)  # the first PartialState decides: gloo on CPU
    world = state.num_processes
    run = parity.run(_trainer_class(), out=out, sparsecorr_config=SparseCorrConfig("sparse_rl"),
                     per_device_train_batch_size=global_batch // world, loss_type=loss_type,
                     max_steps=2, num_generations=4)
    if state.is_main_process:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "log.json").write_text(json.dumps({"world": world, "backend": state.backend,
                                                        "rows": run.rows}))
        save_file({k: v.contiguous() for k, v in run.params.items()},
                  str(Path(out) / "params.safetensors"))
    # an orderly teardown: a rank that exits while gloo's threads still run on the other side
    # can abort in C++ ("terminate called without an active exception", seen once in CI)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        state.wait_for_everyone()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    # Skip the interpreter's teardown: the results are on disk, and one CI run saw a rank hang
    # at exit (after destroy_process_group) until the test's timeout, in the joins of threads
    # that gloo / the tokenizer pools leave behind. os._exit ends the process here, every time.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
