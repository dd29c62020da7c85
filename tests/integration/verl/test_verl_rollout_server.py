"""``SparseCorrServer`` (the body of the ``rollout.name=sparsecorr`` Ray actor) on the
continuous-batching scheduler, driven in this process through its async methods: concurrent
requests equal direct ``generate`` calls, per-request seeds and parameters, bad requests and
failing steps that stay with their callers, weight updates. Abort, drain, release and the
head-of-line case are in test_verl_rollout_lifecycle.py; the Ray-served path in
test_verl_rollout_ray.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.integration.verl.rollout_helpers import (
    PROMPTS,
    direct,
    make_server,
    need_verl_and_ray,
    policy_copy,
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


def _server(ckpt, **kw):
    return make_server(ckpt, **kw)


def _copy(ckpt):
    return policy_copy(ckpt)


def _eight():
    """2 prompts x 4 requests."""
    return [(f"req-{i}", PROMPTS[i // 4]) for i in range(8)]


async def _serve(server, requests, params):
    await server.launch_server()
    outs = await asyncio.gather(*[server.generate(p, dict(params), rid) for rid, p in reversed(requests)])
    return list(reversed(outs))


def _engine():
    from tests.integration.verl.rollout_helpers import ENGINE

    return dict(ENGINE)


def _same_logp(got, want):
    """The scheduler's log-probs against one direct ``generate``: the parity tests' tolerance (its
    fixed batch differs from the direct call's, so float sums may round differently)."""
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)


def test_eight_concurrent_greedy_requests_equal_direct_generate(ckpt):
    """8 concurrent greedy requests share the running batch; each equals the direct ``generate``
    of its prompt, and nothing ever waits beyond ``rollout.max_num_seqs`` rows."""
    server = _server(ckpt)
    outs = asyncio.run(_serve(server, _eight(), {"temperature": 0.0, "logprobs": True, "max_tokens": 6}))
    ref = direct(_copy(ckpt), list(PROMPTS), max_new_tokens=6)
    for (_, prompt), out in zip(_eight(), outs, strict=True):
        tokens, logp = ref[PROMPTS.index(prompt)]
        assert out.stop_reason == "completed" and out.token_ids == tokens
        _same_logp(out.log_probs, logp)
    state = asyncio.run(server.state())
    assert state["rows"] == 8 and state["max_resident"] <= 8 and state["waiting"] == state["running"] == 0


def test_seeded_requests_sample_from_their_own_seed(ckpt):
    """A request's ``seed`` is its own generator (vLLM's per-request seed): its tokens are the same
    sent alone or among others; copies of a prompt with different seeds differ."""
    server = _server(ckpt)
    params = {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "max_tokens": 6}
    requests = [(f"s{i}", PROMPTS[i % 2], i) for i in range(6)]

    async def run():
        await server.launch_server()
        together = await asyncio.gather(*[server.generate(p, {**params, "seed": s}, rid) for rid, p, s in requests])
        alone = [await server.generate(p, {**params, "seed": s}, rid + "-alone") for rid, p, s in requests]
        return together, alone

    together, alone = asyncio.run(run())
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in together[0::2]}) > 1  # one prompt, three seeds


def test_mixed_max_tokens_and_sampling_params_share_the_batch(ckpt):
    """Requests with different ``max_tokens`` and temperatures decode in the same steps; each
    greedy row is the direct ``generate`` cut at its own length."""
    server = _server(ckpt)

    async def run():
        await server.launch_server()
        greedy = [server.generate(PROMPTS[i % 2], {"temperature": 0.0, "max_tokens": 2 + i, "logprobs": True},
                                  f"g{i}") for i in range(4)]
        sampled = [server.generate(PROMPTS[i % 2], {"temperature": 0.7, "seed": 3, "max_tokens": 5,
                                                    "logprobs": False}, f"s{i}") for i in range(2)]
        return await asyncio.gather(*greedy, *sampled)

    outs = asyncio.run(run())
    assert asyncio.run(server.state())["max_resident"] == 6  # one running batch
    ref = direct(_copy(ckpt), [PROMPTS[i % 2] for i in range(4)], max_new_tokens=5)
    for i, out in enumerate(outs[:4]):
        assert out.token_ids == ref[i][0][:2 + i]
        _same_logp(out.log_probs, ref[i][1][:2 + i])
    assert all(len(o.token_ids) == 5 and o.log_probs is None for o in outs[4:])  # logprobs=False: none


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


