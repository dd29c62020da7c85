"""Sparse decoding on CPU: per-token decode time and peak KV bytes vs context length.

Dense, StreamingLLM, RKV and BlockTopK at budget 256 on a 4-layer, hidden-512 Qwen3-architecture
model with random weights; our dense path against ``model.generate`` (the outside baseline).
Per-token time = decode wall time / decoded tokens as recorded by ``generate`` (prefill
excluded); for ``model.generate``, (time of 1 + N tokens - time of 1 token) / N.
Targets: our dense within 1.2x of model.generate; eviction step time flat in context and >= 2x
faster than dense at 8k; peak KV at 8k <= (budget + buffer) / 8k of dense.
Run: ``python benchmarks/bench_decoding.py [--quick]``.
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

from sparsecorr.decoding import RKV, BlockTopK, Dense, StreamingLLM, generate
from tests.models import tiny_model


def _median_time(fn, m: int, repeat: int) -> float:  # for model.generate only
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(m)
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeat // 2]


def per_token(fn, n: int, repeat: int = 3) -> float:
    """(median time of 1 + n tokens - median time of 1 token) / n, after a warm-up."""
    fn(2)
    return (_median_time(fn, 1 + n, repeat) - _median_time(fn, 1, repeat)) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    setup(2)
    contexts = (1024, 2048) if args.quick else (1024, 2048, 4096, 8192)
    n = 32 if args.quick else 64
    budget = 256
    model = tiny_model("qwen3", vocab_size=1024, hidden_size=512, num_layers=4, num_heads=8,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=16384,
                       attn_implementation="sdpa")
    policies = [("dense (ours)", Dense(), None), ("StreamingLLM", StreamingLLM(), budget),
                ("RKV", RKV(), budget), ("BlockTopK", BlockTopK(), budget)]
    rows, dense_ms, dense_kv = [], {}, {}
    print(f"# bench_decoding ({machine()})")
    for ctx in contexts:
        ids = torch.randint(3, 1024, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        hf = per_token(lambda m, ids=ids: model.generate(ids, max_new_tokens=m, min_new_tokens=m,
                                                            do_sample=False), n)
        rows.append([ctx, "model.generate (sdpa)", f"{hf * 1e3:.1f}", "", "", ""])
        for name, policy, b in policies:
            generate(model, ids[:, :64], policy=policy, budget=b, max_new_tokens=4, temperature=0)
            out = generate(model, ids, policy=policy, budget=b, max_new_tokens=n + 1, temperature=0)
            t, kv = out.meta["decode_s"] / n, out.peak_kv_bytes
            if name.startswith("dense"):
                dense_ms[ctx], dense_kv[ctx] = t, kv
                rows.append([ctx, name, f"{t * 1e3:.1f}", f"{t / hf:.2f}x of generate", f"{kv / 2**20:.1f} MiB", "1.00"])
            else:
                rows.append([ctx, name, f"{t * 1e3:.1f}", f"{dense_ms[ctx] / t:.2f}x faster",
                             f"{kv / 2**20:.2f} MiB", f"{kv / dense_kv[ctx]:.3f}"])
    print(f"\nbudget {budget}, {n} decode steps after a {list(contexts)}-token prompt, batch 1\n")
    print(table(["context", "decoder", "ms / token", "vs dense", "peak KV", "KV / dense"], rows))
    print("\nRKV's bound: (budget + buffer) / context = "
          + ", ".join(f"{(budget + 128) / c:.3f} at {c}" for c in contexts))


if __name__ == "__main__":
    main()
