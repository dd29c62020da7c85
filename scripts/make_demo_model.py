"""Build the shipped demo model: a tiny Qwen3 pre-trained (seeded, CPU, ~1-2 min) on the recall task.

Sequences are ``[BOS, key, filler..., key, key, ...]``; the loss is on the response part only,
so the model learns to recall the token at position 1 from anywhere in a long context, which a
KV budget that evicts it (StreamingLLM with one sink token) cannot do.

Usage: ``python scripts/make_demo_model.py [--steps 300] [--out src/sparsecorr/assets/demo_model]``
"""

from __future__ import annotations

import argparse

import torch

from sparsecorr.demo.task import demo_model, make_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="src/sparsecorr/assets/demo_model")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = demo_model(seed=0, pretrained=False).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        prompts = make_prompts(32, 16, seed=10_000 + step)
        resp = prompts[:, 1:2].expand(-1, 48)
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
