"""The continuous-batching scheduler (issue 50): admission within the memory plan, failures that
stay with their request, abort, per-row sampling, ``generate`` over the plan, ownership."""

from __future__ import annotations

import importlib

import pytest
import torch

import sparsecorr.decoding.scheduler as scheduler_mod
from sparsecorr.decoding import RKV, BlockTopK, Dense, RequestParams, Scheduler, SnapKV, generate
from sparsecorr.decoding.loops import Sampling, sample
from sparsecorr.decoding.memory import plan_memory
from sparsecorr.decoding.sampling import RowSampling, sample_rows
from tests.models import tiny_model
from tests.unit.decoding.drive import alive

MODEL = tiny_model("qwen3", num_layers=2)
GREEDY = RequestParams(max_tokens=8, temperature=0, logprobs=2)


def _sched(policy=None, **kw):
    kw = {"max_num_seqs": 2, "max_model_len": 32, "prefill_chunk": 4, "backend": "torch", **kw}
    return Scheduler(MODEL, policy=policy or RKV(window=3, buffer=2), budget=6, eos_token_id=2, **kw)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g) for _ in range(n)]


def _drain(sched, watch=None):
    out = {}
    while sched.has_unfinished():
        for o in sched.step():
            out[o.request_id] = o
        if watch is not None:
            watch(sched)
    return out


def _alone(prompt, params=GREEDY, **kw):
    s = _sched(**kw)
    s.add_request("x", prompt, params)
    out = _drain(s)["x"]
    s.close()
    return out


# -- admission and the memory plan ------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3])
def test_admission_within_the_plan(k):
    probe = _sched(max_num_seqs=1)
    row = probe.plan.row_bytes
    sched = _sched(max_num_seqs=None, max_kv_bytes=(k + 1) * row + row // 2)  # the pristine row counts
    assert (sched.plan.rows, sched.plan.source, sched.plan.bytes_allowed) == (k, "max_kv_bytes", (k + 1) * row + row // 2)
    prompts = _prompts(7)
    for i, p in enumerate(prompts):
        sched.add_request(str(i), p, GREEDY)
    seen = []
    out = _drain(sched, watch=lambda s: seen.append((s.num_running, s.pool_bytes)))
    assert sorted(out) == [str(i) for i in range(7)]
    assert all(o.finish_reason in ("eos", "length") and len(o.token_ids) >= 1 for o in out.values())
    assert sched.max_resident == k and max(r for r, _ in seen) <= k
    assert max(b for _, b in seen) == (k + 1) * row <= sched.plan.bytes_allowed
    for i in (0, 6):  # what it decodes is what it decodes alone
        assert out[str(i)].token_ids == _alone(prompts[i]).token_ids
    sched.close()


def test_plan_refuses_when_not_one_row_fits():
    with pytest.raises(ValueError, match="max_kv_bytes"):
        _sched(max_num_seqs=None, max_kv_bytes=1000)
    with pytest.raises(ValueError, match="max_num_seqs"):
        _sched(max_num_seqs=0)
    plan = plan_memory(per_row=10, fixed=0, capacity=4, device=torch.device("cpu"), max_num_seqs=None,
                       max_kv_bytes=None)
    assert (plan.rows, plan.source, plan.bytes_allowed) == (64, "max_num_seqs", None)  # the CPU default
    assert plan_memory(per_row=10, fixed=0, capacity=4, device=torch.device("cpu"), max_num_seqs=5,
                       max_kv_bytes=1000).source == "max_num_seqs"


# -- failures stay with their request ------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
                                       ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"),
                                       ({"logprobs": -1}, "logprobs"), ({"seed": -2}, "seed"),
                                       ({"stop_token_ids": [1.5]}, "stop_token_ids"), ({"ignore_eos": 1}, "ignore_eos")])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        RequestParams(**{"max_tokens": 4, **kw})


def test_bad_requests_are_refused_at_submission_and_others_complete():
    sched = _sched()
    good = _prompts(2)
    sched.add_request("a", good[0], GREEDY)
    bad = [("b", list(range(3, 30)), GREEDY, "prompt_ids"),  # 27 + 8 > max_model_len 32
           ("c", [], GREEDY, "prompt_ids"), ("d", [5, 500], GREEDY, "prompt_ids"),
           ("a", good[1], GREEDY, "request_id"), ("e", good[1], {"max_tokens": 3}, "params"),
           ("f", [[1, 2]], GREEDY, "prompt_ids")]
    for rid, prompt, params, field in bad:
        with pytest.raises(ValueError, match=f"^{field}:"):
            sched.add_request(rid, prompt, params)
    sched.add_request("g", good[1], GREEDY)
    out = _drain(sched)
    assert sorted(out) == ["a", "g"]
    assert out["g"].token_ids == _alone(good[1]).token_ids
    sched.close()


