"""Build the shipped demo model: a tiny Qwen3 pre-trained (seeded, CPU, ~1-2 min) on the recall task.

Sequences are a prompt ``[BOS, key, filler...]`` followed by the prompt after BOS recited over
and over (``sparsecorr_trl.demo.task.copy_targets``); the loss is on the response part only, so
the model learns to fetch the token one period back at every step, which a KV budget with a
recent window shorter than the period (StreamingLLM at budget 8, period 15) cannot do.

Also writes the word-level tokenizer (``tokenizer.json``) next to the weights.

Usage: ``python scripts/make_demo_model.py [--steps 400]
[--out integrations/trl/src/sparsecorr_trl/demo/assets/demo_model]
[--tokenizer-only]``
"""

from __future__ import annotations

import argparse

import torch
from sparsecorr_trl.demo.task import build_tokenizer, copy_targets, demo_model, make_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="integrations/trl/src/sparsecorr_trl/demo/assets/demo_model")
    ap.add_argument("--tokenizer-only", action="store_true",
                    help="write only the tokenizer files (the weights are left as they are)")
    args = ap.parse_args()
    build_tokenizer().save_pretrained(args.out)
    if args.tokenizer_only:
        print(f"tokenizer saved to {args.out}")
        return
    torch.set_num_threads(2)
    model = demo_model(seed=0, pretrained=False).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        prompts = make_prompts(32, 16, seed=10_000 + step)
        resp = copy_targets(prompts, 48)
        ids = torch.cat([prompts, resp], 1)
        logits = model(input_ids=ids).logits[:, 15:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 resp.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    model.eval().save_pretrained(args.out, safe_serialization=True)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
