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
  the rest is the once-per-step part. The K/V write is our op ``sparsecorr::write_kv``: on the
  CPU its kernel, two ``scatter_``, is counted op by op; on CUDA it is one Triton kernel, so
  "ours/layer (CUDA)" counts it as one launch (likewise the fused step's "total/layer (CUDA)").
  Rows of equal length (no mask in a step) and ragged rows
  (a mask in every step: the torch backend's masked single-token attention) are both counted
  (``--smoke``: equal rows only).
- **one compression event** at a realistic shape per layer (B=8, H_kv=8, H_q=16, S=2177, D=128,
  W=8, bf16 keys; ``--smoke``: a small one): ops and bytes moved (the sum over ops of input +
  output tensor bytes, each tensor counted at most at its storage size), for one layer's
  ``policies.compress`` call (scoring and the kept set) and for the engine's event
  (``SparseKVCache.compress`` over a pool of 28 layers: every layer scored, kept and compacted,
  per layer; on the CPU 2 layers, for memory). Each runs on this CPU and on the ``meta`` device,
  which dispatches the op sequence CUDA runs (mixed-precision GEMMs ``bf16 x bf16 -> fp32`` exist
  there; on the CPU the GEMM operands are upcast, which shows as extra copies). The votes op
  ``sparsecorr::window_votes`` (one Triton kernel on CUDA) counts as one op on ``meta`` (its
  fake kernel: the logits, mask and weights in, the votes out); on the CPU its kernel, the
  stock chain, is counted op by op. The pool's
  compaction is also counted alone (one layer; four layers in one ``compact_all``).
- **on CUDA** (when one is present) the same decode step under ``torch.profiler``: kernels per
  step (``--cuda``).
- **the compression events of one ``generate`` call** per eviction policy, in the GPU table's
  order and then again (StreamingLLM, SnapKV, RKV, SnapKV, RKV in one process): how many events,
  the valid slots before each, each event's seconds, the decode ms/token (capture excluded) and
  the graph captures / dynamo graphs of the call. It tells apart a policy that compresses more
  often, one whose events cost more, and one that pays a one-time cost (its first call slower
  than its second). ``--schedule-only`` runs this part alone; with ``--cuda`` at the GPU table's
  32k cell (Qwen3-0.6B's shape, B=8, budget 2048, CUDA graphs).

- **the fused step** (``generate(..., cuda_graph=True, fused=True)``, `sparsecorr.decoding.fused`):
  the captured step's forward compiled by inductor (its C++ backend here; Triton on CUDA). Its
  launches are read from the code inductor generates, not timed or sampled: the wrapper's
  ``call()`` runs one line per launch, so the benchmark counts, in the wrapper of a fresh compile
  (``torch._inductor.utils.run_and_get_code``), the generated kernels (``cpp_fused_*`` /
  ``triton_*``), the extern kernels (``extern_kernels.mm``: the 7 GEMMs of a layer), fallback aten
  ops and our custom op ``sparsecorr::attend``; the op itself is opaque to inductor, so the aten
  ops it dispatches (K/V write, ring write, attention) are counted under the dispatch mode above,
  in ``generate(3 tokens) - generate(2 tokens)`` (one replayed step; on the CPU the captured step
  runs through the eager stand-in runner, the same compiled code minus the capture). Per layer =
  ``(4 layers - 2 layers) / 2``; "compile s" is the 2-layer model's first step with inductor's
  caches off (a cold compile; the first compile in a process also pays inductor's start-up).
  ``--smoke``: Dense and RKV only; ``--no-fused``: skipped.

Targets (issue 36): ours per layer <= 5 Dense, <= 4 StreamingLLM, <= 5 SnapKV and RKV,
<= 10 BlockTopK; the fused step <= 16 launches per layer for the eviction policies (BlockTopK
reported); one RKV compression <= 25 kernels and <= 4x the bf16 keys' bytes.

Run: ``python benchmarks/bench_decode_kernels.py [--smoke] [--json PATH] [--cuda] [--schedule-only]``. It only uses
``sparsecorr.decoding``'s public API, so the same script measures an older checkout
(``PYTHONPATH=<checkout>/src``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import machine, setup, table

from sparsecorr.decoding import RKV, BlockTopK, Dense, SnapKV, StreamingLLM, generate
from sparsecorr.decoding.kernels import votes_reference, write_kv_reference
from sparsecorr.decoding.policies import compress
from tests.models import tiny_model

# ops that launch no kernel: allocations, metadata, aliasing (views are detected from the schema)
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
         "detach", "alias", "lift_fresh", "lift_fresh_copy", "_reshape_alias", "set_", "resize_",
         "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_local_scalar_dense",
         "record_stream", "_has_compatible_shallow_copy_type", "result_type", "is_nonzero"}
TARGET_STEP = {"Dense": 5, "StreamingLLM": 4, "SnapKV": 5, "RKV": 5, "BlockTopK": 10}
TARGET_RKV_KERNELS, TARGET_RKV_BYTES = 25, 4.0
_GATHERS = {"gather", "index_select"}  # (source, dim, index): see KernelCounter.bytes_gathered
TARGET_FUSED = 16  # launches per layer of the fused step (eviction policies)
# our custom ops with a fused Triton kernel on CUDA and the stock chain as their kernel elsewhere
_STOCK = {"window_votes": votes_reference, "write_kv": write_kv_reference}


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
        # launches CUDA saves: a fused op's stock ops counted here, minus its one kernel there
        self.saved_on_cuda: Counter = Counter()
        self.by_where: Counter = Counter()
        self.by_op: Counter = Counter()
        self.bytes_where: Counter = Counter()
        # the same with a gather's source counted as the elements it reads (`bytes` counts all of it)
        self.bytes_gathered = 0
        self.bytes_gathered_where: Counter = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if func.namespace == "sparsecorr" and name in _STOCK and args[0].device.type != "meta":
            before = self.total
            with self:  # off CUDA the op's kernel is the stock chain: count its ops (on meta: the fused op's)
                out = _STOCK[name](*args, **kwargs)
            self.saved_on_cuda[_who()[0]] += self.total - before - 1
            return out
        out = func(*args, **kwargs)
        if func.is_view or name in _FREE:
            return out
        owner, where = _who()
        self.by_owner[owner] += 1
        self.by_where[(owner, where)] += 1
        self.by_op[name] += 1
        moved = sum(_nbytes(t) for t in _tensors((args, kwargs))) + sum(_nbytes(t) for t in _tensors(out))
        self.bytes += moved
        self.bytes_where[where] += moved
        if name in _GATHERS:  # the kernel reads the index and only the gathered elements of its source
            moved = 2 * _nbytes(out) + _nbytes(args[2])
        self.bytes_gathered += moved
        self.bytes_gathered_where[where] += moved
        return out

    @property
    def total(self) -> int:
        return sum(self.by_owner.values())

    @property
    def total_on_cuda(self) -> int:
        """The total with each fused op as one launch, as CUDA runs it."""
        return self.total - sum(self.saved_on_cuda.values())


# -- the decode step ------------------------------------------------------------------------------

def step_policies(smoke: bool) -> list[tuple[str, object]]:
    return [("Dense", Dense()), ("StreamingLLM", StreamingLLM()), ("SnapKV", SnapKV()), ("RKV", RKV()),
            ("BlockTopK", BlockTopK(page_size=4 if smoke else 16, dense_layers=0))]


def _model(layers: int, smoke: bool):
    kw = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16) if smoke else \
        dict(hidden_size=128, num_heads=8, num_kv_heads=4, head_dim=32)
    return tiny_model("qwen3", num_layers=layers, dtype=torch.bfloat16, **kw)


def _count_generate(model, ids, mask, policy, budget: int, steps: int, backend=None) -> KernelCounter:
    counter = KernelCounter()
    with counter:
        # prefill one token per forward: a CausalBias (the aligned-chunk mask) cannot be built
        # under a dispatch mode; the prefill is the same in both counts and cancels
        generate(model, ids, mask, policy=policy, budget=budget, max_new_tokens=steps, temperature=0,
                 backend=backend() if backend else "torch", logprobs_topk=0, prefill_chunk=1)
    return counter


_WARM: set[int] = set()


def step_counts(policy, *, layers: int, smoke: bool, ragged: bool = False, backend=None) -> dict[str, Counter]:
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
    a, b = (_count_generate(model, ids, mask, policy, budget, n, backend) for n in (1, 2))
    return {"owner": Counter({k: b.by_owner[k] - a.by_owner[k] for k in ("hf", "ours", "other")}),
            "saved_on_cuda": Counter({k: b.saved_on_cuda[k] - a.saved_on_cuda[k] for k in ("hf", "ours", "other")}),
            "where": Counter({k: b.by_where[k] - a.by_where[k] for k in b.by_where | a.by_where})}


def step_table(smoke: bool) -> list[dict]:
    cases = [(name, pol, False) for name, pol in step_policies(smoke)]
    if not smoke:  # rows of different lengths: a mask in every step
        cases += [(name, pol, True) for name, pol in step_policies(smoke)]
    rows = []
    for name, pol, ragged in cases:
        c2, c4 = (step_counts(pol, layers=n, smoke=smoke, ragged=ragged) for n in (2, 4))
        per = {k: (c4["owner"][k] - c2["owner"][k]) / 2 for k in ("hf", "ours", "other")}
        # ours per layer as CUDA launches them (sparsecorr::write_kv one kernel, not two scatters)
        per["ours_on_cuda"] = per["ours"] - (c4["saved_on_cuda"]["ours"] - c2["saved_on_cuda"]["ours"]) / 2
        once = {k: c2["owner"][k] - 2 * per[k] for k in ("hf", "ours", "other")}
        layer_where = {f"{k[0]} {k[1]}": (c4["where"][k] - c2["where"][k]) / 2 for k in c4["where"] | c2["where"]
                       if c4["where"][k] != c2["where"][k]}
        label = name + (", ragged rows" if ragged else "")
        rows.append({"policy": label, "name": name, "ragged": ragged, "per_layer": per,
                     "once_per_step": once, "per_layer_where": layer_where, "target_ours": TARGET_STEP[name]})
    return rows


# the frames of BlockTopK's page selection and of its write into a paged kernel's table
_SELECTION = ("decoding/policies/block_topk.py:", "decoding/policies/base.py:matmul_f32",
              "decoding/backends/paging.py:scatter_selected_pages")


def paged_selection(smoke: bool) -> dict:
    """BlockTopK's selection on the paged path (a GPU's: FlashInfer's page tables; here the
    float32 paged oracle behind the same kernel interface): the ops per sparse layer of one
    eager decode step that rank the pages and write them into the kernel's table, by function
    (the kernel's own ops, and everything not in `_SELECTION`'s frames, left out)."""
    from sparsecorr.decoding.backends.paged import PagedBackend, ReferenceDecodeKernel

    def backend():
        return PagedBackend(ReferenceDecodeKernel, name="paged-oracle")

    pol = dict(step_policies(smoke))["BlockTopK"]
    c2, c4 = (step_counts(pol, layers=n, smoke=smoke, backend=backend) for n in (2, 4))
    where = {k[1]: (c4["where"][k] - c2["where"][k]) / 2 for k in c4["where"] | c2["where"]
             if k[1].startswith(_SELECTION) and c4["where"][k] != c2["where"][k]}
    return {"per_layer": sum(where.values()), "where": where}


# -- the fused step (torch.compile of the captured step) ----------------------------------------------

# the wrapper inductor generates runs, in ``call()``, one line per launch: a generated kernel
# (``cpp_fused_*(...)`` on the CPU, ``triton_*.run(...)`` on CUDA), an extern kernel
# (``extern_kernels.mm(...)``: GEMMs), a fallback aten op or our custom op (``torch.ops.<ns>.<op>``)
_LAUNCH = {"inductor": re.compile(r"^\s*(?:cpp_fused_\w+|triton_\w+(?:\.run)?)\("),
           "extern": re.compile(r"^\s*(?:\w+ = )?extern_kernels\.\w+\("),
           "aten": re.compile(r"^\s*(?:\w+ = )?(?:torch\.ops\.)?aten\.\w+(?:\.\w+)?\("),
           "custom": re.compile(r"^\s*(?:\w+ = )?torch\.ops\.sparsecorr\.\w+(?:\.\w+)?\(")}


def wrapper_launches(code: str) -> Counter:
    """Launches in the ``call()`` of inductor's generated wrapper ``code``, by kind."""
    body = code[code.index("def call("):]
    out: Counter = Counter()
    for line in body.splitlines()[1:]:
        if line and not line.startswith(" "):  # the end of call()
            break
        for kind, pattern in _LAUNCH.items():
            if pattern.match(line):
                out[kind] += 1
                break
    return out


def fused_counts(policy, *, layers: int, smoke: bool) -> dict:
    """Launches of one fused decode step for a ``layers``-deep model: inductor's wrapper code of
    the compiled forward (compiled afresh; the captured step on the CPU runs through the eager
    stand-in runner, the same compile as on a GPU minus the capture), and the aten ops our custom
    op ``sparsecorr::attend`` dispatches inside (K/V write and attention, counted under the
    dispatch mode in ``generate(3 tokens) - generate(2 tokens)``: one replayed step)."""
    from torch._inductor.utils import run_and_get_code

    from sparsecorr.decoding import graphs
    from sparsecorr.decoding.cache import SparseKVCache

    model = _model(layers, smoke)
    ids = torch.randint(3, 128, (2, 2 if smoke else 32), generator=torch.Generator().manual_seed(0))
    kw = dict(policy=policy, budget=4 * ids.shape[1], temperature=0, backend="torch", logprobs_topk=0,
              cuda_graph=True, fused=True)
    saved = graphs.CudaGraphRunner, graphs.check_graph_device
    graphs.CudaGraphRunner, graphs.check_graph_device = graphs.EagerRunner, lambda device: None
    inner = KernelCounter()
    methods = {name: getattr(SparseKVCache, name) for name in ("write", "attend")}

    def counted(fn):  # the prefill's writes and attention count too: the difference cancels them
        def run(*a, **k):
            with inner:
                return fn(*a, **k)
        return run

    try:
        torch._dynamo.reset()
        t0 = time.perf_counter()
        with torch._inductor.config.patch(force_disable_caches=True):  # a cold compile (no disk cache)
            out, codes = run_and_get_code(lambda: generate(model, ids, max_new_tokens=2, **kw))
        compile_s = time.perf_counter() - t0
        if out.meta["fused"] != "on":
            raise RuntimeError(f"the fused step did not run: {out.meta['fused']}")
        for name, fn in methods.items():
            setattr(SparseKVCache, name, counted(fn))
        counts = []
        for steps in (2, 3):
            inner.by_owner.clear()
            inner.saved_on_cuda.clear()
            generate(model, ids, max_new_tokens=steps, **kw)
            counts.append((inner.total, inner.total_on_cuda))
    finally:
        for name, fn in methods.items():
            setattr(SparseKVCache, name, fn)
        graphs.CudaGraphRunner, graphs.check_graph_device = saved
    wrapper = Counter()
    for code in codes:  # one compile (batch 2)
        wrapper += wrapper_launches(code)
    return {"wrapper": dict(wrapper), "in_custom_op": counts[1][0] - counts[0][0],
            "in_custom_op_on_cuda": counts[1][1] - counts[0][1], "compiles": len(codes),
            "compile_s": compile_s}


def fused_table(smoke: bool) -> list[dict]:
    """Per policy: the fused step's launches per layer (``(4 layers - 2 layers) / 2``) and once
    per step, and the compile seconds (the 2-layer model's first step, compile included)."""
    rows = []
    for name, pol in step_policies(smoke):
        if smoke and name not in ("Dense", "RKV"):  # smoke: Dense and one eviction policy (4 compiles)
            continue
        c2, c4 = (fused_counts(pol, layers=n, smoke=smoke) for n in (2, 4))
        kinds = ("inductor", "extern", "aten", "custom")
        per = {k: (c4["wrapper"].get(k, 0) - c2["wrapper"].get(k, 0)) / 2 for k in kinds}
        per["in_custom_op"] = (c4["in_custom_op"] - c2["in_custom_op"]) / 2
        per["in_custom_op_on_cuda"] = (c4["in_custom_op_on_cuda"] - c2["in_custom_op_on_cuda"]) / 2
        per["total"] = sum(per[k] for k in kinds if k != "custom") + per["in_custom_op"]
        per["total_on_cuda"] = per["total"] - per["in_custom_op"] + per["in_custom_op_on_cuda"]
        once = {k: c2["wrapper"].get(k, 0) - 2 * per[k] for k in kinds}
        rows.append({"policy": name, "per_layer": per, "once_per_step": once, "target": TARGET_FUSED,
                     "compile_s": c2["compile_s"], "compiles": c2["compiles"] + c4["compiles"],
                     "torch": torch.__version__})
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
    pool = KVPool(layers=layers, batch=b, kv_heads=h, head_dim=d, capacity=s, page_size=16,
                  dtype=torch.bfloat16, device=torch.device(device), positions=True, grad=False)
    state = policy.new_state(pool, q_heads=h * g, table=torch.full((s + 1,), s))
    cache = SparseKVCache(pool, policy=policy, state=state, backend=TorchBackend())
    if device != "meta":
        gen = torch.Generator().manual_seed(0)
        for i in range(layers):
            pool.k[i].copy_(torch.randn(pool.k[i].shape, generator=gen))
            pool.pos[i].copy_(torch.arange(pool.pos[i].shape[-1]))
        if getattr(state, "norms_all", None) is not None:  # the norms the writes would have stored
            state.add_key_norms(torch.arange(pool.k[0].shape[2], device=device).expand(b, -1))
    if getattr(state, "unit_sum_all", None) is not None:  # steady state: the unit sums cover all
        done = s - policy.buffer  # but the `buffer` tokens decoded since the last event
        state.sync_unit_sums(torch.full((b,), done, device=device), low=done, high=done)
    return pool, cache


def _counted(fn, counter: KernelCounter):
    """``fn`` run under its own (nested) ``counter`` as well."""
    def run(*args, **kw):
        with counter:
            return fn(*args, **kw)
    return run


# the frames of a compaction: the pool's, and the key norms R-KV's state compacts with the keys
_COMPACTION = ("decoding/pool.py:compact", "decoding/policies/rkv.py:compacted")


def event_counts(policy, shape: dict, device: str, layers: int, *, steady: bool = False) -> dict:
    """Ops of one compression event of a ``layers``-deep pool (``SparseKVCache.compress``: scoring,
    kept sets and the compaction of every layer), per layer; its bytes without the compaction
    (reported apart) per layer, and against the bf16 keys of all layers."""
    b, s = shape["b"], shape["s"]
    # the table's event halves the cache; ``steady``: the decode's event, from budget + buffer to budget
    budget = s - policy.buffer if steady else s // 2 - getattr(policy, "buffer", 0)
    budgets, counts = torch.full((b,), budget), torch.full((b,), s)
    _, cache = _event_pool(policy, shape, device, layers)
    state = cache.state
    # R-KV's unit-key sums kept beside the pool: counted in the event, and apart (a nested counter)
    unit = {}
    for name in ("sync_unit_sums", "drop_unit_sums", "keep_unit_sums"):
        if getattr(state, "unit_sum_all", None) is not None:
            unit[name] = KernelCounter()
            setattr(state, name, _counted(getattr(state, name), unit[name]))
    # every row has seen a full window: the ring is read in order, no query masked
    ctx = torch.full((b,), s)
    # the ring's preparation of the event (its time order, the window mask), counted apart too:
    # the engine made it outside this call before the policies held their own state
    from sparsecorr.decoding.policies import RingState

    ring, ring_event = KernelCounter(), RingState.event
    RingState.event = _counted(ring_event, ring)
    counter = KernelCounter()
    try:
        with counter:
            cache.compress(budgets, counts, ctx)
    finally:
        RingState.event = ring_event
    key_bytes = layers * b * shape["h"] * s * shape["d"] * 2
    # the compaction (the pool's compact / compact_all, and R-KV's key norms compacted with the
    # keys) apart: the target is on the scoring and kept sets
    comp = {k: v for k, v in counter.bytes_where.items() if k.startswith(_COMPACTION)}
    comp_ops = sum(v for (_, k), v in counter.by_where.items() if k.startswith(_COMPACTION))
    scoring = counter.bytes - sum(comp.values())
    comp_g = sum(v for k, v in counter.bytes_gathered_where.items() if k.startswith(_COMPACTION))
    scoring_g = counter.bytes_gathered - comp_g
    return {"ops": counter.total / layers, "bytes": scoring / layers, "key_bytes": key_bytes / layers,
            "ratio": scoring / key_bytes, "compaction_ops": comp_ops / layers,
            "compaction_bytes": sum(comp.values()) / layers,
            "ratio_gathered": scoring_g / key_bytes, "compaction_bytes_gathered": comp_g / layers,
            "unit_sums": {k: {"ops": c.total / layers, "ratio": c.bytes / key_bytes,
                              "ratio_gathered": c.bytes_gathered / key_bytes} for k, c in unit.items()},
            "ring_event_ops": ring.total / layers, "by_op": dict(counter.by_op), "layers": layers}


def compaction_counts(shape: dict, layers: int = 1) -> dict:
    """Ops and bytes of the pool's compaction (pool.py), per layer: ``KVPool.compact`` of one
    layer, or with ``layers > 1`` ``KVPool.compact_all`` of every layer where the pool has it."""
    from sparsecorr.decoding.pool import KVPool

    b, h, s, d = (shape[k] for k in ("b", "h", "s", "d"))
    pool = KVPool(layers=layers, batch=b, kv_heads=h, head_dim=d, capacity=s, page_size=16,
                  dtype=torch.bfloat16, device=torch.device("cpu"), positions=True, grad=False)
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
    rows.append({"policy": f"RKV, decode's event (S = budget + buffer: evicts {RKV().buffer} of {shape['s']}) of "
                           f"{EVENT_LAYERS} layers, per layer", "shape": shape, "event": True,
                 "cpu": event_counts(RKV(), shape, "cpu", 2, steady=True),
                 "meta": event_counts(RKV(), shape, "meta", EVENT_LAYERS, steady=True)})
    rows.append({"policy": "compaction (pool.py), 1 layer", "shape": shape, "cpu": compaction_counts(shape)})
    rows.append({"policy": "compaction (pool.py), 4 layers in one call, per layer", "shape": shape,
                 "cpu": compaction_counts(shape, 4)})
    return rows


# -- compression events of a generate call, in the GPU table's order --------------------------------

SCHEDULE_ORDER = ("StreamingLLM", "SnapKV", "RKV", "SnapKV", "RKV")  # the GPU table's order, then again


def _spied_compress(events: list, device: torch.device):
    """`SparseKVCache.compress` wrapped: each event's valid slots before it (the longest row) and
    its seconds (synchronised before and after on CUDA) are appended to ``events``."""
    from sparsecorr.decoding.cache import SparseKVCache

    real = SparseKVCache.compress

    def spy(self, budgets, counts, *args, **kw):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = real(self, budgets, counts, *args, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        events.append((int(counts.max()), time.perf_counter() - t0))
        return out

    return SparseKVCache, real, spy


def event_schedule(smoke: bool, *, cuda: bool = False) -> list[dict]:
    """One process, the eviction policies in `SCHEDULE_ORDER` at the GPU table's proportions
    (budget, buffer 128, 144 new tokens; the prompt longer than budget + buffer): per ``generate``
    call, its compression events (valid slots before each: the prefill's, then the decode's at
    budget + buffer), each event's seconds, the decode seconds per token after the first
    (capture excluded, as ``bench_decoding_gpu``), the graph captures, what ran (``meta``'s
    ``cuda_graph`` / ``fused``: a failed capture or compile shows there) and the dynamo graphs
    compiled during the call. A policy whose first call is slower per token than its second
    (same shape, same process) pays a one-time cost in its timed window. CPU: the 2-layer tiny
    model, eager; ``cuda``: Qwen3-0.6B's shape, B=8, 32k context, budget 2048, CUDA graphs (the
    cell of the GPU table)."""
    from torch._dynamo.utils import counters

    if cuda:  # pragma: no cover - needs CUDA
        from bench_decoding_gpu import build

        device, model = torch.device("cuda"), build("qwen3-0.6b", torch.device("cuda"), torch.bfloat16)
        batch, prompt, budget, buffer, new = 8, 32768, 2048, 128, 144
        warm = torch.randint(5, 100, (2, 32), device=device)  # as bench_decoding_gpu's warm-up
        generate(model, warm, policy=RKV(buffer=8), budget=16, max_new_tokens=3)
    else:
        device, model = torch.device("cpu"), _model(2, smoke)
        batch, prompt, budget, buffer, new = (2, 48, 16, 8, 24) if smoke else (2, 640, 256, 128, 144)
    make = {"StreamingLLM": StreamingLLM, "SnapKV": SnapKV, "RKV": RKV}
    ids = torch.randint(5, 100, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for name in SCHEDULE_ORDER:
        events: list = []
        cls, real, spy = _spied_compress(events, device)
        graphs = counters["stats"]["unique_graphs"]
        cls.compress = spy
        try:
            out = generate(model, ids, policy=make[name](buffer=buffer), budget=budget, max_new_tokens=new,
                           temperature=0, logprobs_topk=0, cuda_graph=cuda)
        finally:
            cls.compress = real
        meta = out.meta
        rows.append({"policy": name, "events": [n for n, _ in events], "event_s": [round(t, 4) for _, t in events],
                     "ms_per_token": 1e3 * (meta["decode_s"] - meta.get("capture_s", 0.0)) / (new - 1),
                     "captures": meta.get("graph_captures", 0), "capture_s": meta.get("capture_s", 0.0),
                     "cuda_graph": meta.get("cuda_graph"), "fused": meta.get("fused"),
                     "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs, "backend": meta["backend"],
                     "device": str(device), "shape": dict(batch=batch, prompt=prompt, budget=budget, buffer=buffer,
                                                          new=new)})
    return rows


def print_schedule(rows: list[dict] | None) -> None:
    if not rows:
        return
    sh = rows[0]["shape"]
    print(f"\n## compression events of one generate call, in the GPU table's order (one process, "
          f"{rows[0]['device']}, B={sh['batch']}, prompt {sh['prompt']}, budget {sh['budget']}, buffer "
          f"{sh['buffer']}, {sh['new']} new tokens)\n")
    print(table(["policy", "events", "valid slots before each", "seconds of each", "decode ms/token",
                 "graph captures", "cuda_graph / fused", "dynamo graphs compiled"],
                [[r["policy"], len(r["events"]), " ".join(map(str, r["events"])),
                  " ".join(f"{t:.3f}" for t in r["event_s"]), f"{r['ms_per_token']:.2f}", r["captures"],
                  f"{r['cuda_graph']} / {r['fused']}", r["dynamo_graphs"]] for r in rows]))


# -- CUDA: torch.profiler kernels per step ----------------------------------------------------------

def cuda_kernels_per_step(smoke: bool) -> list[dict]:  # pragma: no cover - needs CUDA
    """Kernels per decode step from ``torch.profiler`` (CUDA): kernels of ``generate`` with 3 and
    with 2 new tokens, differenced, eager, with ``cuda_graph=True`` and with the fused step."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(model, ids, pol, steps, mode):
        graph, fused = mode != "eager", mode == "fused"
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(model, ids, policy=pol, budget=4 * ids.shape[1], max_new_tokens=steps, temperature=0,
                     logprobs_topk=0, cuda_graph=graph, fused=fused)
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)

    rows = []
    for layers in (2, 4):
        model = _model(layers, smoke).cuda()
        ids = torch.randint(3, 128, (2, 40), device="cuda")
        for name, pol in step_policies(smoke):
            for mode in ("eager", "cuda_graph", "fused"):
                kernels(model, ids, pol, 2, mode)
                n = kernels(model, ids, pol, 3, mode) - kernels(model, ids, pol, 2, mode)
                rows.append({"policy": name, "layers": layers, "cuda_graph": mode != "eager",
                             "fused": mode == "fused", "kernels_per_step": n})
    return rows


# -- the tables ------------------------------------------------------------------------------------

def _fmt(x: float) -> str:
    return f"{x:g}" if x == int(x) else f"{x:.1f}"


def print_fused(rows: list[dict] | None) -> None:
    """The fused step's table (launches per layer and once per step, compile seconds)."""
    if not rows:
        return
    print(f"\n## fused step (compile): torch.compile of the captured step, CPU inductor, torch {rows[0]['torch']}\n")
    out = []
    for r in rows:
        p, o = r["per_layer"], r["once_per_step"]
        ok = "met" if p["total"] <= r["target"] else "missed"
        out.append([r["policy"], _fmt(p["inductor"]), _fmt(p["extern"]), _fmt(p["aten"]), _fmt(p["in_custom_op"]),
                    _fmt(p["total"]), _fmt(p["total_on_cuda"]), _fmt(sum(o.values())), f"<= {r['target']}",
                    ok if r["policy"] != "BlockTopK" else f"{ok} (reported)", f"{r['compile_s']:.1f}"])
    print(table(["policy", "inductor/layer", "extern GEMM/layer", "aten/layer", "in sparsecorr::attend/layer",
                 "total/layer", "total/layer (CUDA)", "once/step", "target", "", "compile s (cold)"], out))


def print_tables(result: dict) -> None:
    print(f"# decode kernel counts ({machine()}{', smoke' if result['smoke'] else ''})\n")
    rows = []
    for r in result["step"]:
        ours, t = r["per_layer"]["ours"], r["target_ours"]
        rows.append([r["policy"], _fmt(r["per_layer"]["hf"]), _fmt(ours), _fmt(r["per_layer"]["ours_on_cuda"]),
                     _fmt(r["per_layer"]["other"]),
                     _fmt(r["once_per_step"]["hf"]), _fmt(r["once_per_step"]["ours"]), f"<= {t}",
                     "met" if ours <= t else "missed"])
    print("## eager decode step (torch backend): ops per layer and once per step\n")
    print(table(["policy", "HF/layer", "ours/layer", "ours/layer (CUDA)", "other/layer", "HF/step", "ours/step",
                 "target ours/layer", ""], rows))
    sel = result.get("paged_selection")
    if sel:
        print(f"\nBlockTopK on the paged path (FlashInfer's tables; the oracle kernel here): "
              f"{_fmt(sel['per_layer'])} ops per sparse layer rank the pages and write them into the kernel's table ("
              + ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(sel["where"].items())) + ")")
    print_fused(result.get("fused"))
    print_schedule(result.get("schedule"))
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
            ops_ok = m["ops"] <= TARGET_RKV_KERNELS
            # two byte counts: each gather's whole source (an over-count), the elements it reads
            verdicts = ["met" if m[k] <= TARGET_RKV_BYTES else "missed" for k in ("ratio", "ratio_gathered")]
            cells.append(f"<= {TARGET_RKV_KERNELS} ops: {'met' if ops_ok else 'missed'}; "
                         f"<= {TARGET_RKV_BYTES:g}x: {verdicts[0]} / {verdicts[1]} counting gathered elements "
                         "(CUDA ops)")
        else:
            cells.append("")
        rows.append(cells)
    print(table(["policy", "CPU ops", "CPU MiB", "CPU / keys", "CUDA ops (meta)", "CUDA MiB", "CUDA / keys",
                 "target"], rows))
    for r in result["compress"]:
        m = r.get("meta", {})
        if r.get("event") and "compaction_ops" in m:
            print(f"- {r['policy']}: MiB and / keys without the compaction; the compaction adds "
                  f"{_fmt(m['compaction_ops'])} ops and {m['compaction_bytes'] / 2**20:.0f} MiB per layer (CUDA ops); "
                  f"counting only the elements a gather reads: {m['ratio_gathered']:.2f}x the keys")
            c = r.get("cpu", {})
            if m.get("ring_event_ops"):
                print(f"  - of which `RingState.event` (the observation ring's time order and window mask, which "
                      f"the engine made before this call when the pool held the ring): {c['ring_event_ops']:.2f} "
                      f"CPU ops, {m['ring_event_ops']:.2f} CUDA ops per layer; the event without it: "
                      f"{c['ops'] - c['ring_event_ops']:.2f} CPU ops, {m['ops'] - m['ring_event_ops']:.2f} "
                      f"CUDA ops per layer")
            for name, u in m.get("unit_sums", {}).items():
                print(f"  - of which `RKVState.{name}` (R-KV's unit-key sums, kept beside the pool): "
                      f"{_fmt(u['ops'])} ops, {u['ratio']:.2f}x the keys per layer "
                      f"({u['ratio_gathered']:.2f}x counting the elements gathered) (CUDA ops)")
    if result.get("cuda"):
        print("\n## CUDA: kernels per decode step (torch.profiler)\n")
        print(table(["policy", "layers", "cuda_graph", "fused", "kernels/step"],
                    [[r["policy"], r["layers"], r["cuda_graph"], r.get("fused", False), r["kernels_per_step"]]
                     for r in result["cuda"]]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="small model and compression shape (seconds)")
    ap.add_argument("--json", type=Path, help="write the counts as JSON here")
    ap.add_argument("--cuda", action="store_true", help="also profile kernels per step on CUDA")
    ap.add_argument("--no-fused", action="store_true", help="skip the fused step's rows (they compile 10 models)")
    ap.add_argument("--schedule-only", action="store_true",
                    help="only the compression events per generate call (with --cuda: the GPU table's 32k cell)")
    args = ap.parse_args(argv)
    setup(2)
    torch.manual_seed(0)
    if args.schedule_only:
        result = {"smoke": args.smoke, "schedule": event_schedule(args.smoke, cuda=args.cuda and torch.cuda.is_available())}
        print(f"# decode kernel counts ({machine()}{', smoke' if args.smoke else ''})")
        print_schedule(result["schedule"])
        if args.json:
            args.json.write_text(json.dumps(result, indent=1, default=str))
        return result
    result = {"smoke": args.smoke, "step": step_table(args.smoke), "paged_selection": paged_selection(args.smoke),
              "compress": compress_table(args.smoke), "schedule": event_schedule(args.smoke)}
    if not args.no_fused:
        result["fused"] = fused_table(args.smoke)
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
