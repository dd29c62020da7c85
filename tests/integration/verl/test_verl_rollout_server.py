"""``SparseCorrServer`` (the body of the ``rollout.name=sparsecorr`` Ray actor), driven in this
process through its async methods: batching equals one direct ``generate``, differing requests,
weight updates, memory release and aborts. The Ray-served path is in test_verl_rollout_ray.py."""

from __future__ import annotations

import asyncio
import gc
import importlib
import weakref

import pytest
import torch

from tests.integration.verl.rollout_helpers import (
    PROMPTS,
    direct,
    model_config,
    need_verl_and_ray,
    rollout_config,
    save_tiny,
)

pytestmark = pytest.mark.usefixtures("verl_ray")


@pytest.fixture(scope="module")
def verl_ray():
    need_verl_and_ray()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def _server(ckpt, *, engine=None, **fields):
    from sparsecorr_verl.rollout import SparseCorrServer
    from verl.workers.rollout.replica import RolloutMode

    return SparseCorrServer(config=rollout_config(engine=engine, **fields), model_config=model_config(ckpt),
                            rollout_mode=RolloutMode.HYBRID)


def _copy(ckpt):
    from sparsecorr_verl.rollout import load_policy_copy

    return load_policy_copy(str(ckpt), device=torch.device("cpu"))


