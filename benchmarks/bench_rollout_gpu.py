"""RL-shape rollouts: continuous batching against today's static ``generate``, per KV policy, each
row against the bandwidth-and-compute floor of the steps it ran.

The shape RL long chain-of-thought has: N requests, short prompts, long-tailed response lengths,
all submitted at once (a GRPO step's rollouts). Rows, in one process on one model:

- **HF generate** (sdpa, DynamicCache), on the first ``--hf-n`` requests only, each batch
  decoding to its longest row (HF has no per-row length);
- **our dense, static**: today's one-shot ``generate`` in batches of ``--static-batch`` rows in
  arrival order (default: as many as the dense memory plan fits), each batch decoding to its
  longest row (``max_new_tokens`` is one number per call);
- **our dense, continuous** and **each policy, continuous**: the `Scheduler` with every request
  submitted at once, each with its own ``max_tokens``, at the concurrency its memory plan allows
  (free device memory; ``--max-kv-gib`` caps it; at most ``--max-num-seqs``, default N);
- **head-of-line**: on the scheduler with ``--hol-policy``, a 4-token request submitted while a
  ``--hol-long``-token request decodes, against the same request alone (the slowdown; the
  static one-call-at-a-time batcher of verl's server made it wait for the whole long request).

Lengths are forced: EOS is off (``ignore_eos`` / no ``eos_token_id``), so every row of every
decoder does the same useful work, ``sum(lengths)`` tokens. The length distribution is a
log-normal with its standard deviation equal to its mean (sigma^2 = ln 2), clipped to
``[16, --cap]``, seeded (the shape of issue #50: "a long tail whose standard deviation equals its
mean"; the realised mean and standard deviation after clipping are printed).

**The floor** of a row is the time its steps cannot beat on this device: every step reads the
weights once, every decoded token reads the KV slots its row holds (dense: its context; an
eviction policy: at most ``budget + buffer / 2`` on average over a compression cycle), over the
copy bandwidth measured in this process; plus the prefill's matmul FLOPs (2 x parameters x
prompt tokens: the useful ones; padding is a decoder's own cost) at the bf16 matmul rate
measured in this process. A static
batch's floor counts the rows it keeps decoding after they are done (that is the work it does).
The floors' ratio (dense static / policy continuous) is what bytes predict for the speedup;
targets (issue #50): RKV continuous within 1.5x of its floor; RKV's speedup over dense static at
least 80% of the floors' ratio; head-of-line slowdown <= 2x.

Run: ``python benchmarks/bench_rollout_gpu.py`` (GPU, Qwen3-0.6B shape, random bf16 weights;
``--out rollout.jsonl`` keeps every row as one JSON line), ``--smoke`` for a tiny CPU run (what
the test suite runs). Without CUDA it runs ``--smoke``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, setup, table
from bench_decoding_gpu import SHAPES, build, clean, sync

from sparsecorr.decoding import RKV, Dense, RequestParams, Scheduler, SnapKV, StreamingLLM, generate

POLICIES = {"rkv": RKV, "streaming_llm": StreamingLLM, "snapkv": SnapKV}


def lengths(n: int, *, mean: float, cap: int, seed: int) -> list[int]:
    """``n`` response lengths: log-normal with std = mean before clipping to ``[16, cap]``."""
    sigma = math.sqrt(math.log(2.0))
    mu = math.log(mean) - sigma**2 / 2
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(mu + sigma * torch.randn(n, generator=g, dtype=torch.float64))
    return [int(v) for v in x.round().clamp(16, cap).tolist()]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 5."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times[1:])[2]


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """FLOP per second of an ``n x n`` matmul in ``dtype``, median of 5."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / sorted(times[1:])[2]


class Floor:
    """The bandwidth-and-compute floor of a run's steps (see the module docstring)."""

    def __init__(self, model, *, bandwidth: float, flops: float) -> None:
        cfg = model.config
        self.params = sum(p.numel() for p in model.parameters())
        self.weights = sum(p.numel() * p.element_size() for p in model.parameters())
        elem = next(model.parameters()).element_size()
        head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
        self.slot = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * elem
        self.bandwidth, self.flops = bandwidth, flops

    def seconds(self, *, steps: int, kv_slots: float, prefill_tokens: int) -> float:
        return ((steps * self.weights + kv_slots * self.slot) / self.bandwidth
                + 2 * self.params * prefill_tokens / self.flops)


