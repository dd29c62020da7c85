"""Fixtures the decoding tests share: the CUDA-graph step on the CPU, the cycle collector off,
and weak references to what a ``generate`` call allocates (for "nothing alive" checks)."""

from __future__ import annotations

import gc

import pytest

import sparsecorr.decoding.graphs as graphs_mod
from tests.unit.decoding.tracking import track_engines


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
    return track_engines(monkeypatch, "sparsecorr.decoding.generate")
