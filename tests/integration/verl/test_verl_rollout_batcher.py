"""The rollout server's request batcher and request parsing, with a recording stand-in for the
engine call (neither verl, Ray nor a model is needed): which requests share a call, in which row
order, the window and the cap, and the engine's errors reaching every request of the call."""

from __future__ import annotations

import asyncio
import time

import pytest
from sparsecorr_verl.rollout.batcher import RequestBatcher
from sparsecorr_verl.rollout.requests import Completion, parse_request


def _request(rid, *, temperature=0.0, seed=None, max_tokens=4, prompt=(5, 6)):
    params = {"temperature": temperature, "max_tokens": max_tokens}
    if seed is not None:
        params["seed"] = seed
    return parse_request(rid, list(prompt), params, max_model_len=64, default_max_tokens=4, vocab_size=128)


class Recorder:
    def __init__(self, fail_on=None):
        self.calls, self.fail_on = [], fail_on

    def __call__(self, requests):
        ids = [r.request_id for r in requests]
        self.calls.append(ids)
        if self.fail_on in ids:
            raise RuntimeError("engine failed")
        return [Completion(token_ids=[len(ids)], log_probs=[-1.0], finish_reason="length") for _ in ids]


def _submit_all(batcher, requests, *, gap_s=0.0):
    async def run():
        tasks = []
        for r in requests:
            tasks.append(asyncio.ensure_future(batcher.submit(r)))
            await asyncio.sleep(gap_s)
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(run())


def test_same_parameters_share_a_call_in_request_id_order_and_keys_split():
    rec = Recorder()
    reqs = [_request("b"), _request("s1", temperature=1.0, seed=3), _request("a"), _request("c"),
            _request("s0", temperature=1.0, seed=3), _request("t", temperature=1.0, seed=4)]
    outs = _submit_all(RequestBatcher(rec, max_batch=8, window_s=0.2), reqs)
    assert sorted(rec.calls) == [["a", "b", "c"], ["s0", "s1"], ["t"]]
    assert [o.token_ids for o in outs] == [[3], [2], [3], [3], [2], [1]]


def test_max_batch_caps_a_call_and_starts_it_without_waiting_the_window():
    rec = Recorder()
    t0 = time.perf_counter()
    _submit_all(RequestBatcher(rec, max_batch=2, window_s=30.0), [_request(f"r{i}") for i in range(4)])
    assert rec.calls == [["r0", "r1"], ["r2", "r3"]]
    assert time.perf_counter() - t0 < 10  # full batches never wait for the 30 s window


def test_the_window_closes_a_batch():
    rec = Recorder()
    _submit_all(RequestBatcher(rec, max_batch=8, window_s=0.05), [_request(f"r{i}") for i in range(3)], gap_s=0.3)
    assert rec.calls == [["r0"], ["r1"], ["r2"]]


def test_an_engine_error_reaches_every_request_of_its_call_only():
    rec = Recorder(fail_on="bad")
    outs = _submit_all(RequestBatcher(rec, max_batch=8, window_s=0.1),
                       [_request("bad"), _request("ok"), _request("other", temperature=0.5)])
    assert isinstance(outs[0], RuntimeError) and isinstance(outs[1], RuntimeError)
    assert isinstance(outs[2], Completion)


def test_parse_request_defaults_clamps_and_refuses():
    r = parse_request("x", [5, 6, 7], {"temperature": 0.7, "top_k": -1, "top_p": 1.0, "logprobs": True},
                      max_model_len=10, default_max_tokens=20, vocab_size=128)
    assert (r.max_tokens, r.key.top_k, r.key.top_p, r.logprobs) == (7, None, None, True)
    with pytest.raises(ValueError, match=r"prompt_ids: expected token ids in \[0, 128\)"):
        parse_request("x", [5, 300], {}, max_model_len=10, default_max_tokens=2, vocab_size=128)
    with pytest.raises(ValueError, match=r"sampling_params\.top_p"):
        parse_request("x", [5], {"top_p": 0.0}, max_model_len=10, default_max_tokens=2, vocab_size=128)
    with pytest.raises(ValueError, match="prompt_ids: expected at least one token"):
        parse_request("x", [], {}, max_model_len=10, default_max_tokens=2, vocab_size=128)
