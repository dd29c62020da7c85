"""Neighbour independence of the continuous-batching scheduler: a request's tokens (greedy, or
sampled with its own seed) and log-probs are those it gets alone through the same scheduler,
whatever arrives beside it and when, for every registered policy (and the one-file toy policy)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsecorr.decoding import RequestParams, Scheduler
from sparsecorr.decoding.policies import POLICIES, get_policy
from tests.models import tiny_model
from tests.unit.decoding.toy_policy import EveryOther

#: small settings per policy, so 12-token prompts and 10-token decodes compress several times at budget 6
KWARGS = {"streaming_llm": {"sink": 1, "buffer": 2}, "snapkv": {"window": 3, "buffer": 2},
          "rkv": {"window": 3, "buffer": 2}, "block_topk": {"page_size": 4, "dense_layers": 1}}
NAMES = [*sorted(POLICIES), EveryOther.name]
MODEL = tiny_model("qwen3", num_layers=2)


def _policy(name):
    return EveryOther(window=3, buffer=2) if name == EveryOther.name else get_policy(name, **KWARGS.get(name, {}))


def _scheduler(name, rows):
    return Scheduler(MODEL, policy=_policy(name), budget=6, max_model_len=24, backend="torch", prefill_chunk=4,
                     max_num_seqs=rows, eos_token_id=2, generator=torch.Generator().manual_seed(99))


def _serve(sched, requests):
    """Add each request at its arrival step; step until all are done. ``{id: RequestOutput}``."""
    out, step = {}, 0
    pending = sorted(requests, key=lambda r: r[0])
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            sched.add_request(rid, prompt, params)
        for o in sched.step():
            out[o.request_id] = o
        step += 1
    sched.close()
    return out


@st.composite
def workloads(draw):
    n = draw(st.integers(2, 4))
    seeded = draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    reqs = []
    for i in range(n):
        p = draw(st.integers(1, 12))
        params = RequestParams(max_tokens=draw(st.integers(1, 10)), temperature=1.0 if seeded else 0.0,
                               seed=draw(st.integers(0, 1000)) if seeded else None, logprobs=2)
        reqs.append((draw(st.integers(0, 8)), f"r{i}", torch.randint(3, 128, (p,), generator=gen), params))
    return reqs, draw(st.integers(1, 3))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=workloads())
def test_each_request_equals_itself_alone(name, work):
    reqs, rows = work
    together = _serve(_scheduler(name, rows), reqs)
    assert set(together) == {r[1] for r in reqs}
    for arrival, rid, prompt, params in reqs:
        alone = _serve(_scheduler(name, rows), [(0, rid, prompt, params)])[rid]
        got = together[rid]
        assert got.finish_reason == alone.finish_reason and got.finish_reason in ("eos", "length")
        assert got.token_ids == alone.token_ids, (rid, arrival)
        torch.testing.assert_close(got.logprobs, alone.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.topk_logp, alone.topk_logp, atol=1e-5, rtol=0)
