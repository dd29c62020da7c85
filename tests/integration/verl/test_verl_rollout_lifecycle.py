"""verl's control calls on ``SparseCorrServer`` (in process, verl 0.9.1's own ``RolloutConfig`` and
``HFModelConfig``, a tiny Qwen3 on the CPU): no head-of-line blocking, abort of running rows with
their partial tokens, the admission gate, drain, and release / resume while requests wait, with
nothing of the engine alive after ``release_kv_cache`` (the cycle collector off)."""

from __future__ import annotations

import asyncio
import gc
import statistics
import time

import pytest

from tests.integration.verl.rollout_helpers import (
    PROMPTS,
    direct,
    make_server,
    need_verl_and_ray,
    policy_copy,
    save_tiny,
)
from tests.unit.decoding.tracking import track_engines

pytestmark = pytest.mark.usefixtures("verl_ray")
GREEDY = {"temperature": 0.0, "logprobs": True}


@pytest.fixture(scope="module")
def verl_ray():
    need_verl_and_ray()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), max_position_embeddings=512)


async def _until(predicate, timeout_s: float = 30.0):
    t0 = time.perf_counter()
    while not await predicate():
        assert time.perf_counter() - t0 < timeout_s, "timed out"
        await asyncio.sleep(0.005)


async def _running(server, n: int = 1, steps: int = 0):
    state = await server.state()
    return state["running"] >= n and state["steps"] >= steps


