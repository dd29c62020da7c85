"""Fixtures the decoding tests share: the CUDA-graph step on the CPU, the cycle collector off,
and weak references to what a ``generate`` call allocates (for "nothing alive" checks)."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest

import sparsecorr.decoding.engine as engine_mod
import sparsecorr.decoding.graphs as graphs_mod
from sparsecorr.decoding.pool import KVPool


@pytest.fixture
def cpu_graphs(monkeypatch):
    """``cuda_graph=True`` on the CPU: the graph code path with the eager stand-in runner, no
    device check."""
    monkeypatch.setattr(graphs_mod, "CudaGraphRunner", graphs_mod.EagerRunner)
    monkeypatch.setattr(graphs_mod, "check_graph_device", lambda device: None)


@pytest.fixture
def no_gc():
    """Python's cycle collector off for the test (after one collection): what a call leaves in a
    reference cycle stays alive and is counted."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def tracked(monkeypatch):
    """Weak references to every engine, pool, pool tensor, policy state and state buffer the calls create (count the live
    ones with `tests.unit.decoding.drive.alive`)."""
    refs: list[weakref.ref] = []

    class TrackedPool(KVPool):
        def __init__(self, **kw):
            super().__init__(**kw)
            refs.append(weakref.ref(self))
            refs.extend(weakref.ref(t) for g in (self.k, self.v, self.pos or []) for t in g)

    class TrackedEngine(engine_mod.Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            refs.append(weakref.ref(self))
            # the policy's state and every buffer it keeps beside the pool (rings, page sums, norms)
            refs.append(weakref.ref(self.cache.state))
            refs.extend(weakref.ref(t) for t in self.cache.state.buffers())

    monkeypatch.setattr(engine_mod, "KVPool", TrackedPool)
    monkeypatch.setattr(importlib.import_module("sparsecorr.decoding.generate"), "Engine", TrackedEngine)
    return refs
