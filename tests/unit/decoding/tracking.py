"""Test-only: weak references to what the engine allocates, for "nothing alive" checks (shared by
the decoding tests' ``tracked`` fixture and the rollout servers' lifecycle tests), and a record of
every compression event (`record_compressions`)."""

from __future__ import annotations

import importlib
import weakref

import torch

import sparsecorr.decoding.cache as cache_module
import sparsecorr.decoding.engine as engine_mod
from sparsecorr.decoding.policies import compress
from sparsecorr.decoding.pool import KVPool


def track_engines(monkeypatch, *sites: str) -> list[weakref.ref]:
    """Patch ``KVPool`` (in ``sparsecorr.decoding.engine``) and ``Engine`` in each module of
    ``sites`` (where it is looked up: ``sparsecorr.decoding.generate``, ``...scheduler``) with
    subclasses that record a weak reference to every engine, pool, pool tensor, policy state and
    state buffer (rings, page sums, norms) they create; returns the list they fill."""
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
            refs.append(weakref.ref(self.cache.state))
            refs.extend(weakref.ref(t) for t in self.cache.state.buffers())

    monkeypatch.setattr(engine_mod, "KVPool", TrackedPool)
    for site in sites:
        monkeypatch.setattr(importlib.import_module(site), "Engine", TrackedEngine)
    return refs


def record_compressions(monkeypatch) -> list[tuple[dict, object]]:
    """Patch the engine's ``compress`` to record every compression event: a list of ``(inputs,
    keep)``, the keyword inputs (tensors cloned) and the `KeepSet` it returned."""
    events: list[tuple[dict, object]] = []

    def spy(policy, **kw):
        keep = compress(policy, **kw)
        events.append(({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}, keep))
        return keep

    monkeypatch.setattr(cache_module, "compress", spy)
    return events