def kv_read(prompt: int, n: int, held: float) -> float:
    """KV slots read by ``n`` decoded tokens of one row (token t reads min(prompt + t, held))."""
    t = torch.arange(n, dtype=torch.float64)
    return float((prompt + t).clamp(max=held).sum())


def held_slots(name: str, args) -> float:
    return math.inf if name == "Dense" else args.budget + args.buffer / 2


def make_policy(name: str, args):
    return Dense() if name == "Dense" else POLICIES[name](buffer=args.buffer)


def hf_row(model, prompts, lens, args, device):
    """HF generate over the first ``--hf-n`` requests in one batch, to its longest row."""
    ids = torch.stack(prompts[:args.hf_n]).to(device)
    new = max(lens[:args.hf_n])
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t0, sum(lens[:args.hf_n]), len(ids), new


def static_row(model, prompts, lens, args, device, floor: Floor, batch: int):
    """Today's ``generate`` in batches of ``batch`` rows, each to its longest row."""
    elapsed, steps, kv = 0.0, 0, 0.0
    warm = torch.stack([p[:8] for p in prompts[:batch]]).to(device)  # capture + compile at the batch shape
    generate(model, warm, policy=Dense(), budget=None, max_new_tokens=3, temperature=0, logprobs_topk=0,
             backend=args.backend, prefill_chunk=args.prefill_chunk, cuda_graph=args.cuda_graph)
    for i in range(0, len(prompts), batch):
        ids, new = torch.stack(prompts[i:i + batch]).to(device), max(lens[i:i + batch])
        t0 = time.perf_counter()
        generate(model, ids, policy=Dense(), budget=None, max_new_tokens=new, temperature=0, logprobs_topk=0,
                 backend=args.backend, prefill_chunk=args.prefill_chunk, cuda_graph=args.cuda_graph)
        sync(device)
        elapsed += time.perf_counter() - t0
        steps += math.ceil(args.prompt / args.prefill_chunk) + new
        kv += len(ids) * kv_read(args.prompt, new, math.inf)
    fl = floor.seconds(steps=steps, kv_slots=kv, prefill_tokens=len(prompts) * args.prompt)
    return elapsed, steps, fl


def warm_up(sched: Scheduler, prompts) -> None:
    """Fill every row with a short request, request ``i`` decoding ``3 + i`` tokens, and drain
    them: the batch then shrinks one row per step through every power of two below
    ``plan.rows``, so the graph captures and the fused step's compiles at each of those batch
    shapes happen here, not in the timed run (without a warm-up, an H200 run's Dense continuous
    row took 71 s for 4,096 steps of median 7.0 ms: 29 s; we believe most of the rest was that
    first compile, not verified)."""
    for i in range(sched.plan.rows):
        params = RequestParams(max_tokens=3 + i, temperature=0, ignore_eos=True)
        sched.add_request(f"warm{i}", prompts[i % len(prompts)][:8].tolist(), params)
    while sched.has_unfinished():
        sched.step()