def test_an_error_inside_a_step_fails_that_forwards_rows_only():
    sched = _sched(max_num_seqs=3)
    prompts = _prompts(4, seed=3)
    params = RequestParams(max_tokens=8, temperature=0, ignore_eos=True)
    sched.add_request("a", prompts[0], params)
    sched.add_request("b", prompts[1], params)
    assert sched.step() == []  # admits both
    while any(r is not None and r.fed < r.prompt.numel() for r in sched._slots):
        assert sched.step() == []
    engine, calls = sched.engine, []
    real_feed = engine.feed

    def feed_once(*a, **kw):  # the first decode forward raises
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real_feed(*a, **kw)

    engine.feed = feed_once
    failed = sched.step()
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    assert all(o.finish_reason == "error" and str(o.error) == "injected" for o in failed)
    assert all(len(o.token_ids) == 1 for o in failed)  # the token sampled after the prefill
    sched.add_request("c", prompts[2], params)
    out = _drain(sched)
    assert out["c"].finish_reason == "length" and out["c"].token_ids == _alone(prompts[2], params).token_ids
    sched.close()


def test_abort_returns_partial_tokens():
    sched = _sched(max_num_seqs=1)
    prompts = _prompts(3, seed=4)
    params = RequestParams(max_tokens=10, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(str(i), p, params)
    while not sched.engine or len(sched._slots[0].tokens if sched._slots[0] else []) < 3:
        sched.step()
    running = sched.abort("0")
    assert running.finish_reason == "aborted" and len(running.token_ids) == 3
    assert running.token_ids == _alone(prompts[0], params).token_ids[:3]
    waiting = sched.abort("2")
    assert waiting.finish_reason == "aborted" and waiting.token_ids == () and waiting.logprobs.shape == (0,)
    assert sched.abort("2") is None and sched.abort("nope") is None
    out = _drain(sched)
    assert list(out) == ["1"] and out["1"].token_ids == _alone(prompts[1], params).token_ids
    sched.add_request("3", prompts[0], params)
    sched.step()
    assert [o.finish_reason for o in sched.abort_all()] == ["aborted"] and not sched.has_unfinished()
    sched.close()


# -- per-row sampling --------------------------------------------------------------------------------
def test_each_row_samples_as_it_would_alone():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * 3
    settings = [(0.0, None, None), (1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 12, 0.6)]
    rows = [RowSampling(temperature=t, top_k=k, top_p=p, logprobs=j, generator=torch.Generator().manual_seed(10 + j))
            for j, (t, k, p) in enumerate(settings)]
    tok, lp, top = sample_rows(logits, rows, shared=None)
    assert top.values.shape == (5, 4)
    for j, (t, k, p) in enumerate(settings):
        want = sample(logits[j:j + 1], Sampling(temperature=t, top_k=k, top_p=p, k=j,
                                                generator=torch.Generator().manual_seed(10 + j)))
        assert int(want[0]) == int(tok[j])
        torch.testing.assert_close(want[1][0], lp[j])
        if j:
            torch.testing.assert_close(want[2].values[0], top.values[j, :j])


# -- generate over the plan -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [Dense(), SnapKV(window=3, buffer=2), RKV(window=3, buffer=2)], ids=lambda p: p.name)
def test_generate_capped_equals_uncapped(policy):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (5, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, :4] = 0
    am[3, 6:] = 0
    kw = dict(policy=policy, budget=None if policy.name == "dense" else 6, max_new_tokens=10, temperature=0,
              logprobs_topk=3, eos_token_id=[2, 7], prefill_chunk=4, backend="torch")
    ref = generate(MODEL, ids, am, **kw)
    got = generate(MODEL, ids, am, max_num_seqs=2, **kw)
    assert got.meta["scheduler"]["rows"] == 2 and got.meta["scheduler"]["max_resident"] == 2
    assert "scheduler" not in ref.meta
    for name in ("tokens", "mask", "lengths", "prompt_lengths", "budget", "pruned", "pruned_at", "topk_ids"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.finish_reason == ref.finish_reason
    for name in ("rollout_logp", "topk_logp", "kv_kept"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), atol=1e-5, rtol=0)
    big = generate(MODEL, ids, am, max_num_seqs=5, **kw)  # fits: the one-pool path, unchanged
    assert "scheduler" not in big.meta and torch.equal(big.rollout_logp, ref.rollout_logp)


def test_generate_scheduler_path_refuses_what_it_cannot_do():
    ids = torch.randint(3, 128, (3, 5))
    with pytest.raises(ValueError, match="record_keep"):
        generate(MODEL, ids, policy=RKV(), budget=6, max_new_tokens=4, max_num_seqs=1, record_keep=True)
    with pytest.raises(ValueError, match=r"^max_num_seqs:"):
        generate(MODEL, ids, policy=RKV(), budget=6, max_new_tokens=4, max_num_seqs=0)
    with pytest.raises(ValueError, match=r"^max_kv_bytes:"):
        generate(MODEL, ids, policy=RKV(), budget=6, max_new_tokens=4, max_kv_bytes=1.5)


# -- ownership ---------------------------------------------------------------------------------------
def test_release_and_close_leave_nothing_alive(tracked, no_gc, monkeypatch):
    monkeypatch.setattr(scheduler_mod, "Engine", importlib.import_module("sparsecorr.decoding.generate").Engine)  # the tracked engine
    sched = _sched(max_num_seqs=2)
    prompts = _prompts(3, seed=6)
    for i, p in enumerate(prompts):
        sched.add_request(str(i), p, GREEDY)
    sched.step()
    assert alive(tracked) > 0
    with pytest.raises(RuntimeError, match="release"):
        sched.release()
    sched.engine.feed = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom"))  # an error output kept
    failed = sched.step()
    assert failed and all(o.error is not None for o in failed)
    assert sched.num_running == 0 and sched.num_waiting == 1
    sched.release()
    assert alive(tracked) == 0
    out = _drain(sched)  # the waiting request: a new engine
    assert list(out) == ["2"] and out["2"].finish_reason in ("eos", "length")
    assert alive(tracked) > 0
    sched.add_request("3", prompts[0], GREEDY)
    sched.step()
    sched.close()
    assert alive(tracked) == 0 and not sched.has_unfinished()
    with pytest.raises(RuntimeError, match="closed"):
        sched.step()
    del failed


@pytest.mark.parametrize("policy", [RKV(window=3, buffer=2), SnapKV(window=3, buffer=2)], ids=lambda p: p.name)
def test_the_graph_step_at_one_batch_size_equals_eager(policy, cpu_graphs):
    """The CUDA-graph code path (the eager stand-in runner on the CPU): one capture per batch
    bucket met (two rows while requests wait, one for the last request's tail), the same tokens
    and log-probs as eager steps."""
    prompts = _prompts(5, seed=7)
    runs = []
    for graph in (False, True):
        sched = _sched(policy, max_num_seqs=2, cuda_graph=graph)
        for i, p in enumerate(prompts):
            sched.add_request(str(i), p, GREEDY)
        runs.append(_drain(sched))
        if graph:
            assert sched.runner.graphs.status == "on" and sched.runner.graphs.captures == 2
        sched.close()
    eager, graph = runs
    for i in eager:
        assert eager[i].token_ids == graph[i].token_ids
        torch.testing.assert_close(eager[i].logprobs, graph[i].logprobs, atol=1e-5, rtol=0)


def test_reset_rows_copies_the_pristine_row_and_leaves_the_others():
    sched = _sched(RKV(window=3, buffer=2), max_num_seqs=3)
    prompts = _prompts(3, seed=8)
    for i, p in enumerate(prompts):
        sched.add_request(str(i), p, RequestParams(max_tokens=6, temperature=0, ignore_eos=True))
    for _ in range(5):
        sched.step()
    eng = sched.engine
    bufs = lambda: [eng.pool.k_all, eng.pool.v_all, eng.pool.pos_all, *eng.cache.state.buffers()]  # noqa: E731
    before = [b.clone() for b in bufs()]
    count = eng.count.clone()
    assert sched.pristine == 3 and bool((count[:3] > 0).all()) and int(count[3]) == 0
    eng.reset_rows(torch.tensor([0, 2]), source=3)
    for old, new in zip(before, bufs()):
        assert torch.equal(new[:, 1], old[:, 1]) and torch.equal(new[:, 3], old[:, 3])
        assert torch.equal(new[:, 0], old[:, 3]) and torch.equal(new[:, 2], old[:, 3])
    assert eng.count.tolist() == [0, int(count[1]), 0, 0] and eng.ctx.tolist()[::2] == [0, 0]
    sched.abort_all()
    sched.close()


@pytest.mark.parametrize("policy", [RKV(window=3, buffer=2), SnapKV(window=3, buffer=2),
                                    BlockTopK(page_size=4, dense_layers=1)], ids=lambda p: p.name)
def test_the_pristine_row_stays_blank_outside_its_scratch_areas(policy):
    """Free rows are fed ``real = 0``: their padding goes to the scratch page (pool, norms, page
    sums) and the ring's dump column, never to a slot, column or page a request reads."""
    sched = _sched(policy, max_num_seqs=2)
    for i, p in enumerate(_prompts(4, seed=9)):
        sched.add_request(str(i), p, GREEDY)
    _drain(sched)
    eng, p = sched.engine, sched.pristine
    cap, state = eng.pool.capacity, eng.cache.state
    for buf in (eng.pool.k_all, eng.pool.v_all, eng.pool.pos_all):
        assert buf is None or not bool(buf[:, p, :, :cap].any())
    if hasattr(state, "win_all"):
        assert not bool(state.win_all[:, p, :, :state.window].any())
    if getattr(state, "norms_all", None) is not None:
        assert not bool(state.norms_all[:, p, :, :cap].any()) and not bool(state.unit_sum_all[:, p].any())
    if hasattr(state, "summ_all"):
        assert not bool(state.summ_all[:, p, :, :-1].any())
    sched.close()


# -- the batch follows the running rows ------------------------------------------------------------
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_the_batch_holds_the_running_rows_not_the_plan(graph, request):
    """Forwards run over the running rows and the pristine one (with CUDA graphs: rounded up to a
    power of two): while requests wait the batch grows into the pool allocated once; once nobody
    waits, finished rows leave it, so a long tail decodes at its own batch, not at ``plan.rows``."""
    if graph:
        request.getfixturevalue("cpu_graphs")
    sched = _sched(max_num_seqs=4, cuda_graph=graph)
    storage = None
    lengths = [1, 2, 3, 9, 4]
    for i, (p, n) in enumerate(zip(_prompts(5, seed=11), lengths)):
        sched.add_request(str(i), p, RequestParams(max_tokens=n, temperature=0, ignore_eos=True))
    sizes, out = [], {}
    while sched.has_unfinished():
        for o in sched.step():
            out[o.request_id] = o
        eng = sched.engine
        storage = storage or eng.pool.k_all.untyped_storage().data_ptr()
        assert eng.pool.k_all.untyped_storage().data_ptr() == storage  # the pool allocated once, never again
        assert eng.count.numel() == sched.pristine + 1 <= sched.plan.rows + 1
        assert int(eng.count[sched.pristine]) == 0  # the pristine row stays last and never fed
        sizes.append(eng.count.numel())
    assert sizes[0] == 5 and sizes[-1] == 2  # four rows and the pristine one; the long tail alone
    assert sizes == sorted(sizes, reverse=True)  # nothing arrives late here: the batch only shrinks
    if graph:
        assert {s - 1 for s in sizes} <= {1, 2, 4}  # powers of two
        assert 1 < sched.runner.graphs.captures <= len(set(sizes))
    else:
        assert 3 in {s - 1 for s in sizes}  # three rows running: no rounding up
    for i, n in enumerate(lengths):
        assert out[str(i)].token_ids == _alone(_prompts(5, seed=11)[i], RequestParams(
            max_tokens=n, temperature=0, ignore_eos=True)).token_ids
    sched.close()


def test_generate_records_the_same_graph_meta_on_both_paths(cpu_graphs):
    """The scheduler path's ``meta`` graph entries are the one-pool path's (`graphs.graph_meta`)."""
    ids = torch.randint(3, 128, (5, 9), generator=torch.Generator().manual_seed(6))
    kw = dict(policy=RKV(window=3, buffer=2), budget=6, max_new_tokens=6, temperature=0, prefill_chunk=4,
              backend="torch")
    keys = ("cuda_graph", "fused", "graph_captures")
    for graph in (False, True):
        one_pool = generate(MODEL, ids, cuda_graph=graph, **kw).meta
        scheduled = generate(MODEL, ids, cuda_graph=graph, max_num_seqs=2, **kw).meta
        assert "scheduler" in scheduled and "scheduler" not in one_pool
        assert [scheduled[k] for k in keys[:2]] == [one_pool[k] for k in keys[:2]]
        assert (scheduled["graph_captures"] > 0) == (one_pool["graph_captures"] > 0) == graph
        assert "capture_s" in scheduled
