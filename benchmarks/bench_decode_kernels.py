"""Kernel counts of one decode step and of one compression event, per policy and per layer.

A decode step's cost on a GPU is its kernel count (each launch ~2.5 µs even inside a CUDA graph),
so this benchmark counts, on the CPU, the kernel-launching aten ops one step dispatches:

- **the eager decode step** of a tiny bf16 Qwen3 through the public ``generate`` path (torch
  backend): every aten op under a ``TorchDispatchMode``, views and metadata-only ops excluded
  (allocations, ``_unsafe_view``, ``detach``, ...), each attributed to HF or to us by the innermost
  Python frame under ``transformers/`` or ``sparsecorr/`` (the torch backend's attention counts as
  ours). BlockTopK runs with ``dense_layers=0`` here, so its per-layer figure is a sparse
  layer's (a dense layer's is Dense's). One step = ops of ``generate(max_new_tokens=2)`` minus
  ops of ``max_new_tokens=1`` (one more forward and one more sampling; the budget is set so that
  no compression happens). The per-layer part is ``(count(4 layers) - count(2 layers)) / 2``;
  the rest is the once-per-step part. Rows of equal length (no mask in a step) and ragged rows
  (a mask in every step: the torch backend's masked single-token attention) are both counted
  (``--smoke``: equal rows only).
- **one compression event** at a realistic shape per layer (B=8, H_kv=8, H_q=16, S=2177, D=128,
  W=8, bf16 keys; ``--smoke``: a small one): ops and bytes moved (the sum over ops of input +
  output tensor bytes, each tensor counted at most at its storage size), for one layer's
  ``policies.compress`` call (scoring and the kept set) and for the engine's event
  (``SparseKVCache.compress`` over a pool of 28 layers: every layer scored, kept and compacted,
  per layer; on the CPU 2 layers, for memory). Each runs on this CPU and on the ``meta`` device,
  which dispatches the op sequence CUDA runs (mixed-precision GEMMs ``bf16 x bf16 -> fp32`` exist
  there; on the CPU the GEMM operands are upcast, which shows as extra copies). The pool's
  compaction is also counted alone (one layer; four layers in one ``compact_all``).
- **on CUDA** (when one is present) the same decode step under ``torch.profiler``: kernels per
  step (``--cuda``).

The fused step (``torch.compile`` of the layer inside our CUDA graph) is not built yet: its row
says so. Targets (issue 36): ours per layer <= 5 Dense, <= 4 StreamingLLM, <= 5 SnapKV and RKV,
<= 10 BlockTopK; one RKV compression <= 25 kernels and <= 4x the bf16 keys' bytes.

Run: ``python benchmarks/bench_decode_kernels.py [--smoke] [--json PATH] [--cuda]``. It only uses
``sparsecorr.decoding``'s public API, so the same script measures an older checkout
(``PYTHONPATH=<checkout>/src``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import machine, setup, table

from sparsecorr.decoding import RKV, BlockTopK, Dense, SnapKV, StreamingLLM, generate
from sparsecorr.decoding.policies import compress
from tests.models import tiny_model

# ops that launch no kernel: allocations, metadata, aliasing (views are detected from the schema)
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
         "detach", "alias", "lift_fresh", "lift_fresh_copy", "_reshape_alias", "set_", "resize_",
         "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_local_scalar_dense",
         "record_stream", "_has_compatible_shallow_copy_type", "result_type", "is_nonzero"}
TARGET_STEP = {"Dense": 5, "StreamingLLM": 4, "SnapKV": 5, "RKV": 5, "BlockTopK": 10}
TARGET_RKV_KERNELS, TARGET_RKV_BYTES = 25, 4.0


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _nbytes(t: torch.Tensor) -> int:
    try:
        storage = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        storage = t.numel() * t.element_size()
    return min(t.numel() * t.element_size(), storage)


def _who() -> tuple[str, str]:
    """(``"hf"`` | ``"ours"`` | ``"other"``, where): the innermost transformers/sparsecorr frame."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/sparsecorr/" in name and "/benchmarks/" not in name:
            return "ours", f"{name.rsplit('/sparsecorr/', 1)[1]}:{f.f_code.co_name}"
        if "/transformers/" in name:
            return "hf", f"{name.rsplit('/transformers/', 1)[1]}:{f.f_code.co_name}"
        f = f.f_back
    return "other", "?"


class KernelCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops (by owner and by frame) and the bytes they touch."""

    def __init__(self) -> None:
        super().__init__()
        self.by_owner: Counter = Counter()
        self.by_where: Counter = Counter()
        self.by_op: Counter = Counter()
        self.bytes_where: Counter = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if func.is_view or name in _FREE:
            return out
        owner, where = _who()
        self.by_owner[owner] += 1
        self.by_where[(owner, where)] += 1
        self.by_op[name] += 1
        moved = sum(_nbytes(t) for t in _tensors((args, kwargs))) + sum(_nbytes(t) for t in _tensors(out))
        self.bytes += moved
        self.bytes_where[where] += moved
        return out

    @property
    def total(self) -> int:
        return sum(self.by_owner.values())


# -- the decode step ------------------------------------------------------------------------------

def step_policies(smoke: bool) -> list[tuple[str, object]]:
    return [("Dense", Dense()), ("StreamingLLM", StreamingLLM()), ("SnapKV", SnapKV()), ("RKV", RKV()),
            ("BlockTopK", BlockTopK(page_size=4 if smoke else 16, dense_layers=0))]


def _model(layers: int, smoke: bool):
    kw = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16) if smoke else \
        dict(hidden_size=128, num_heads=8, num_kv_heads=4, head_dim=32)
    return tiny_model("qwen3", num_layers=layers, dtype=torch.bfloat16, **kw)


def _count_generate(model, ids, mask, policy, budget: int, steps: int) -> KernelCounter:
    counter = KernelCounter()
    with counter:
        # prefill one token per forward: a CausalBias (the aligned-chunk mask) cannot be built
        # under a dispatch mode; the prefill is the same in both counts and cancels
        generate(model, ids, mask, policy=policy, budget=budget, max_new_tokens=steps, temperature=0,
                 backend="torch", logprobs_topk=0, prefill_chunk=1)
    return counter


_WARM: set[int] = set()


def step_counts(policy, *, layers: int, smoke: bool, ragged: bool = False) -> dict[str, Counter]:
    """Ops of one eager decode step by owner (and by frame) for a ``layers``-deep model
    (``ragged``: the two rows' prompts differ by one token, so every step carries an attention
    mask)."""
    model = _model(layers, smoke)
    prompt = 2 if smoke else 32
    ids = torch.randint(3, 128, (2, prompt), generator=torch.Generator().manual_seed(0))
    mask = None
    if ragged:
        mask = torch.ones_like(ids)
        mask[1, 0] = 0
    budget = 4 * prompt  # no compression during the counted steps
    if layers not in _WARM:  # lazy initialisations happen outside the counts
        _count_generate(model, ids, mask, policy, budget, 2)
        _WARM.add(layers)
    a, b = (_count_generate(model, ids, mask, policy, budget, n) for n in (1, 2))
    return {"owner": Counter({k: b.by_owner[k] - a.by_owner[k] for k in ("hf", "ours", "other")}),
            "where": Counter({k: b.by_where[k] - a.by_where[k] for k in b.by_where | a.by_where})}


def step_table(smoke: bool) -> list[dict]:
    cases = [(name, pol, False) for name, pol in step_policies(smoke)]
    if not smoke:  # rows of different lengths: a mask in every step
        cases += [(name, pol, True) for name, pol in step_policies(smoke)]
    rows = []
    for name, pol, ragged in cases:
        c2, c4 = (step_counts(pol, layers=n, smoke=smoke, ragged=ragged) for n in (2, 4))
        per = {k: (c4["owner"][k] - c2["owner"][k]) / 2 for k in ("hf", "ours", "other")}
        once = {k: c2["owner"][k] - 2 * per[k] for k in ("hf", "ours", "other")}
        layer_where = {f"{k[0]} {k[1]}": (c4["where"][k] - c2["where"][k]) / 2 for k in c4["where"] | c2["where"]
                       if c4["where"][k] != c2["where"][k]}
        label = name + (", ragged rows" if ragged else "")
        rows.append({"policy": label, "name": name, "ragged": ragged, "per_layer": per,
                     "once_per_step": once, "per_layer_where": layer_where, "target_ours": TARGET_STEP[name]})
    return rows


# -- one compression event ------------------------------------------------------------------------

def compress_shape(smoke: bool) -> dict:
    return dict(b=2, h=2, g=2, s=300, d=64, w=8) if smoke else dict(b=8, h=8, g=2, s=2177, d=128, w=8)


def compress_inputs(shape: dict, device: str, seed: int = 0) -> dict:
    b, h, g, s, d, w = (shape[k] for k in ("b", "h", "g", "s", "d", "w"))
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16).to(device)
    queries = torch.randn(b, h * g, w, d, generator=gen).to(torch.bfloat16).to(device)
    counts = torch.full((b,), s).to(device)
    valid = (torch.arange(s, device=device) < counts[:, None])[:, None, :].expand(b, h, s)
    positions = torch.arange(s, device=device).expand(b, h, s)
    return dict(keys=keys, queries=queries, valid=valid, positions=positions)


def compress_counts(policy, shape: dict, device: str, layers: int = 1) -> dict:
    """Ops and bytes of ``compress`` for one layer (scoring + kept set), on ``device``; with
    ``layers > 1``, of one call over ``layers`` layers stacked along the batch axis (what a
    batched compression event runs), divided by ``layers``."""
    shape = {**shape, "b": shape["b"] * layers}
    inp = compress_inputs(shape, device)
    budget = torch.full((shape["b"],), shape["s"] // 2 - getattr(policy, "buffer", 0), device=device)
    kw = dict(budget=budget, max_budget=shape["s"] // 2 - getattr(policy, "buffer", 0), **inp)
    if device != "meta":
        compress(policy, **kw)  # warm-up
    counter = KernelCounter()
    with counter:
        compress(policy, **kw)
    key_bytes = inp["keys"].numel() * inp["keys"].element_size()
    return {"ops": counter.total / layers, "bytes": counter.bytes / layers, "key_bytes": key_bytes / layers,
            "ratio": counter.bytes / key_bytes, "by_op": dict(counter.by_op), "layers": layers}


def _event_pool(policy, shape: dict, device: str, layers: int):
    """A ``layers``-deep pool holding ``S`` valid slots per row (random bf16 keys off ``meta``)
    and the cache over it, as the engine builds them."""
    from sparsecorr.decoding.backends import TorchBackend
    from sparsecorr.decoding.cache import SparseKVCache
    from sparsecorr.decoding.pool import KVPool

    b, h, g, s, d, _ = (shape[k] for k in ("b", "h", "g", "s", "d", "w"))
    window = getattr(policy, "window", 0) if policy.evicts else 0
    pool = KVPool(layers=layers, batch=b, kv_heads=h, q_heads=h * g, head_dim=d, capacity=s, page_size=16,
                  dtype=torch.bfloat16, device=torch.device(device), positions=True, window=window,
                  summaries=False, grad=False)
    cache = SparseKVCache(pool, policy=policy, backend=TorchBackend())
    if device != "meta":
        gen = torch.Generator().manual_seed(0)
        for i in range(layers):
            pool.k[i].copy_(torch.randn(pool.k[i].shape, generator=gen))
            pool.pos[i].copy_(torch.arange(pool.pos[i].shape[-1]))
        if getattr(pool, "norms_all", None) is not None:  # the norms the writes would have stored
            pool.add_key_norms(torch.arange(pool.k[0].shape[2], device=device).expand(b, -1))
    return pool, cache


def event_counts(policy, shape: dict, device: str, layers: int) -> dict:
    """Ops of one compression event of a ``layers``-deep pool (``SparseKVCache.compress``: scoring,
    kept sets and the compaction of every layer), per layer; its bytes without the compaction
    (reported apart) per layer, and against the bf16 keys of all layers."""
    b, s = shape["b"], shape["s"]
    budget = s // 2 - getattr(policy, "buffer", 0)
    budgets, counts = torch.full((b,), budget), torch.full((b,), s)
    pool, cache = _event_pool(policy, shape, device, layers)
    order = None
    if pool.win is not None:
        order = (torch.full((b,), s)[:, None] + torch.arange(pool.window)) % pool.window
        order = order.to(device)
    counter = KernelCounter()
    with counter:
        cache.compress(budgets, counts, None, order=order)
    key_bytes = layers * b * shape["h"] * s * shape["d"] * 2
    # the compaction (pool.py's compact / compact_all) apart: the target is on the scoring and kept sets
    comp = {k: v for k, v in counter.bytes_where.items() if k.startswith("decoding/pool.py:compact")}
    comp_ops = sum(v for (_, k), v in counter.by_where.items() if k.startswith("decoding/pool.py:compact"))
    scoring = counter.bytes - sum(comp.values())
    return {"ops": counter.total / layers, "bytes": scoring / layers, "key_bytes": key_bytes / layers,
            "ratio": scoring / key_bytes, "compaction_ops": comp_ops / layers,
            "compaction_bytes": sum(comp.values()) / layers, "by_op": dict(counter.by_op), "layers": layers}


def compaction_counts(shape: dict, layers: int = 1) -> dict:
    """Ops and bytes of the pool's compaction (pool.py), per layer: ``KVPool.compact`` of one
    layer, or with ``layers > 1`` ``KVPool.compact_all`` of every layer where the pool has it."""
    from sparsecorr.decoding.pool import KVPool

    b, h, g, s, d, w = (shape[k] for k in ("b", "h", "g", "s", "d", "w"))
    pool = KVPool(layers=layers, batch=b, kv_heads=h, q_heads=h * g, head_dim=d, capacity=s, page_size=16,
                  dtype=torch.bfloat16, device=torch.device("cpu"), positions=True, window=w,
                  summaries=False, grad=False)
    index = torch.arange(s // 2).expand(layers, b, h, s // 2)
    counter = KernelCounter()
    with counter:
        if layers > 1 and hasattr(pool, "compact_all"):
            pool.compact_all(index)
        else:
            for i in range(layers):
                pool.compact(i, index[i])
    return {"ops": counter.total / layers, "bytes": counter.bytes / layers, "layers": layers}


EVENT_LAYERS = 28  # Qwen3-0.6B's depth


def compress_table(smoke: bool) -> list[dict]:
    shape = compress_shape(smoke)
    rows = []
    for name, pol in [("StreamingLLM", StreamingLLM()), ("SnapKV", SnapKV()), ("RKV", RKV())]:
        row = {"policy": name, "shape": shape}
        for device in ("cpu", "meta"):
            try:
                row[device] = compress_counts(pol, shape, device)
            except (RuntimeError, NotImplementedError) as exc:  # an op without a meta kernel
                row[device] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        rows.append(row)
    # the engine's event: every layer of a pool in one SparseKVCache.compress call (scoring, kept
    # sets, compaction), per layer; CPU at 2 layers (memory), CUDA's op sequence at 28
    for name, pol in [("SnapKV", SnapKV()), ("RKV", RKV())]:
        rows.append({"policy": f"{name}, event of {EVENT_LAYERS} layers (cache.compress), per layer", "shape": shape,
                     "event": True, "cpu": event_counts(pol, shape, "cpu", 2),
                     "meta": event_counts(pol, shape, "meta", EVENT_LAYERS)})
    rows.append({"policy": "compaction (pool.py), 1 layer", "shape": shape, "cpu": compaction_counts(shape)})
    rows.append({"policy": "compaction (pool.py), 4 layers in one call, per layer", "shape": shape,
                 "cpu": compaction_counts(shape, 4)})
    return rows


# -- CUDA: torch.profiler kernels per step ----------------------------------------------------------

def cuda_kernels_per_step(smoke: bool) -> list[dict]:  # pragma: no cover - needs CUDA
    """Kernels per decode step from ``torch.profiler`` (CUDA): kernels of ``generate`` with 3 and
    with 2 new tokens, differenced, eager and with ``cuda_graph=True``."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(model, ids, pol, steps, graph):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(model, ids, policy=pol, budget=4 * ids.shape[1], max_new_tokens=steps, temperature=0,
                     logprobs_topk=0, cuda_graph=graph)
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)

    rows = []
    for layers in (2, 4):
        model = _model(layers, smoke).cuda()
        ids = torch.randint(3, 128, (2, 40), device="cuda")
        for name, pol in step_policies(smoke):
            for graph in (False, True):
                kernels(model, ids, pol, 2, graph)
                n = kernels(model, ids, pol, 3, graph) - kernels(model, ids, pol, 2, graph)
                rows.append({"policy": name, "layers": layers, "cuda_graph": graph, "kernels_per_step": n})
    return rows


