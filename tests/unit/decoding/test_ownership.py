"""Issue 34: ``generate`` and ``teacher_forced_logprobs`` leave nothing of theirs allocated.

With Python's cycle collector off, a weak reference to the engine, its KV pool and every pool
tensor is dead the moment the call returns: after a normal return, after an exception raised
inside the decode loop or inside the model's forward (while the exception, and so its traceback,
is still alive), and over 20 calls in a row. Eager steps and the CUDA-graph code path (run on the
CPU with the eager stand-in runner, which stores the captured step's function as a CUDA graph
stores its kernels), every policy, the paged backend and teacher forcing.
"""

from __future__ import annotations

import gc

import pytest
import torch

import sparsecorr.decoding.cache as cache_mod
import sparsecorr.decoding.engine as engine_mod
import sparsecorr.decoding.graphs as graphs_mod
import sparsecorr.decoding.loops as loops_mod
import sparsecorr.decoding.runner as runner_mod
from sparsecorr.decoding import (
    RKV,
    BlockTopK,
    Dense,
    SnapKV,
    StreamingLLM,
    generate,
    teacher_forced_logprobs,
)
from sparsecorr.decoding.backends import PagedBackend, ReferenceDecodeKernel
from tests.models import tiny_model
from tests.unit.decoding.drive import alive

POLICIES = [Dense(), StreamingLLM(sink=1, buffer=2), SnapKV(window=3, buffer=2), RKV(window=3, buffer=2),
            BlockTopK(page_size=4, dense_layers=1)]
BUDGET = {"dense": None}


class _Injected(RuntimeError):
    pass


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (3, 11), generator=g)
    am = torch.ones_like(ids)
    am[1, :4] = 0  # ragged
    return ids, am


def _gen(model, policy, *, graph, backend="torch", steps=12, **kw):
    ids, am = _inputs()
    return generate(model, ids, am, policy=policy, budget=BUDGET.get(policy.name, 6), max_new_tokens=steps,
                    temperature=0, logprobs_topk=2, eos_token_id=[7, 19], cuda_graph=graph, backend=backend,
                    prefill_chunk=4, **kw)


def _paged():
    return PagedBackend(ReferenceDecodeKernel, name="paged-oracle")


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("path", ["eager", "graph", "graph-paged"])
def test_generate_holds_nothing_after_it_returns(policy, path, no_gc, tracked, cpu_graphs):
    model = tiny_model("qwen3", num_layers=3)
    backend = _paged() if path == "graph-paged" else "torch"
    out = _gen(model, policy, graph=path != "eager", backend=backend)
    assert tracked and out.meta["cuda_graph"] == ("off" if path == "eager" else "on")
    assert alive(tracked) == 0, f"{alive(tracked)} engine/pool objects alive after generate returned"


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("where", ["loop", "forward"])
def test_an_exception_inside_the_loop_leaves_nothing_allocated(policy, graph, where, no_gc, tracked, cpu_graphs,
                                                               monkeypatch):
    """The exception (and its traceback, as a notebook's ``sys.last_traceback`` keeps it) is
    still alive when the weak references are checked."""
    model = tiny_model("qwen3", num_layers=3)
    calls = {"n": 0}
    if where == "loop":  # the sampler, called once per decode step (by the runner, or inside the graph step)
        real = runner_mod.sample

        def sample(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 4:
                raise _Injected("injected in the decode loop")
            return real(*a, **kw)

        monkeypatch.setattr(runner_mod, "sample", sample)
        monkeypatch.setattr(graphs_mod, "sample", sample)
    else:  # the attention of a decode step, deep inside the model's forward
        real_attend = cache_mod.SparseKVCache.attend

        def attend(self, layer, *a, **kw):
            if self.step is not None and self.step.q_len == 1 and layer == 1:
                calls["n"] += 1
                if calls["n"] == 3:
                    raise _Injected("injected in the forward")
            return real_attend(self, layer, *a, **kw)

        monkeypatch.setattr(cache_mod.SparseKVCache, "attend", attend)
    with pytest.raises(_Injected) as info:
        _gen(model, policy, graph=graph)
    assert info.value.__traceback__ is not None and tracked
    assert alive(tracked) == 0, f"{alive(tracked)} engine/pool objects pinned by the traceback"


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_twenty_calls_in_a_row_hold_nothing(graph, no_gc, tracked, cpu_graphs):
    model = tiny_model("qwen3", num_layers=2)
    for i in range(20):
        _gen(model, POLICIES[i % len(POLICIES)], graph=graph, steps=6)
        assert alive(tracked) == 0, f"call {i}: {alive(tracked)} engine/pool objects alive"
    assert len(tracked) >= 20 * 3


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_teacher_forcing_holds_nothing(policy, fail, no_gc, tracked, monkeypatch):
    model = tiny_model("qwen3", num_layers=3)
    ids, am = _inputs(1)
    resp = torch.randint(3, 128, (3, 14), generator=torch.Generator().manual_seed(2))
    if fail:
        real = loops_mod._score
        calls = {"n": 0}

        def score(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 3:
                raise _Injected("injected in the forced loop")
            return real(*a, **kw)

        monkeypatch.setattr(loops_mod, "_score", score)
    kw = dict(policy=policy, budget=BUDGET.get(policy.name, 6), attention_mask=am, prefill_chunk=4, chunk_size=5)
    if fail:
        with pytest.raises(_Injected) as info:
            teacher_forced_logprobs(model, ids, resp, **kw)
        assert info.value.__traceback__ is not None
    else:
        out = teacher_forced_logprobs(model, ids, resp, **kw)
        assert bool(out.mask.all())
    assert tracked and alive(tracked) == 0


def test_graph_steps_close_over_no_engine(cpu_graphs):
    """No reference from the graphs (or the stored step function) back to the engine."""
    model = tiny_model("qwen3")
    seen = []
    real = graphs_mod.DecodeGraphs._capture

    def capture(self, spec, step, ids):
        assert not isinstance(spec, engine_mod.Engine)  # an explicit spec, not the engine
        c = real(self, spec, step, ids)
        seen.append((self, c))
        return c

    import unittest.mock

    with unittest.mock.patch.object(graphs_mod.DecodeGraphs, "_capture", capture):
        _gen(model, StreamingLLM(sink=1, buffer=2), graph=True, steps=6, backend=_paged())
    assert seen
    for dg, c in seen:
        assert not any(isinstance(r, engine_mod.Engine) for r in gc.get_referents(dg, c.runner, c.runner.fn))
        assert not any(isinstance(r, engine_mod.Engine) for r in gc.get_referents(*c.runner.fn.args))