def test_a_bad_request_fails_only_its_caller_and_the_next_completes(ckpt):
    """Concurrent with good requests, requests with a bad parameter get a ValueError naming the
    field; the others, and the next request, complete."""
    server = _server(ckpt)
    good = {"temperature": 0.0, "max_tokens": 4}

    async def run():
        await server.launch_server()
        outs = await asyncio.gather(
            server.generate(PROMPTS[0], dict(good), "good-0"),
            server.generate(PROMPTS[0], {**good, "top_p": 0.0}, "bad-top-p"),
            server.generate(PROMPTS[1], {**good, "seed": -1, "temperature": 1.0}, "bad-seed"),
            server.generate(PROMPTS[1], {**good, "stop_token_ids": ["x"]}, "bad-stop"),
            server.generate(PROMPTS[1], dict(good), "good-1"), return_exceptions=True)
        return outs, await server.generate(PROMPTS[0], dict(good), "next")

    outs, nxt = asyncio.run(run())
    assert isinstance(outs[1], ValueError) and "sampling_params.top_p" in str(outs[1])
    assert isinstance(outs[2], ValueError) and "sampling_params.seed" in str(outs[2])
    assert isinstance(outs[3], ValueError) and "sampling_params.stop_token_ids" in str(outs[3])
    assert outs[0].stop_reason == outs[4].stop_reason == nxt.stop_reason == "completed"


def test_an_error_inside_a_step_fails_its_rows_and_the_server_goes_on(ckpt):
    """A forward that raises fails the requests of that step (their callers get the error); the
    next request completes and equals the direct ``generate``."""
    server = _server(ckpt)

    async def run():
        await server.launch_server()
        armed = {"on": True}

        def boom(_module, _args):
            if armed["on"]:
                raise RuntimeError("injected forward failure")

        handle = server.model.model.layers[0].register_forward_pre_hook(boom)
        try:
            failed = await asyncio.gather(server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 4}, "a"),
                                          return_exceptions=True)
        finally:
            handle.remove()
        return failed[0], await server.generate(PROMPTS[0], {"temperature": 0.0, "max_tokens": 4}, "b")

    failed, nxt = asyncio.run(run())
    assert isinstance(failed, RuntimeError) and "injected forward failure" in str(failed)
    assert nxt.token_ids == direct(_copy(ckpt), [PROMPTS[0]], max_new_tokens=4)[0][0]


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
    assert after.token_ids == tokens
    _same_logp(after.log_probs, logp)
    assert after.log_probs != before.log_probs
    with pytest.raises(ValueError, match=r"named_tensors: 'nope.weight' is not a parameter"):
        asyncio.run(_update(server, [("nope.weight", torch.zeros(1))]))


async def _update(server, pairs):
    await server.launch_server()
    return await server.update_weights(pairs)


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


def test_full_determinism_seeds_every_request_like_verls_vllm_server(ckpt):
    """``rollout.full_determinism``: a request without a seed samples with ``rollout.seed +
    replica_rank`` (its own generator), so the same requests on two servers give the same tokens,
    and two requests with one prompt give the same tokens (as vLLM's per-request seed)."""
    params = {"temperature": 1.0, "max_tokens": 6, "logprobs": True}
    first = asyncio.run(_serve(_server(ckpt, full_determinism=True, seed=5), _eight(), params))
    again = asyncio.run(_serve(_server(ckpt, full_determinism=True, seed=5), _eight(), params))
    other = asyncio.run(_serve(_server(ckpt, full_determinism=True, seed=6), _eight(), params))
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first[:4]}) == 1
    assert [o.token_ids for o in first] != [o.token_ids for o in other]
