"""OpenRLHF's sparse rollout actor against the scheduler it runs on: the actor's overhead.

At the RL shape of ``bench_rollout_gpu.py`` (N requests x a short prompt + log-normal response
lengths with std = mean, forced by ``ignore_eos``), two rows in one process on one model shape:

- **scheduler**: ``bench_rollout_gpu.continuous_row`` (every request submitted to a
  ``Scheduler`` at once, stepped on this thread until all finish);
- **OpenRLHF actor**: ``sparsecorr_openrlhf.rollout.SparseRolloutActor`` (its own copy, loaded
  from a checkpoint of the same random weights) serving the same N requests as N concurrent
  ``generate(prompt_token_ids, sampling_params)`` calls, as OpenRLHF's executors send them:
  the engine thread, the request parsing and the vLLM-shaped outputs (with per-token
  ``{token_id: Logprob}``) on top of the same scheduler.

Both are warmed up at their batch shape first. The actor's tokens/s over the scheduler's is its
overhead (issue #53: "should be small"). Run: ``python benchmarks/bench_openrlhf_actor_gpu.py``
(GPU, Qwen3-0.6B shape, 64 requests, bf16; ``--out rows.jsonl``), ``--smoke`` for the tiny CPU
run the test suite makes. Not yet run on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_rollout_gpu as rollout
from _common import machine, setup, table
from bench_decoding_gpu import build, clean, sync


def _params(max_tokens: int) -> SimpleNamespace:
    """The vLLM ``SamplingParams`` fields the actor reads (vLLM need not be installed): greedy,
    forced length, the sampled token's log-prob (OpenRLHF's ``logprobs=1``)."""
    return SimpleNamespace(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)


def actor_row(path: str, prompts, lens, args, device) -> tuple[float, int, int]:
    """(seconds, rows planned, most rows resident) of the actor serving every request at once."""
    from sparsecorr_openrlhf.rollout import SparseRolloutActor

    from sparsecorr.sampler import SamplerSpec

    dense = args.policy == "Dense"  # the scheduler row's policy, as bench_rollout_gpu.make_policy builds it
    spec = SamplerSpec(policy="dense" if dense else args.policy, policy_kwargs={} if dense else {"buffer": args.buffer},
                       budget=None if dense else args.budget, backend=args.backend,
                       cuda_graph=args.cuda_graph, prefill_chunk=args.prefill_chunk,
                       max_num_seqs=args.max_num_seqs or len(prompts), max_kv_bytes=args.max_kv_bytes)
    actor = SparseRolloutActor(path, sampler=spec, max_model_len=args.prompt + args.cap,
                               dtype="float32" if device.type == "cpu" else "bfloat16")

    async def serve(requests):
        return await asyncio.gather(*[actor.generate(p, _params(n)) for p, n in requests])

    try:
        rows = actor._driver.plan.rows
        asyncio.run(serve([(prompts[i % len(prompts)][:8].tolist(), 3) for i in range(rows)]))  # warm-up
        t0 = time.perf_counter()
        outs = asyncio.run(serve([(p.tolist(), n) for p, n in zip(prompts, lens, strict=True)]))
        sync(device)
        elapsed = time.perf_counter() - t0
        bad = [o for o, n in zip(outs, lens, strict=True) if len(o.outputs[0].token_ids) != n]
        if bad:
            raise RuntimeError(f"actor: {len(bad)} requests did not decode their forced length")
        resident = asyncio.run(actor.state())["max_resident"]
        return elapsed, rows, resident
    finally:
        asyncio.run(actor.close())


def _args(argv):
    extra = [a for a in (argv or []) if a.startswith("--policy=")]
    policy = extra[0].split("=", 1)[1] if extra else "rkv"
    args = rollout._args([a for a in (argv or []) if not a.startswith("--policy=")])
    args.policy = policy
    return args


def main(argv=None) -> dict:
    args = _args(argv if argv is not None else sys.argv[1:])
    setup(1 if args.smoke else 2)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    model = build(args.model, device, dtype)
    floor = rollout.Floor(model, bandwidth=rollout.copy_bandwidth(device, 2**22 if args.smoke else 2**31),
                          flops=rollout.matmul_rate(device, 256 if args.smoke else 8192, dtype))
    lens = rollout.lengths(args.n, mean=args.mean, cap=args.cap, seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(5, model.config.vocab_size, (args.prompt,), generator=g) for _ in range(args.n)]
    useful = sum(lens)
    print(f"# bench_openrlhf_actor_gpu ({machine()}, device {gpu}): {args.n} requests x ({args.prompt} + mean "
          f"{useful / args.n:.0f} tokens), policy {args.policy}")
    clean(device)
    sched_s, _steps, _floor_s, plan_rows, resident, step_ms = rollout.continuous_row(model, args.policy, prompts, lens, args,
                                                                              device, floor)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        clean(device)
        actor_s, actor_rows, actor_resident = actor_row(tmp, prompts, lens, args, device)
    records = [dict(row=f"{args.policy} scheduler", device=gpu, n=args.n, tokens=useful, seconds=sched_s,
                    tokens_per_s=useful / sched_s, plan_rows=plan_rows, resident=resident, step_ms=step_ms),
               dict(row=f"{args.policy} OpenRLHF actor", device=gpu, n=args.n, tokens=useful, seconds=actor_s,
                    tokens_per_s=useful / actor_s, plan_rows=actor_rows, resident=actor_resident)]
    print(table(["row", "tokens/s", "seconds", "plan rows", "max resident"],
                [[r["row"], f"{r['tokens_per_s']:,.0f}", f"{r['seconds']:.2f}", r["plan_rows"], r["resident"]]
                 for r in records]))
    summary = dict(row="summary", device=gpu, actor_over_scheduler=sched_s / actor_s)
    print(f"\nthe actor runs at {sched_s / actor_s:.0%} of the scheduler's tokens/s")
    if args.out:
        with open(args.out, "a") as f:
            for r in [*records, summary]:
                f.write(json.dumps(r) + "\n")
    return summary


if __name__ == "__main__":
    main()