def continuous_row(model, name, prompts, lens, args, device, floor: Floor):
    """Every request submitted at once to a `Scheduler`; stepped until all finish."""
    sched = Scheduler(model, policy=make_policy(name, args), budget=None if name == "Dense" else args.budget,
                      max_model_len=args.prompt + args.cap, backend=args.backend, cuda_graph=args.cuda_graph,
                      prefill_chunk=args.prefill_chunk, max_kv_bytes=args.max_kv_bytes,
                      max_num_seqs=args.max_num_seqs or len(prompts))
    try:
        warm_up(sched, prompts)
        for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
            sched.add_request(f"r{i}", p.tolist(), RequestParams(max_tokens=n, temperature=0, ignore_eos=True))
        steps, done, step_s = 0, [], []
        t0 = time.perf_counter()
        while sched.has_unfinished():
            s0 = time.perf_counter()
            done += sched.step()
            step_s.append(time.perf_counter() - s0)
            steps += 1
        sync(device)
        elapsed = time.perf_counter() - t0
        bad = [o for o in done if o.finish_reason != "length" or len(o.token_ids) != lens[int(o.request_id[1:])]]
        if bad:
            raise RuntimeError(f"{name}: {len(bad)} requests did not decode their forced length "
                               f"({bad[0].finish_reason}: {bad[0].error!r})")
        held = held_slots(name, args)
        kv = sum(kv_read(args.prompt, n, held) for n in lens)
        fl = floor.seconds(steps=steps, kv_slots=kv, prefill_tokens=len(prompts) * args.prompt)
        step_ms = 1e3 * sorted(step_s)[len(step_s) // 2]
        return elapsed, steps, fl, sched.plan.rows, sched.max_resident, step_ms
    finally:
        sched.close()


def head_of_line(model, args, device) -> tuple[float, float]:
    """(the short request alone, the short request behind a decoding long one), seconds."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    short_p, long_p = (torch.randint(5, vocab, (args.prompt,), generator=g).tolist() for _ in range(2))
    sched = Scheduler(model, policy=make_policy(args.hol_policy, args), budget=args.budget,
                      max_model_len=args.prompt + max(args.hol_long, 4), backend=args.backend,
                      cuda_graph=args.cuda_graph, prefill_chunk=args.prefill_chunk, max_num_seqs=2)
    short = RequestParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run_short(tag: str) -> float:
        sched.add_request(tag, short_p, short)
        t0 = time.perf_counter()
        while not any(o.request_id == tag for o in sched.step()):
            pass
        sync(device)
        return time.perf_counter() - t0

    try:
        run_short("warm")
        alone = run_short("alone")
        sched.add_request("long", long_p, RequestParams(max_tokens=args.hol_long, temperature=0, ignore_eos=True))
        for _ in range(math.ceil(args.prompt / args.prefill_chunk) + 8):  # the long one is decoding
            sched.step()
        behind = run_short("behind")
        while sched.has_unfinished():
            sched.step()
        return alone, behind
    finally:
        sched.close()


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (the test suite)")
    ap.add_argument("--model", default="qwen3-0.6b", choices=tuple(SHAPES))
    ap.add_argument("--n", type=int, default=64, help="requests")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--mean", type=float, default=8192, help="mean response length before clipping")
    ap.add_argument("--cap", type=int, default=32768, help="longest response")
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths and prompts")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--buffer", type=int, default=128)
    ap.add_argument("--policies", default="rkv,streaming_llm", help="comma-separated: " + ",".join(POLICIES))
    ap.add_argument("--hf-n", type=int, default=4, help="requests of the HF row (0 = no HF row)")
    ap.add_argument("--hf-cap", type=int, default=256, help="longest response of the HF row")
    ap.add_argument("--static-batch", type=int, default=None, help="rows per static call (default: dense plan)")
    ap.add_argument("--no-static", action="store_true", help="skip the dense static row")
    ap.add_argument("--max-kv-gib", type=float, default=None, help="cap of every memory plan (GiB)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="rows resident at most (default: --n; "
                    "the scheduler runs every forward over all its rows, so more rows than requests is waste)")
    ap.add_argument("--hol-policy", default="rkv", choices=tuple(POLICIES))
    ap.add_argument("--hol-long", type=int, default=4096, help="tokens of the long head-of-line request")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    ap.add_argument("--out", default=None, help="append one JSON line per row")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        args.smoke = True
    if args.smoke:
        args.model, args.n, args.prompt, args.mean, args.cap = "smoke", 6, 12, 12, 40
        args.budget, args.buffer, args.prefill_chunk, args.hf_n, args.hf_cap = 12, 4, 8, 2, 8
        args.hol_long, args.cuda_graph, args.max_kv_gib = 60, False, args.max_kv_gib or 0.001
    args.max_kv_bytes = None if args.max_kv_gib is None else int(args.max_kv_gib * 2**30)
    return args


def main(argv=None) -> dict:
    args = _args(argv)
    setup(1 if args.smoke else 2)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    model = build(args.model, device, dtype)
    floor = Floor(model, bandwidth=copy_bandwidth(device, 2**22 if args.smoke else 2**31),
                  flops=matmul_rate(device, 256 if args.smoke else 8192, dtype))
    lens = lengths(args.n, mean=args.mean, cap=args.cap, seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(5, model.config.vocab_size, (args.prompt,), generator=g) for _ in range(args.n)]
    useful = sum(lens)
    mean = useful / len(lens)
    std = math.sqrt(sum((n - mean) ** 2 for n in lens) / len(lens))
    ctx_dense = sum(kv_read(args.prompt, n, math.inf) for n in lens) / useful
    ctx_sparse = sum(kv_read(args.prompt, n, args.budget + args.buffer / 2) for n in lens) / useful
    print(f"# bench_rollout_gpu ({machine()}, device {gpu})")
    print(f"{args.n} requests x ({args.prompt} prompt + lengths mean {mean:.0f}, std {std:.0f}, max {max(lens)}); "
          f"token-weighted KV read per token: dense {ctx_dense:.0f} slots, budget {args.budget} + buffer/2 "
          f"{ctx_sparse:.0f} ({ctx_dense / ctx_sparse:.2f}x); copy bandwidth {floor.bandwidth / 1e9:.0f} GB/s, "
          f"matmul {floor.flops / 1e12:.0f} TFLOP/s, weights {floor.weights / 2**30:.2f} GiB")
    for pol in [make_policy(n, args) for n in args.policies.split(",")]:  # one-time compiles out of the rows
        generate(model, prompts[0][None, :32].to(device), policy=pol, budget=16, max_new_tokens=3,
                 backend=args.backend, cuda_graph=args.cuda_graph)
    rows, records = [], []

    def keep(rec: dict) -> None:  # each row as it ends: a run cut short keeps what it measured
        records.append(rec)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def record(row: str, elapsed, steps, fl, plan_rows, resident, step_ms, peak):
        rec = dict(row=row, device=gpu, n=args.n, tokens=useful, seconds=elapsed, tokens_per_s=useful / elapsed,
                   steps=steps, floor_s=fl, x_floor=elapsed / fl, plan_rows=plan_rows, resident=resident,
                   step_ms=step_ms, peak_gib=peak / 2**30)
        keep(rec)
        rows.append([row, f"{useful / elapsed:,.0f}", f"{elapsed:.2f}", steps, f"{step_ms:.2f}", f"{fl:.2f}",
                     f"{elapsed / fl:.2f}x", plan_rows, resident, f"{peak / 2**30:.2f}"])

    def peak() -> int:
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0

    if args.hf_n:
        hl = [min(n, args.hf_cap) for n in lens]
        clean(device)
        t, tok, b, new = hf_row(model, prompts, hl, args, device)
        fl = floor.seconds(steps=new, kv_slots=b * kv_read(args.prompt, new, math.inf), prefill_tokens=b * args.prompt)
        rec = dict(row=f"HF generate (N={b}, <= {args.hf_cap} tokens)", device=gpu, n=b, tokens=tok, seconds=t,
                   tokens_per_s=tok / t, steps=new, floor_s=fl, x_floor=t / fl, peak_gib=peak() / 2**30)
        keep(rec)
        rows.append([rec["row"], f"{tok / t:,.0f}", f"{t:.2f}", new, f"{1e3 * t / new:.2f}", f"{fl:.2f}",
                     f"{t / fl:.2f}x", b, b, f"{rec['peak_gib']:.2f}"])
    results = {}
    for name in ["Dense", *args.policies.split(",")]:
        clean(device)
        try:
            elapsed, steps, fl, plan_rows, resident, step_ms = continuous_row(model, name, prompts, lens, args,
                                                                              device, floor)
        except torch.OutOfMemoryError:
            rows.append([f"{name} continuous", "OOM", *[""] * 8])
            continue
        results[name] = (elapsed, fl)
        record(f"{name} continuous", elapsed, steps, fl, plan_rows, resident, step_ms, peak())
        if name == "Dense" and not args.no_static:
            batch = args.static_batch or plan_rows
            clean(device)
            try:
                elapsed, steps, fl = static_row(model, prompts, lens, args, device, floor, batch)
                results["static"] = (elapsed, fl)
                record("Dense static (today's generate)", elapsed, steps, fl, batch, batch,
                       1e3 * elapsed / steps, peak())
            except torch.OutOfMemoryError:
                rows.append(["Dense static (today's generate)", "OOM", *[""] * 8])
    clean(device)
    alone, behind = head_of_line(model, args, device)
    print(table(["row", "tokens/s", "seconds", "steps", "median step ms", "floor s", "x floor", "plan rows",
                 "max resident", "peak GiB"], rows))
    base = results.get("static") or results.get("Dense")
    summary = dict(device=gpu, head_of_line=dict(alone_s=alone, behind_s=behind, slowdown=behind / alone))
    print(f"\nhead-of-line ({args.hol_policy}, a 4-token request behind a {args.hol_long}-token one): "
          f"{behind:.3f} s against {alone:.3f} s alone = {behind / alone:.2f}x (target <= 2x)")
    for name, (t, fl) in results.items():
        if base is None or name in ("static",):
            continue
        speed, predicted = base[0] / t, base[1] / fl
        summary[name] = dict(speedup=speed, floors_ratio=predicted, of_predicted=speed / predicted)
        print(f"{name} continuous vs dense {'static' if 'static' in results else 'continuous'}: {speed:.2f}x "
              f"faster; the floors predict {predicted:.2f}x ({speed / predicted:.0%} of it; target >= 80%)")
    keep(dict(row="summary", **summary))
    del model
    gc.collect()
    return summary


if __name__ == "__main__":
    main()
