r"""CUDA graphs of the single-token decode step (GPU only; ``generate(..., cuda_graph=True)``,
driven by the model runner, `sparsecorr.decoding.runner.ModelRunner`).

A decode step launches one small kernel per op for every layer (1,700-3,800 per token for a
28-layer model), so in eager mode the host, not the GPU, sets the pace. A CUDA graph replays the
whole forward with one launch. Shapes must not change between replays, so in graph mode a step
reads the **whole** pool (``kv_len`` = capacity, the row lengths in a mask built inside the
graph from a device copy of the slot counts) and selection policies score a fixed number of
pages. Everything that varies per step (token ids, positions, write slots, counts, budgets) sits
in static device buffers refreshed before each replay; compression, FlashInfer's ``plan`` and
row selection stay outside the graph. With a `Sampling` (the runner's graphs) the captured step
is the forward **and** the sampling (`sparsecorr.decoding.sampling.sample`: temperature, top-k,
top-p, greedy, the top-k log-probs), as gpt-fast captures its decode step, so a replay returns
tokens and log-probs, not logits; its noise is drawn for the whole batch and read at each row's
index (a static ``rows`` buffer), so padding rows change no row's draw. Without one (the
scheduler's decode forward, `sparsecorr.decoding.runner.ModelRunner.forward_logits`: its rows
sample per request afterwards) the step is the forward alone and returns logits. One graph is captured per batch bucket: rows that finish stay
as masked dummies until the live rows fit the next smaller power of two
(`sparsecorr.decoding.runner.rows_to_keep`), then the batch shrinks and the next step captures.

**Random streams.** The warm-up run must not advance the sampling generator (the caller's, or
torch's default one for the device): its state is saved and restored around it, as the buffers
the warm-up adds to are. On CUDA a generator other than
the device's default one is registered with the graph before capture
(``torch.cuda.CUDAGraph.register_generator_state``; declared in torch 2.13's
``torch/_C/__init__.pyi``, used the same way by ``torch/_inductor/cudagraph_trees.py``), so each
replay advances its Philox offset as an eager step would; the default generator is registered by
``torch.cuda.graph`` itself.

The engine plans each step once (`sparsecorr.decoding.engine.Engine.plan` with ``static=True``:
host tensors at the graph's fixed sizes); the runner copies them into the step's static twin
(`sparsecorr.decoding.cache.step_twin`, `load_step`) and reads nothing else of the engine: what a
capture needs comes as a `CaptureSpec`. Capture runs one eager warm-up step on a side stream first
(it writes the step's own K/V and whatever the policy's state writes, which the replay rewrites;
the buffers the state adds to are restored: `PolicyState.added_to`). If capture fails,
the engine warns once and stays eager; ``RolloutBatch.meta["cuda_graph"]`` says which happened.

**Ownership.** The warm-up and the capture run on one stream per device (`capture_stream`),
created once and reused by every call: PyTorch keeps one cuBLAS workspace per (handle, stream)
for the life of the process (32 MiB on Hopper), so a new stream per capture would leave 32 MiB
behind every ``generate`` call. Nothing here points back at the engine: `DecodeGraphs` takes it
a `CaptureSpec` (the model, the cache, the device and the kernels' shape) with each step, and
the captured step closes over the model, the cache and its static buffers only, so the graphs, the pool and the FlashInfer plans are freed by reference counting the
moment the engine is dropped (no cycle for Python's collector to find). A capture that fails
is not kept either: its exception's frames, which hold the step's buffers and the pool, are
cleared (`sparsecorr.decoding.fused.release`).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from .cache import Step, load_step, step_twin
from .fused import capture_fused, describe, fused_forward, release, remember_failure
from .hf import forward
from .sampling import Sampling, sample

__all__ = ["CaptureSpec", "CudaGraphRunner", "DecodeGraphs", "EagerRunner", "StaticStep", "capture_stream",
           "check_graph_device", "graph_meta"]

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The warm-up / capture stream of ``device``: created on first use, then reused by every
    capture in the process (one cuBLAS workspace for all of them, not one per call)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def check_graph_device(device: torch.device) -> None:
    """Raise ``ValueError`` unless CUDA graphs can be captured for a model on ``device``."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"cuda_graph: needs the model on a CUDA device, got {device}")


