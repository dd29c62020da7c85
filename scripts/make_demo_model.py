"""Build the shipped demo model: a tiny Qwen3 pre-trained briefly (seeded, CPU, ~10 s) to a
*partial* skill on the recall task, so that RL has something to learn.

Sequences are a prompt ``[BOS, key, filler...]`` followed by a response; the correct response
recites the prompt after BOS over and over (``sparsecorr_trl.demo.task.copy_targets``): every
token is the one a full period (15 tokens) back, which a KV budget with a recent window shorter
than the period (StreamingLLM at budget 8) cannot see. The model is supervised (loss on the
response only) on a *noisy teacher* (`noisy_demonstrations`): at each step the teacher recites
the right token with probability 0.7 for keys and the lower half of the filler vocabulary and
0.3 for the upper half, and otherwise repeats its previous token, a shortcut that needs no
context far back. After 200 steps the model's greedy reward is about 0.3 (it recites the easy
tokens and takes the shortcut on the hard ones), while sampling still finds the right hard
tokens often enough for GRPO to learn from.

Deterministic: seeded data and init, one CPU thread. Also writes the word-level tokenizer
(``tokenizer.json``) next to the weights (about 330 KB in all).

Usage: ``python scripts/make_demo_model.py [--steps 200] [--p-easy 0.7] [--p-hard 0.3]
[--out integrations/trl/src/sparsecorr_trl/demo/assets/demo_model] [--tokenizer-only]``
"""

from __future__ import annotations

import argparse

import torch
from sparsecorr_trl.demo.task import (
    HARD_FROM,
    PROMPT_LEN,
    RESPONSE_LEN,
    build_tokenizer,
    copy_targets,
    demo_model,
    make_prompts,
    recall_reward,
)

from sparsecorr.decoding import Dense, generate


def greedy_reward(model, prompts: torch.Tensor, max_new_tokens: int) -> float:
    model.eval()
    with torch.no_grad():
        batch = generate(model, prompts, policy=Dense(), budget=None, temperature=0.0,
                         max_new_tokens=max_new_tokens, logprobs_topk=0)
    model.train()
    return float(recall_reward(prompts, batch.tokens, batch.mask).mean())


def noisy_demonstrations(prompts: torch.Tensor, length: int, p_easy: float, p_hard: float,
                         g: torch.Generator) -> torch.Tensor:
    """``[B, length]`` responses of a noisy teacher: at each step it recites the right token
    (``copy_targets``) with probability ``p_easy`` when that token is in the lower half of the
    filler vocabulary (or is a key), ``p_hard`` otherwise, and else repeats its previous token
    (a shortcut that needs no context far back)."""
    target = copy_targets(prompts, length)
    p = torch.where(target < HARD_FROM, p_easy, p_hard)
    right = torch.rand(target.shape, generator=g) < p
    out = torch.empty_like(target)
    prev = prompts[:, -1]
    for t in range(length):
        prev = torch.where(right[:, t], target[:, t], prev)
        out[:, t] = prev
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--p-easy", type=float, default=0.7)
    ap.add_argument("--p-hard", type=float, default=0.3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default="integrations/trl/src/sparsecorr_trl/demo/assets/demo_model")
    ap.add_argument("--tokenizer-only", action="store_true",
                    help="write only the tokenizer files (the weights are left as they are)")
    args = ap.parse_args()
    build_tokenizer().save_pretrained(args.out)
    if args.tokenizer_only:
        print(f"tokenizer saved to {args.out}")
        return
    torch.set_num_threads(1)  # one thread: the same floats on any machine
    torch.manual_seed(0)
    model = demo_model(seed=0, pretrained=False).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    check = make_prompts(64, PROMPT_LEN, seed=55_555)  # not the demo's held-out prompts
    g = torch.Generator().manual_seed(1)
    reward = 0.0
    for step in range(args.steps):
        prompts = make_prompts(32, PROMPT_LEN, seed=10_000 + step)
        resp = noisy_demonstrations(prompts, RESPONSE_LEN, args.p_easy, args.p_hard, g)
        ids = torch.cat([prompts, resp], 1)
        logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 resp.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 == args.steps:
            reward = greedy_reward(model, check, RESPONSE_LEN)
            print(f"step {step + 1} loss {loss.item():.4f} greedy reward {reward:.3f}", flush=True)
    model.eval().save_pretrained(args.out, safe_serialization=True)
    print(f"saved to {args.out} (greedy reward {reward:.3f})")


if __name__ == "__main__":
    main()
