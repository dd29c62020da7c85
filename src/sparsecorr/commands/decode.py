"""``sparsecorr decode``: sparse rollouts from a local model directory and a prompts JSONL."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("decode", help="generate sparse rollouts and write a RolloutBatch",
                       description="Generate responses with a sparse KV policy from a local Hugging "
                                   "Face model directory; write a RolloutBatch (safetensors + JSON).")
    p.add_argument("--model", required=True, help="local model directory (from_pretrained)")
    p.add_argument("--prompts", required=True,
                   help='JSONL, one {"prompt_ids": [...]} or {"prompt": "text"} per line')
    p.add_argument("--policy", default="rkv",
                   help="dense | streaming_llm | snapkv | rkv | block_topk (default rkv)")
    p.add_argument("--budget", type=int, default=512, help="KV budget in tokens (default 512)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output path of the RolloutBatch (.safetensors)")
    return p


def _read_prompts(path: Path, tokenizer) -> list[list[int]]:
    if not path.is_file():
        raise ValueError(f"--prompts: no such file {path}")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--prompts: line {i} is not JSON ({exc})") from None
        if "prompt_ids" in row:
            prompts.append([int(t) for t in row["prompt_ids"]])
        elif "prompt" in row:
            if tokenizer is None:
                raise ValueError(f"--prompts: line {i} has text but the model directory has no tokenizer")
            prompts.append(tokenizer(row["prompt"])["input_ids"])
        else:
            raise ValueError(f"--prompts: line {i} needs 'prompt_ids' or 'prompt'")
    if not prompts:
        raise ValueError(f"--prompts: {path} holds no prompt")
    return prompts


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..decoding import generate, get_policy

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise ValueError(f"--model: expected a local model directory, got {model_dir}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:
        tokenizer = None
    prompts = [p for p in _read_prompts(Path(args.prompts), tokenizer) for _ in range(args.samples_per_prompt)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    policy = get_policy(args.policy)
    t0 = time.perf_counter()
    batch = generate(model, ids, mask, policy=policy, budget=None if args.policy == "dense" else args.budget,
                     max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k, top_p=args.top_p, eos_token_id=model.config.eos_token_id,
                     generator=torch.Generator().manual_seed(args.seed), progress=True)
    elapsed = time.perf_counter() - t0
    path = batch.save(args.out)
    n_tok = int(batch.lengths.sum())
    kept = batch.kv_kept[batch.mask]
    print(f"wrote {path} ({len(prompts)} rollouts, {n_tok} tokens)")
    print(f"throughput: {n_tok / elapsed:.1f} tokens/s ({elapsed:.2f} s, policy {policy!r})")
    print(f"KV: peak {batch.peak_kv_bytes / 2**20:.2f} MiB, mean attended "
          f"{float(kept.mean()) if kept.numel() else 0.0:.1f} tokens per layer and head")
    return 0
