"""The rollout server's engine thread (`EngineDriver`) over a stand-in scheduler (no verl, Ray or
model): requests join the running batch at the next step, every scheduler call runs on the one
engine thread, the free-slot feeding, abort of running rows (partial tokens), pause and drain,
and failures that stay with their request."""

from __future__ import annotations

import asyncio
import threading

import pytest
from sparsecorr_verl.rollout.driver import EngineDriver
from sparsecorr_verl.rollout.requests import parse_request

from tests.integration.verl.fake_scheduler import FakeScheduler


def _request(rid, max_tokens=3, **params):
    return parse_request(rid, [5, 6], {"temperature": 0.0, "max_tokens": max_tokens, **params},
                         max_model_len=4096, default_max_tokens=4, vocab_size=128)


@pytest.fixture
def serve():
    """``serve(**fake_scheduler_kwargs) -> (driver, scheduler)``, started; closed after the test."""
    made = []

    def make(**kw):
        sched = FakeScheduler(**kw)
        driver = EngineDriver(lambda: sched)
        driver.start()
        made.append(driver)
        return driver, sched

    yield make
    for driver in made:
        asyncio.run(driver.close())


async def _after_steps(sched, n: int, dt: float) -> None:
    """Return once the scheduler ran ``n`` steps."""
    while sched.steps < n:
        await asyncio.sleep(dt)


def test_a_short_request_joins_the_running_batch_at_the_next_step(serve):
    driver, sched = serve(rows=4, step_s=0.005)

    async def run():
        long = asyncio.ensure_future(driver.submit(_request("long", max_tokens=200)))
        await _after_steps(sched, 20, 0.005)
        short = await driver.submit(_request("short", max_tokens=3))
        done_while_long_runs = not long.done()
        return short, done_while_long_runs, await long

    short, early, long = asyncio.run(run())
    assert early and short.token_ids == (100, 101, 102) and len(long.token_ids) == 200
    assert sched.admitted_at["short"] >= 20  # it joined the running batch, it did not wait for it
    assert sched.threads == {driver._thread.ident} and driver._thread.ident != threading.get_ident()
    asyncio.run(driver.close())
    assert sched.closed and not driver._thread.is_alive()


def test_requests_beyond_the_free_slots_wait_here_and_all_complete(serve):
    driver, sched = serve(rows=2)

    async def run():
        return await asyncio.gather(*[driver.submit(_request(f"r{i}", max_tokens=2 + i)) for i in range(7)])

    outs = asyncio.run(run())
    assert [len(o.token_ids) for o in outs] == [2 + i for i in range(7)]
    assert sched.max_resident == 2 and sched.max_waiting <= 2  # fed to free slots only


def test_abort_all_returns_running_rows_partial_tokens_and_queued_empty(serve):
    driver, sched = serve(rows=1, step_s=0.005)

    async def run():
        running = asyncio.ensure_future(driver.submit(_request("run", max_tokens=500)))
        queued = asyncio.ensure_future(driver.submit(_request("queued", max_tokens=5)))
        await _after_steps(sched, 5, 0.005)
        ids = await driver.abort_all()
        return ids, await running, await queued

    ids, running, queued = asyncio.run(run())
    assert sorted(ids) == ["queued", "run"]
    assert running.finish_reason == "aborted" and 5 <= len(running.token_ids) < 500
    assert len(running.logprobs) == len(running.token_ids)
    assert queued.finish_reason == "aborted" and queued.token_ids == ()


def test_pause_lets_running_rows_finish_and_holds_new_ones_until_resume(serve):
    driver, sched = serve(rows=2, step_s=0.002)

    async def run():
        first = asyncio.ensure_future(driver.submit(_request("first", max_tokens=30)))
        await _after_steps(sched, 3, 0.002)
        await driver.pause()
        finished = first.done() and not sched.has_unfinished()
        await driver.call(lambda s: s.release())
        late = asyncio.ensure_future(driver.submit(_request("late", max_tokens=3)))
        await asyncio.sleep(0.05)
        held = not late.done() and sched.num_waiting == 0 and (await driver.stats())["waiting"] == 1
        await driver.resume()
        return finished, held, (await first), (await late)

    finished, held, first, late = asyncio.run(run())
    assert finished and held and sched.released == 1
    assert len(first.token_ids) == 30 and late.finish_reason == "length"


def test_drain_waits_for_every_submitted_request(serve):
    driver, _sched = serve(rows=1, step_s=0.002)

    async def run():
        tasks = [asyncio.ensure_future(driver.submit(_request(f"r{i}", max_tokens=4))) for i in range(4)]
        await asyncio.sleep(0)
        await driver.drain()
        return [t.done() for t in tasks]

    assert asyncio.run(run()) == [True] * 4


def test_a_refused_request_fails_only_its_caller(serve):
    driver, _sched = serve(rows=2)

    async def run():
        bad = driver.submit(_request("bad", max_tokens=2000))
        good = driver.submit(_request("good"))
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, ValueError) and "max_tokens" in str(bad)
    assert good.finish_reason == "length"


def test_a_failing_step_fails_its_rows_and_the_driver_goes_on(serve):
    driver, sched = serve(rows=4, fail_on="boom")

    async def run():
        first = await asyncio.gather(driver.submit(_request("boom")), driver.submit(_request("other")),
                                     return_exceptions=True)
        sched.fail_on = None
        return first, await driver.submit(_request("next"))

    (boom, other), nxt = asyncio.run(run())
    assert isinstance(boom, RuntimeError) and isinstance(other, RuntimeError)
    assert nxt.finish_reason == "length"


def test_a_cancelled_caller_frees_its_row_and_a_duplicate_id_is_refused(serve):
    driver, sched = serve(rows=1, step_s=0.002)

    async def run():
        task = asyncio.ensure_future(driver.submit(_request("gone", max_tokens=1000)))
        while not sched.running:
            await asyncio.sleep(0.002)
        dup = await asyncio.gather(driver.submit(_request("gone")), return_exceptions=True)
        task.cancel()
        await asyncio.sleep(0.05)
        return dup[0], await driver.submit(_request("after"))

    dup, after = asyncio.run(run())
    assert isinstance(dup, ValueError) and "request_id" in str(dup)
    assert after.finish_reason == "length" and not sched.running


def test_a_scheduler_that_cannot_be_built_raises_at_start():
    def bad():
        raise ValueError("max_kv_bytes: expected room for one row, got 10")

    with pytest.raises(ValueError, match="max_kv_bytes"):
        EngineDriver(bad).start()