def _eight():
    """2 prompts x 4 requests, ids sorting as the rows of the direct batch."""
    return [(f"req-{i}", PROMPTS[i // 4]) for i in range(8)]


async def _serve(server, requests, params):
    await server.launch_server()
    outs = await asyncio.gather(*[server.generate(p, dict(params), rid) for rid, p in reversed(requests)])
    return list(reversed(outs))


@pytest.mark.parametrize("params,seed", [({"temperature": 0.0}, None),
                                         ({"temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 7}, 7)])
def test_eight_concurrent_requests_equal_one_direct_generate(ckpt, params, seed):
    """Greedy, and seeded sampling: one batch of 8 (the window is long, the batch fills),
    rows ordered by request id, equals ``generate`` on the same 8 prompts with the seed."""
    server = _server(ckpt, engine={**_engine(), "batch_window_ms": 2000})
    outs = asyncio.run(_serve(server, _eight(), {**params, "logprobs": True, "max_tokens": 6}))
    state = asyncio.run(server.state())
    assert state["batches_run"] == 1
    ref = direct(_copy(ckpt), [p for _, p in _eight()], max_new_tokens=6, temperature=params["temperature"],
                 seed=seed, top_k=params.get("top_k"), top_p=params.get("top_p"))
    for out, (tokens, logp) in zip(outs, ref):
        assert out.stop_reason == "completed"
        assert out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(logp), rtol=0, atol=0)
    if seed is not None:  # sampling really happened: the 4 copies of a prompt differ
        assert len({tuple(o.token_ids) for o in outs[:4]}) > 1


def _engine():
    from tests.integration.verl.rollout_helpers import ENGINE

    return dict(ENGINE)


def test_mixed_max_tokens_and_sampling_params(ckpt):
    """max_tokens differing inside a batch: each row is the direct batch's row cut at its own
    length; differing temperatures split the requests into two engine calls."""
    server = _server(ckpt, engine={**_engine(), "batch_window_ms": 300})

    async def run():
        await server.launch_server()
        greedy = [server.generate(PROMPTS[i % 2], {"temperature": 0.0, "max_tokens": 2 + i, "logprobs": True},
                                  f"g{i}") for i in range(4)]
        seeded = [server.generate(PROMPTS[i % 2], {"temperature": 0.7, "seed": 3, "max_tokens": 5,
                                                   "logprobs": False}, f"s{i}") for i in range(2)]
        return await asyncio.gather(*greedy, *seeded)

    outs = asyncio.run(run())
    assert asyncio.run(server.state())["batches_run"] == 2
    model = _copy(ckpt)
    ref = direct(model, [PROMPTS[i % 2] for i in range(4)], max_new_tokens=5)
    for i, out in enumerate(outs[:4]):
        assert out.token_ids == ref[i][0][:2 + i]
        assert out.log_probs == pytest.approx(ref[i][1][:2 + i], abs=0)
    ref_s = direct(model, [PROMPTS[0], PROMPTS[1]], max_new_tokens=5, temperature=0.7, seed=3)
    assert [o.token_ids for o in outs[4:]] == [r[0] for r in ref_s]
    assert all(o.log_probs is None for o in outs[4:])  # logprobs=False: none returned


def test_over_long_prompt_and_unsupported_inputs_name_the_field(ckpt):
    server = _server(ckpt, max_model_len=12)

    async def run(prompt, params, **kw):
        await server.launch_server()
        return await server.generate(prompt, params, "r", **kw)

    with pytest.raises(ValueError, match=r"prompt_ids: expected at most 11 tokens .*max_model_len=12.*got 12"):
        asyncio.run(run(list(range(3, 15)), {}))
    with pytest.raises(ValueError, match="repetition_penalty"):
        asyncio.run(run([5, 6], {"repetition_penalty": 1.1}))
    with pytest.raises(ValueError, match=r"image_data: .*multi-modal"):
        asyncio.run(run([5, 6], {}, image_data=["img"]))
    with pytest.raises(ValueError, match=r"sampling_params: .*\['stop'\]"):
        asyncio.run(run([5, 6], {"stop": ["x"]}))
    # max_tokens beyond the context is clamped (as verl's vLLM server does): 12 - 9 = 3 tokens
    out = asyncio.run(run(PROMPTS[0], {"temperature": 0.0, "max_tokens": 50}))
    assert len(out.token_ids) == 3


def test_update_weights_then_rollout_equals_direct_generate(ckpt):
    """The actor's perturbed full tensors copied in place: the next rollout is the direct
    ``generate`` of a model holding them (and differs from before)."""
    server = _server(ckpt)
    model = _copy(ckpt)
    g = torch.Generator().manual_seed(1)
    perturbed = {n: p.detach() + 0.5 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}

    async def run():
        await server.launch_server()
        before = await server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 6, "logprobs": True}, "a")
        ids = {id(p) for p in server.model.parameters()}
        copied = await server.update_weights(list(perturbed.items()))
        assert {id(p) for p in server.model.parameters()} == ids  # in place
        after = await server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 6, "logprobs": True}, "b")
        return before, copied, after

    before, copied, after = asyncio.run(run())
    assert copied == len(perturbed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(perturbed[n])
    tokens, logp = direct(model, [PROMPTS[0]], max_new_tokens=6)[0]
    assert after.token_ids == tokens and after.log_probs == pytest.approx(logp, abs=0)
    assert after.log_probs != before.log_probs
    with pytest.raises(ValueError, match=r"named_tensors: 'nope.weight' is not a parameter"):
        asyncio.run(_update(server, [("nope.weight", torch.zeros(1))]))


async def _update(server, pairs):
    await server.launch_server()
    return await server.update_weights(pairs)


@pytest.fixture
def tracked_pools(monkeypatch):
    """Weak references to every KV pool and pool tensor the engine creates."""
    engine_mod = importlib.import_module("sparsecorr.decoding.engine")
    from sparsecorr.decoding.pool import KVPool

    refs: list[weakref.ref] = []

    class TrackedPool(KVPool):
        def __init__(self, **kw):
            super().__init__(**kw)
            refs.append(weakref.ref(self))
            refs.extend(weakref.ref(t) for t in (*self.k, *self.v))

    monkeypatch.setattr(engine_mod, "KVPool", TrackedPool)
    gc.collect()
    gc.disable()
    try:
        yield refs
    finally:
        gc.enable()


def test_release_kv_cache_leaves_no_pool_and_resume_serves(ckpt, tracked_pools):
    """With the cycle collector off: after ``release_kv_cache`` no pool (nor pool tensor) is
    alive; a request sent while released waits, and is served after ``resume_kv_cache``."""
    server = _server(ckpt)

    async def run():
        await server.launch_server()
        await asyncio.gather(*[server.generate(p, {"temperature": 0.0, "max_tokens": 4}, f"r{i}")
                               for i, p in enumerate(PROMPTS)])
        await server.release_kv_cache()
        alive = sum(r() is not None for r in tracked_pools)
        pending = asyncio.ensure_future(server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 4}, "late"))
        await asyncio.sleep(0.2)
        waited = not pending.done()
        await server.resume_kv_cache()
        out = await pending
        await server.sleep()
        await server.wake_up()
        again = await server.generate(PROMPTS[1], {"temperature": 0.0, "max_tokens": 4}, "again")
        return alive, waited, out, again

    alive, waited, out, again = asyncio.run(run())
    assert len(tracked_pools) > 0 and alive == 0
    assert waited and out.stop_reason == "completed" and len(out.token_ids) == 4
    assert again.stop_reason == "completed"


def test_abort_all_requests_resolves_waiting_as_aborted(ckpt):
    server = _server(ckpt)

    async def run():
        await server.launch_server()
        await server.release_kv_cache()  # nothing runs: every request waits
        waiting = [asyncio.ensure_future(server.generate(PROMPTS[0], {"max_tokens": 3}, f"w{i}")) for i in range(3)]
        await asyncio.sleep(0.1)
        report = await server.abort_all_requests()
        outs = await asyncio.gather(*waiting)
        late = asyncio.ensure_future(server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 3}, "late"))
        await asyncio.sleep(0.1)
        parked = not late.done()
        await server.resume_generation()
        await server.resume_kv_cache()
        rejected = None
        late_out = await late
        await server.abort_all_requests(reject_request=True)
        rejected = await server.generate(PROMPTS[0], {"max_tokens": 3}, "rejected")
        return report, outs, parked, late_out, rejected

    report, outs, parked, late_out, rejected = asyncio.run(run())
    assert report["aborted_count"] == 3 and sorted(report["request_ids"]) == ["w0", "w1", "w2"]
    assert all(o.stop_reason == "aborted" and o.token_ids == [] for o in outs)
    assert parked and late_out.stop_reason == "completed"
    assert rejected.stop_reason == "aborted"