# -- the tables ------------------------------------------------------------------------------------

def _fmt(x: float) -> str:
    return f"{x:g}" if x == int(x) else f"{x:.1f}"


def print_tables(result: dict) -> None:
    print(f"# decode kernel counts ({machine()}{', smoke' if result['smoke'] else ''})\n")
    rows = []
    for r in result["step"]:
        ours, t = r["per_layer"]["ours"], r["target_ours"]
        rows.append([r["policy"], _fmt(r["per_layer"]["hf"]), _fmt(ours), _fmt(r["per_layer"]["other"]),
                     _fmt(r["once_per_step"]["hf"]), _fmt(r["once_per_step"]["ours"]), f"<= {t}",
                     "met" if ours <= t else "missed"])
    rows.append(["fused step (compile)", "not built yet", "", "", "", "", "<= 16 total", "not built yet"])
    print("## eager decode step (torch backend): ops per layer and once per step\n")
    print(table(["policy", "HF/layer", "ours/layer", "other/layer", "HF/step", "ours/step", "target ours/layer",
                 ""], rows))
    print("\n## our per-layer ops by function\n")
    for r in result["step"]:
        parts = sorted(((v, k) for k, v in r["per_layer_where"].items() if k.startswith("ours")), reverse=True)
        print(f"- {r['policy']}: " + ", ".join(f"{k.split(' ', 1)[1]} {_fmt(v)}" for v, k in parts))
    print("\n## one compression event: one layer's policies.compress call, and the engine's event over "
          f"{EVENT_LAYERS} layers (CPU: 2) per layer, shape "
          + ", ".join(f"{k}={v}" for k, v in result["compress"][0]["shape"].items()) + "\n")
    rows = []
    for r in result["compress"]:
        cells = [r["policy"]]
        for device in ("cpu", "meta"):
            c = r.get(device)
            if c is None:
                cells += ["", "", ""]
            elif "error" in c:
                cells += ["error", c["error"][:40], ""]
            else:
                cells += [_fmt(c["ops"]), f"{c['bytes'] / 2**20:.0f}",
                          f"{c['ratio']:.2f}x" if "ratio" in c else ""]
        if r["policy"].startswith("RKV") and r.get("event") and "ops" in r.get("meta", {}):
            m = r["meta"]
            ops_ok, bytes_ok = m["ops"] <= TARGET_RKV_KERNELS, m["ratio"] <= TARGET_RKV_BYTES
            cells.append(f"<= {TARGET_RKV_KERNELS} ops: {'met' if ops_ok else 'missed'}; "
                         f"<= {TARGET_RKV_BYTES:g}x: {'met' if bytes_ok else 'missed'} (CUDA ops)")
        else:
            cells.append("")
        rows.append(cells)
    print(table(["policy", "CPU ops", "CPU MiB", "CPU / keys", "CUDA ops (meta)", "CUDA MiB", "CUDA / keys",
                 "target"], rows))
    for r in result["compress"]:
        m = r.get("meta", {})
        if r.get("event") and "compaction_ops" in m:
            print(f"- {r['policy']}: MiB and / keys without the compaction; the compaction adds "
                  f"{_fmt(m['compaction_ops'])} ops and {m['compaction_bytes'] / 2**20:.0f} MiB per layer (CUDA ops)")
    if result.get("cuda"):
        print("\n## CUDA: kernels per decode step (torch.profiler)\n")
        print(table(["policy", "layers", "cuda_graph", "kernels/step"],
                    [[r["policy"], r["layers"], r["cuda_graph"], r["kernels_per_step"]] for r in result["cuda"]]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="small model and compression shape (seconds)")
    ap.add_argument("--json", type=Path, help="write the counts as JSON here")
    ap.add_argument("--cuda", action="store_true", help="also profile kernels per step on CUDA")
    args = ap.parse_args(argv)
    setup(2)
    torch.manual_seed(0)
    result = {"smoke": args.smoke, "step": step_table(args.smoke), "compress": compress_table(args.smoke)}
    if args.cuda and torch.cuda.is_available():
        result["cuda"] = cuda_kernels_per_step(args.smoke)
    print_tables(result)
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(args.json)
    return result


if __name__ == "__main__":
    main()