@pytest.fixture
def one_thread():
    """One intra-op thread while timing: on shared CPU cores an OpenMP barrier waits for its
    slowest thread, and a descheduled one makes a step of a few ms take hundreds."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_a_short_request_is_not_blocked_by_a_long_one(ckpt, one_thread):
    """Head-of-line: a 4-token request sent while a 400-token one decodes returns within 3x its
    time alone (medians of 3, measured in this test); on the static batcher it was 37-108x."""
    server = make_server(ckpt, max_model_len=512, prompt_length=16, response_length=400, max_num_seqs=4)
    short = {**GREEDY, "max_tokens": 4, "ignore_eos": True}

    async def run():
        await server.launch_server()
        await server.generate(PROMPTS[1], dict(short), "warm-up")
        alone = []
        for i in range(3):
            t0 = time.perf_counter()
            await server.generate(PROMPTS[1], dict(short), f"alone-{i}")
            alone.append(time.perf_counter() - t0)
        long = asyncio.ensure_future(server.generate(PROMPTS[0], {**GREEDY, "max_tokens": 400, "ignore_eos": True},
                                                     "long"))
        await _until(lambda: _running(server, steps=20))
        behind, outs = [], []
        for i in range(3):
            t0 = time.perf_counter()
            outs.append(await server.generate(PROMPTS[1], dict(short), f"behind-{i}"))
            behind.append(time.perf_counter() - t0)
        still_running = not long.done()
        return alone, behind, outs, still_running, await long

    alone, behind, outs, still_running, long = asyncio.run(run())
    assert still_running, "the long request ended before the short ones were measured"
    assert len(long.token_ids) == 400 and all(len(o.token_ids) == 4 for o in outs)
    print("alone", [round(t * 1e3) for t in alone], "behind", [round(t * 1e3) for t in behind])
    slowdown = statistics.median(behind) / statistics.median(alone)
    print(f"\nhead-of-line: alone {statistics.median(alone) * 1e3:.1f} ms, behind a 400-token request "
          f"{statistics.median(behind) * 1e3:.1f} ms ({slowdown:.2f}x)")
    assert slowdown <= 3.0


def test_abort_all_returns_running_rows_partial_tokens_and_gates_new_requests(ckpt):
    """``abort_all_requests`` aborts the running rows (their partial tokens and log-probs, as
    verl's vLLM server) and the queued ones (no tokens); new requests wait at the gate until
    ``resume_generation``; ``reject_request=True`` returns them, and those already waiting,
    aborted at once."""
    server = make_server(ckpt, max_model_len=512, max_num_seqs=2)
    endless = {**GREEDY, "max_tokens": 400, "ignore_eos": True}

    async def run():
        await server.launch_server()
        running = [asyncio.ensure_future(server.generate(PROMPTS[i], dict(endless), f"run-{i}")) for i in range(2)]
        queued = asyncio.ensure_future(server.generate(PROMPTS[0], dict(endless), "queued"))
        await _until(lambda: _running(server, n=2, steps=5))
        report = await server.abort_all_requests()
        outs = await asyncio.gather(*running, queued)
        parked = asyncio.ensure_future(server.generate(PROMPTS[0], {**GREEDY, "max_tokens": 3}, "parked"))
        await asyncio.sleep(0.1)
        was_parked = not parked.done()
        await server.resume_generation()
        parked_out = await parked
        waiting = asyncio.ensure_future(server.generate(PROMPTS[0], {**GREEDY, "max_tokens": 3}, "waiting"))
        await server.abort_all_requests()
        await asyncio.sleep(0.05)
        await server.abort_all_requests(reject_request=True)  # releases the one waiting at the gate
        rejected = await server.generate(PROMPTS[0], {**GREEDY, "max_tokens": 3}, "rejected")
        waiting_out = await waiting
        await server.resume_generation()
        after = await server.generate(PROMPTS[0], {**GREEDY, "max_tokens": 3}, "after")
        return report, outs, was_parked, parked_out, rejected, waiting_out, after

    report, outs, was_parked, parked_out, rejected, waiting_out, after = asyncio.run(run())
    assert report["aborted_count"] == 3 and sorted(report["request_ids"]) == ["queued", "run-0", "run-1"]
    ref = direct(policy_copy(ckpt), list(PROMPTS), max_new_tokens=400, engine=None)
    for i, out in enumerate(outs[:2]):
        assert out.stop_reason == "aborted" and 5 <= len(out.token_ids) < 400
        assert len(out.log_probs) == len(out.token_ids)
        n = min(len(out.token_ids), len(ref[i][0]))  # the direct call may stop at EOS
        assert out.token_ids[:n] == ref[i][0][:n]  # the prefix it had decoded
    assert outs[2].stop_reason == "aborted" and outs[2].token_ids == [] and outs[2].log_probs is None
    assert was_parked and parked_out.stop_reason == "completed"
    assert rejected.stop_reason == waiting_out.stop_reason == "aborted" and waiting_out.token_ids == []
    assert after.stop_reason == "completed"


def test_drain_waits_for_every_request(ckpt):
    """``wait_for_requests_to_drain`` returns once every submitted request, queued (beyond
    ``max_num_seqs``) or running, has its result."""
    server = make_server(ckpt, max_model_len=512, max_num_seqs=2)

    async def run():
        await server.launch_server()
        tasks = [asyncio.ensure_future(server.generate(PROMPTS[i % 2], {**GREEDY, "max_tokens": 8 + 4 * i,
                                                                       "ignore_eos": True}, f"r{i}"))
                 for i in range(5)]
        await _until(lambda: _running(server, n=2))
        await server.wait_for_requests_to_drain()
        return [t.done() for t in tasks], await asyncio.gather(*tasks)

    done, outs = asyncio.run(run())
    assert done == [True] * 5 and [len(o.token_ids) for o in outs] == [8 + 4 * i for i in range(5)]


@pytest.fixture
def tracked(monkeypatch):
    """Weak references to every engine, KV pool, pool tensor and policy-state buffer the server's
    scheduler allocates, with Python's cycle collector off."""
    refs = track_engines(monkeypatch, "sparsecorr.decoding.scheduler")
    gc.collect()
    gc.disable()
    try:
        yield refs
    finally:
        gc.enable()


def test_release_while_requests_run_and_wait_then_resume(ckpt, tracked):
    """``release_kv_cache`` lets the running rows finish, then frees the pool: nothing of the
    engine is alive (collector off). Requests sent while released wait, and are served after
    ``resume_kv_cache``; ``sleep`` / ``wake_up`` do the same around the weights."""
    server = make_server(ckpt, max_model_len=512, max_num_seqs=2)
    params = {**GREEDY, "max_tokens": 30, "ignore_eos": True}

    async def run():
        await server.launch_server()
        running = asyncio.ensure_future(server.generate(PROMPTS[0], dict(params), "running"))
        await _until(lambda: _running(server, steps=3))
        await server.release_kv_cache()
        finished = running.done() and len((await running).token_ids) == 30  # not aborted
        alive = sum(r() is not None for r in tracked)
        late = asyncio.ensure_future(server.generate(PROMPTS[1], {**GREEDY, "max_tokens": 4}, "late"))
        await asyncio.sleep(0.2)
        waited = not late.done() and (await server.state())["waiting"] == 1
        await server.resume_kv_cache()
        late_out = await late
        await server.sleep()
        during_sleep = asyncio.ensure_future(server.generate(PROMPTS[1], {**GREEDY, "max_tokens": 4}, "asleep"))
        await asyncio.sleep(0.1)
        slept = not during_sleep.done()
        await server.wake_up()
        return finished, alive, waited, late_out, slept, await during_sleep

    finished, alive, waited, late_out, slept, asleep_out = asyncio.run(run())
    assert finished and len(tracked) > 0 and alive == 0
    assert waited and late_out.stop_reason == "completed" and len(late_out.token_ids) == 4
    assert slept and asleep_out.token_ids == late_out.token_ids


def test_release_weights_pauses_the_engine_before_moving_them(ckpt, monkeypatch):
    """``release_weights`` waits for the running rows and frees the pool BEFORE the weights move
    (no step can start on host weights); a request sent meanwhile waits for ``resume_weights``."""
    server = make_server(ckpt, max_model_len=512, max_num_seqs=2)
    events = []

    async def run():
        await server.launch_server()
        sched_release = type(await server._driver.call(lambda s: s)).release

        def release(self):
            events.append(("release", self.num_running))
            sched_release(self)

        monkeypatch.setattr(type(await server._driver.call(lambda s: s)), "release", release)
        moved = server.model.to

        def to(*a, **kw):
            events.append(("to", a))
            return moved(*a, **kw)

        monkeypatch.setattr(server.model, "to", to)
        monkeypatch.setattr(server, "device", type(server.device)("cuda"), raising=True)  # take the CUDA path
        running = asyncio.ensure_future(server.generate(PROMPTS[0], {**GREEDY, "max_tokens": 20}, "r"))
        await _until(lambda: _running(server, steps=2))
        monkeypatch.setattr("torch.cuda.empty_cache", lambda: None)
        await server.release_weights()
        done_first = running.done()
        return done_first

    try:
        done_first = asyncio.run(run())
    finally:
        monkeypatch.undo()
    assert done_first
    assert events[0] == ("release", 0) and events[1][0] == "to" and events[1][1] == ("cpu",)