@dataclass(frozen=True)
class CaptureSpec:
    """What capturing and replaying a decode step needs (the engine gives it; it holds nothing of
    the engine): the model, its cache (the pool, the policy's state, the backend), the device, and
    the shape a paged backend's fixed-buffer kernels are made for (KV heads, query heads per KV
    head, head dim)."""

    model: Any
    cache: Any
    device: torch.device
    heads_kv: int
    group: int
    head_dim: int


def _warm_up(fn, restore: list[torch.Tensor], generators=()) -> None:
    """Run ``fn`` once and undo its writes to ``restore`` (the observation rings and the running
    page sums, which the replays would otherwise add to twice) and its draws from ``generators``
    (the sampling stream: a replay draws what the eager step would), also when it raises part
    way (a failed compile of the fused step: the unfused capture then starts from the same state)."""
    saved = [w.clone() for w in restore]
    states = [g.get_state() for g in generators]
    try:
        fn()
    finally:
        for w, s in zip(restore, saved):
            w.copy_(s)
        for g, st in zip(generators, states):
            g.set_state(st)


def _stream(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """The generator a step's sampling draws from: ``generator``, or torch's default one for
    ``device`` (what ``exponential_`` uses without one), so the warm-up restores that one too."""
    if generator is not None:
        return generator
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    return torch.default_generator


def _is_default(generator: torch.Generator) -> bool:
    """Whether ``generator`` is its CUDA device's default generator (``torch.cuda.graph`` registers
    that one itself)."""
    index = generator.device.index
    index = torch.cuda.current_device() if index is None else index
    return generator is torch.cuda.default_generators[index]


class CudaGraphRunner:
    """Warm up ``fn`` on the device's capture stream, capture it there, replay it (the output
    tensor is rewritten in place by every replay). The warm-up's side effects on ``restore`` (the
    observation rings and the running page sums, which a replay would otherwise add to twice) are
    undone, and so are its draws from ``generators``; a non-default one is registered with the
    graph (see the module's *Random streams*). ``fn`` is not kept."""

    def __init__(self, fn, *, pool, restore: list[torch.Tensor], device: torch.device, generators=()) -> None:
        side = capture_stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # lazy initialisations (cuBLAS handles, FlashInfer modules) outside capture
            _warm_up(fn, restore, generators)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        for g in generators:
            if not _is_default(g):
                self.graph.register_generator_state(g)
        with torch.cuda.graph(self.graph, pool=pool, stream=side):
            self.out = fn()

    @staticmethod
    def new_pool():
        """A private memory pool for this call's graphs (freed with them)."""
        return torch.cuda.graph_pool_handle()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class EagerRunner:
    """The same static-buffer step run eagerly (what a replay computes; used by the CPU tests),
    with `CudaGraphRunner`'s warm-up call (where the fused step compiles) and its restore (the
    buffers and the generators)."""

    def __init__(self, fn, *, restore: list[torch.Tensor] = (), generators=(), **_: object) -> None:
        _warm_up(fn, restore, generators)
        self.fn = fn

    @staticmethod
    def new_pool():
        return None

    def replay(self) -> torch.Tensor:
        return self.fn()


def _graph_forward(model, cache, step: Step, ids: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """The captured decode forward: reads the whole pool, the row lengths in a mask built from
    the static device counts, and the policy's per-step device work (`PolicyState.derive`) inside
    the graph (a sliding-window model's ring positions and window mask too, made by its first
    sliding layer from the static ``ring_slots`` / ``ring_pos``); ``fused``: the model's forward compiled (`sparsecorr.decoding.fused`). Closes over
    no engine (see the module's *Ownership*)."""
    cap = cache.pool.capacity
    mask = (torch.arange(cap, device=ids.device) <= step.counts[:, None])[:, None, None, :]
    cache.state.derive(step.part)
    cache.step = dataclasses.replace(step, mask=mask)  # the static plan with this forward's mask
    if fused:
        return fused_forward(model, ids, step.positions)
    return forward(model, input_ids=ids, position_ids=step.positions, cache=cache, logits_to_keep=1).logits[:, -1]


def _graph_step(model, cache, step: Step, ids: torch.Tensor, rows: torch.Tensor, samp: Sampling, batch: int,
                fused: bool = False) -> tuple:
    """The runner's captured step: `_graph_forward`, then `sample` over the step's rows (noise
    drawn for all ``batch`` rows, read at ``rows``). Returns ``(token [B], log-prob [B])`` and,
    when ``samp.k`` > 0, the top-k ``(values [B, k], indices [B, k])`` too."""
    tok, lp, top = sample(_graph_forward(model, cache, step, ids, fused), samp, rows=rows, batch=batch)
    return (tok, lp) if top is None else (tok, lp, top.values, top.indices)


@dataclass
class StaticStep:
    """The named static buffers one captured step reads at fixed addresses, and its runner:
    ``step``, the frozen host plan's twin (`sparsecorr.decoding.cache.step_twin`: the same
    fields, device tensors refreshed in place before each replay by `load_step`); ``ids``
    ``[B, 1]``, the tokens fed; ``rows`` ``[B]``, each row's batch index for the sampling noise
    (None: a forward-only graph)."""

    runner: object
    step: Step
    ids: torch.Tensor
    rows: torch.Tensor | None = None


class DecodeGraphs:
    """One captured decode step per batch size met (bucketed by the model runner).

    Args:
        runner: the graph runner class (`CudaGraphRunner`; `EagerRunner` in the CPU tests).
        fused: compile the step's model forward (`sparsecorr.decoding.fused`).
        sampling: capture the forward and the sampling (`_graph_step`; the model runner's
            graphs); None: the forward alone, returning logits (the scheduler's `ModelRunner.forward_logits`).
        batch: the rows the sampling noise is drawn for (the decode's first batch).
    """

    def __init__(self, *, runner: type | None = None, fused: bool | str = False, sampling: Sampling | None = None,
                 batch: int = 0) -> None:
        self.sampling, self.batch = sampling, batch
        self.captured: dict[int, StaticStep] = {}
        self.status = "on"
        # "on", "off", or "failed: ..." once the fused step failed, in this call or an earlier
        # one for the same model state (`sparsecorr.decoding.fused.fused_status`): then unfused
        self.fused = fused if isinstance(fused, str) else "on" if fused else "off"
        self.captures = 0  # graphs captured (one per batch bucket met)
        self.capture_s = 0.0  # host seconds spent capturing (warm-up step included)
        self.runner = runner or CudaGraphRunner
        self.pool = getattr(self.runner, "new_pool", lambda: None)()

    def close(self) -> None:
        """Drop the captured graphs (their private pool is freed with them)."""
        self.captured = {}
        self.pool = None

    @staticmethod
    def _load(spec: CaptureSpec, c: StaticStep, step: Step, ids: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Refresh the static buffers from the planned ``step`` (and the rows' batch indices); a
        paged step's tables are planned outside the graph, into its kernels' fixed buffers."""
        c.ids.copy_(ids)
        if c.rows is not None and rows is not None:
            c.rows.copy_(rows, non_blocking=True)
        load_step(c.step, step)
        if step.page_plan is not None:
            spec.cache.backend.begin_step(**step.page_plan)

    def _capture(self, spec: CaptureSpec, step: Step, ids: torch.Tensor) -> StaticStep:
        b, cache = ids.shape[0], spec.cache
        st = step_twin(step, spec.device)
        if st.paged:  # kernels with fixed table buffers for this batch size
            cache.backend.enable_graph(batch=b, heads=spec.heads_kv, pages_per_row=cache.pool.pages_per_row,
                                       keep_cap=cache.state.static_pages, group=spec.group,
                                       head_dim=spec.head_dim, device=spec.device)
        static_ids = torch.zeros_like(ids)
        samp = self.sampling
        static_rows = None if samp is None else torch.zeros(b, dtype=torch.long, device=spec.device)
        c = StaticStep(runner=None, step=st, ids=static_ids, rows=static_rows)
        # the warm-up's rows stay zeros: its draws are undone and its output dropped
        self._load(spec, c, step, ids, None)
        t0 = time.perf_counter()
        self.captured = {}  # a smaller batch never comes back: free the older graph first
        restore = cache.warm_up_buffers()
        gens = () if samp is None else (_stream(samp.generator, spec.device),)
        if samp is None:
            step_fn = lambda fused: functools.partial(_graph_forward, spec.model, cache, st, static_ids, fused)  # noqa: E731
        else:
            step_fn = lambda fused: functools.partial(  # noqa: E731
                _graph_step, spec.model, cache, st, static_ids, static_rows, samp, self.batch, fused)
        make = lambda fused: self.runner(step_fn(fused), pool=self.pool, restore=restore,  # noqa: E731
                                         device=spec.device, generators=gens)
        before = self.fused
        c.runner, self.fused = capture_fused(make, fused=self.fused)
        if before == "on" and self.fused != "on":  # the next call with this model state skips the attempt
            remember_failure(spec.model, self.fused)
        self.capture_s += time.perf_counter() - t0  # torch.cuda.graph syncs on entry
        self.captures += 1
        self.captured = {b: c}
        return c

    def run(self, step: Step, ids: torch.Tensor, spec: CaptureSpec, rows: torch.Tensor | None = None):
        """A graph replay of the planned static ``step`` (`Engine.plan` with ``static=True``):
        without sampling, the output (``.logits [B, 1, V]``); with it, a tuple of fresh tensors
        ``(token [B], log-prob [B][, top-k values [B, k], indices [B, k]])`` (``rows`` ``[B]``:
        each row's batch index, for the noise). None if capture failed (the caller then runs the
        step eagerly)."""
        b = ids.shape[0]
        outer = sys.exc_info()[1]
        try:
            c = self.captured.get(b) or self._capture(spec, step, ids)
        except Exception as exc:  # an op that cannot be captured: stay eager, say so
            error = describe(exc)
            release(exc, outer=outer)  # its frames hold the step's buffers and the pool: nothing of them kept
            self.status = f"failed: {type(exc).__name__}"
            self.captured = {}
            warnings.warn(f"cuda_graph: capture failed, decoding eagerly ({error})", RuntimeWarning, stacklevel=2)
            if spec.cache.backend.paged:  # eager kernels for the eager steps
                spec.cache.backend.reset_graph()
            return None
        self._load(spec, c, step, ids, rows)
        out = c.runner.replay()
        if self.sampling is not None:
            return tuple(t.clone() for t in out)
        return SimpleNamespace(logits=out[:, None].clone())


def graph_meta(graphs: DecodeGraphs | None) -> dict:
    """``RolloutBatch.meta``'s graph entries (``generate``'s one-pool and scheduler paths alike):
    ``cuda_graph`` / ``fused`` are ``"off"`` where not asked for, ``"unused"`` where asked for but
    no decode step was captured (no decode forward ran, e.g. ``max_new_tokens=1``), else what the
    graphs say (``"on"``, ``"failed: <error>"``); ``graph_captures`` and ``capture_s``."""
    if graphs is None:
        graph, fused = "off", "off"
    elif graphs.captures == 0 and graphs.status == "on":
        graph, fused = "unused", "unused" if graphs.fused == "on" else graphs.fused
    else:
        graph, fused = graphs.status, graphs.fused
    return {"cuda_graph": graph, "fused": fused, "graph_captures": 0 if graphs is None else graphs.captures,
            "capture_s": 0.0 if graphs is None else graphs.capture_s}
