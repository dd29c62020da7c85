"""Rollout generation inside ``SparseGRPOTrainer`` vs TRL's own generate path, same process.

One generation call of ``_generate_single_turn`` on the shipped demo model (Qwen3, 2 layers)
for ``B`` prompts of 16 tokens and ``T`` new tokens: TRL's transformers ``model.generate`` path
(``SparseCorrConfig()``, the baseline) against the sparsecorr sampler with the dense policy and
with StreamingLLM at budget 16 (which also records every token's log-prob, as vLLM does).
Prints median wall time, ratio to TRL's path and tokens/s.

Usage: ``python benchmarks/bench_trl_rollouts.py [--threads 2]``
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _common import machine, median_time, setup, table


def _trainer(config, out: str, *, batch: int, new_tokens: int):
    from datasets import Dataset
    from sparsecorr_trl import SparseGRPOTrainer
    from sparsecorr_trl.demo.task import demo_model, demo_tokenizer, recall_reward_text
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=out, per_device_train_batch_size=batch, num_generations=batch,
                      max_completion_length=new_tokens, report_to=[], use_cpu=True, bf16=False,
                      save_strategy="no", activation_checkpointing=False, disable_tqdm=True)
    return SparseGRPOTrainer(model=demo_model(), reward_funcs=recall_reward_text, args=args,
                             train_dataset=Dataset.from_dict({"prompt": ["<s> k1"]}),
                             processing_class=demo_tokenizer(), sparsecorr_config=config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    setup(args.threads)
    from sparsecorr_trl import SparseCorrConfig
    from sparsecorr_trl.demo.task import make_prompts

    arms = [("TRL generate (baseline)", SparseCorrConfig()),
            ("sparsecorr dense", SparseCorrConfig(policy="dense")),
            ("sparsecorr StreamingLLM b=16", SparseCorrConfig(policy="streaming_llm",
                                                              policy_kwargs={"sink": 1},
                                                              budget=16))]
    rows = []
    print(machine())
    for batch, new in ((16, 64), (64, 128)):
        prompts = make_prompts(batch, 16, seed=0).tolist()
        base = None
        for name, cfg in arms:
            with tempfile.TemporaryDirectory() as tmp:
                trainer = _trainer(cfg, tmp, batch=batch, new_tokens=new)
                trainer.model.eval()
                with torch.no_grad():
                    sec = median_time(
                        lambda t=trainer, p=prompts, b=batch: t._generate_single_turn(p, None, {}, b),
                        repeat=5)
            base = sec if base is None else base
            rows.append([f"B={batch} T={new}", name, f"{sec * 1e3:.1f}", f"{sec / base:.2f}x",
                         f"{batch * new / sec:.0f}"])
    print(table(["shape", "sampler", "ms / call", "vs TRL", "tokens/s"], rows))


if __name__ == "__main__":
    main()
