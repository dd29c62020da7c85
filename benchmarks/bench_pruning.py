"""ARRoL pruning: generated tokens and wall time with and without pruning, same prompts.

Keep ratio 0.5, detection at 1/8 of the maximum length (the issue's setting), groups of 8,
on a model built from a config with random weights. Target: >= 1.5x fewer generated tokens.
Run: ``python benchmarks/bench_pruning.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import machine, setup, table

from sparsecorr.decoding import RKV, Dense, generate
from sparsecorr.pruning import Pruner, QualityHead
from tests.models import tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    setup(2)
    max_len = 64 if args.quick else 256
    groups, g = (2, 8) if args.quick else (4, 8)
    model = tiny_model("qwen3", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                       head_dim=32, vocab_size=512)
    ids = torch.randint(3, 512, (groups, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.repeat_interleave(g, 0)
    rows = []
    print(f"# bench_pruning ({machine()})")
    for policy, budget in ((Dense(), None), (RKV(), 64)):
        results = {}
        for name, pruner in (("no pruning", None),
                             ("ARRoL keep 0.5", Pruner(QualityHead(256), detect_len=max_len // 8))):
            t0 = time.perf_counter()
            out = generate(model, ids, policy=policy, budget=budget, max_new_tokens=max_len,
                           pruner=pruner, group_size=g, generator=torch.Generator().manual_seed(1))
            results[name] = (int(out.lengths.sum()), time.perf_counter() - t0)
        base_tok, base_t = results["no pruning"]
        for name, (tok, t) in results.items():
            rows.append([policy.name, name, tok, f"{base_tok / tok:.2f}x", f"{t:.1f} s", f"{base_t / t:.2f}x"])
    print(f"\n{groups} prompts x {g} rollouts, max {max_len} tokens, detect at {max_len // 8}\n")
    print(table(["policy", "run", "generated tokens", "fewer tokens", "wall", "speedup"], rows))


if __name__ == "__main__":
    main()
