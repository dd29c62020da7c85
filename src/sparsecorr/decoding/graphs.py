r"""CUDA graphs of the single-token decode step (GPU only; ``generate(..., cuda_graph=True)``).

A decode step launches one small kernel per op for every layer (1,700-3,800 per token for a
28-layer model), so in eager mode the host, not the GPU, sets the pace. A CUDA graph replays the
whole forward with one launch. Shapes must not change between replays, so in graph mode a step
reads the **whole** pool (``kv_len`` = capacity, the row lengths in a mask built inside the
graph from a device copy of the slot counts) and selection policies score a fixed number of
pages. Everything that varies per step (token ids, positions, write slots, counts, budgets) sits
in static device buffers refreshed before each replay; compression, sampling, FlashInfer's
``plan`` and row selection stay outside the graph. One graph is captured per batch bucket: rows
that finish stay as masked dummies until the live rows fit the next smaller power of two
(`sparsecorr.decoding.loops.rows_to_keep`), then the batch shrinks and the next step captures.

Capture runs one eager warm-up step on a side stream first (it writes the step's own K/V, which
the replay rewrites, and shifts the observation windows, which are restored). If capture fails,
the engine warns once and stays eager; ``RolloutBatch.meta["cuda_graph"]`` says which happened.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .cache import Step
from .hf import forward

__all__ = ["CudaGraphRunner", "DecodeGraphs", "EagerRunner"]


class CudaGraphRunner:
    """Warm up ``fn`` on a side stream, capture it, replay it (the output tensor is rewritten in
    place by every replay). The warm-up's side effects on the observation windows are undone."""

    def __init__(self, fn, *, pool, windows: list[torch.Tensor]) -> None:
        saved = [w.clone() for w in windows]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # lazy initialisations (cuBLAS handles, FlashInfer modules) happen outside capture
        torch.cuda.current_stream().wait_stream(side)
        for w, s in zip(windows, saved):
            w.copy_(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class EagerRunner:
    """The same static-buffer step run eagerly (what a replay computes; used by the CPU tests)."""

    def __init__(self, fn, **_: object) -> None:
        self.fn = fn

    def replay(self) -> torch.Tensor:
        return self.fn()


@dataclass
class _Captured:
    runner: object
    step: Step
    ids: torch.Tensor


class DecodeGraphs:
    """One captured decode forward per batch size met (bucketed by the decode loop), for an
    `sparsecorr.decoding.engine.Engine`."""

    def __init__(self, engine, *, runner=None) -> None:
        self.engine = engine
        self.captured: dict[int, _Captured] = {}
        self.status = "on"
        self.captures = 0  # graphs captured (one per batch bucket met)
        self.capture_s = 0.0  # host seconds spent capturing (warm-up step included)
        self.runner = runner or CudaGraphRunner
        self.pool = torch.cuda.graph_pool_handle() if self.runner is CudaGraphRunner else None

    def _static_step(self, b: int) -> Step:
        e = self.engine
        dev = e.device
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)  # noqa: E731
        select = e.policy.kind == "selection"
        return Step(q_len=1, kv_len=e.pool.capacity, slots=z(b, 1), positions=z(b, 1),
                    real=torch.ones(b, dtype=torch.long, device=dev), mask=None, counts=z(b),
                    select=select, query_slots=z(b, 1) if select else None,
                    budgets=z(b, 1) if select else None, keep_max=e.keep_cap if select else 0,
                    paged=bool(getattr(e.cache.backend, "paged", False)))

    def _forward(self, cap_step: Step, ids: torch.Tensor):
        e = self.engine
        cap = e.pool.capacity
        cap_step.mask = (torch.arange(cap, device=ids.device) <= cap_step.counts[:, None])[:, None, None, :]
        e.cache.step = cap_step
        return forward(e.model, input_ids=ids, position_ids=cap_step.positions, cache=e.cache,
                       logits_to_keep=1).logits[:, -1]

    def _load(self, c: _Captured, ids: torch.Tensor) -> None:
        e = self.engine
        st = c.step
        nb = dict(non_blocking=True)
        c.ids.copy_(ids)
        st.counts.copy_(e.count, **nb)
        st.slots.copy_(e.count[:, None], **nb)
        st.positions.copy_(e.ctx[:, None], **nb)
        if st.select:
            st.query_slots.copy_(e.count[:, None], **nb)
            st.budgets.copy_(e.budget_at(e.ctx[:, None] + 1), **nb)

    def _capture(self, ids: torch.Tensor) -> _Captured:
        b = ids.shape[0]
        e = self.engine
        st = self._static_step(b)
        if st.paged:  # FlashInfer wrappers with fixed buffers for this batch size
            e.cache.backend.enable_graph(batch=b, heads=e.heads_kv, pages_per_row=e.pool.pages_per_row,
                                         keep_cap=e.keep_cap, group=e.heads_q // e.heads_kv,
                                         head_dim=e.head_dim, device=e.device)
            e._begin_paged_step()
        static_ids = torch.zeros_like(ids)
        c = _Captured(runner=None, step=st, ids=static_ids)
        self._load(c, ids)
        t0 = time.perf_counter()
        c.runner = self.runner(lambda: self._forward(st, static_ids), pool=self.pool,
                               windows=e.pool.win or [])
        self.capture_s += time.perf_counter() - t0  # torch.cuda.graph syncs on entry
        self.captures += 1
        self.captured = {b: c}  # a smaller batch never comes back: free the older graph
        return c

    def run(self, ids: torch.Tensor):
        """The step's output (``.logits [B, 1, V]``), from a graph replay; None if capture failed
        (the caller then runs the step eagerly)."""
        b = ids.shape[0]
        try:
            c = self.captured.get(b) or self._capture(ids)
        except Exception as exc:  # an op that cannot be captured: stay eager, say so
            warnings.warn(f"cuda_graph: capture failed, decoding eagerly ({type(exc).__name__}: {exc})",
                          RuntimeWarning, stacklevel=2)
            self.status = f"failed: {type(exc).__name__}"
            self.captured = {}
            if hasattr(self.engine.cache.backend, "reset_graph"):  # eager kernels for the eager steps
                self.engine.cache.backend.reset_graph()
            return None
        self._load(c, ids)
        if c.step.paged:
            self.engine._begin_paged_step()  # plan outside the graph, into its fixed buffers
        return SimpleNamespace(logits=c.runner.replay()[:, None].clone())