def test_engine_options_come_from_engine_kwargs_and_are_checked():
    from sparsecorr_verl.rollout import EngineOptions, engine_options

    cfg = rollout_config(engine={"policy": "snapkv", "budget": 64, "cuda_graph": False})
    assert engine_options(cfg) == EngineOptions(policy="snapkv", budget=64, cuda_graph=False)
    assert engine_options(rollout_config(engine={})) == EngineOptions()  # dense, auto backend
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['budgett'\]"):
        engine_options(rollout_config(engine={"policy": "rkv", "budgett": 3}))
    with pytest.raises(ValueError, match="budget: policy 'rkv' needs a budget or a schedule"):
        engine_options(rollout_config(engine={"policy": "rkv"}))
    both = rollout_config(engine={"policy": "dense"}, custom={"sparsecorr": {"policy": "dense"}})
    with pytest.raises(ValueError, match="in one place, got both"):
        engine_options(both)
    custom = rollout_config(custom={"sparsecorr": {"policy": "rkv", "budget": 8}}, engine_kwargs={})
    assert engine_options(custom).budget == 8


def test_full_determinism_seeds_every_batch_like_verls_vllm_server(ckpt):
    """``rollout.full_determinism``: a request without a seed samples with ``rollout.seed +
    replica_rank``, so the same batch sent twice gives the same tokens."""
    server = _server(ckpt, full_determinism=True, seed=5, engine={**_engine(), "batch_window_ms": 1000})
    params = {"temperature": 1.0, "max_tokens": 6, "logprobs": True}
    first = asyncio.run(_serve(server, _eight(), params))
    server = _server(ckpt, full_determinism=True, seed=5, engine={**_engine(), "batch_window_ms": 1000})
    again = asyncio.run(_serve(server, _eight(), params))
    ref = direct(_copy(ckpt), [p for _, p in _eight()], max_new_tokens=6, temperature=1.0, seed=5)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == [r[0] for r in ref]
