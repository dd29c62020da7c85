"""`SparseRolloutActor` in process (no Ray, no vLLM; a tiny Qwen3 on the CPU): OpenRLHF's
``generate(prompt_token_ids, sampling_params)`` served by the sparse scheduler, equal to a
direct ``generate``; 8 concurrent requests in one running batch; vLLM fields refused by name;
``sleep`` / ``wake_up`` leave nothing of the engine alive (the cycle collector off)."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from sparsecorr_openrlhf.rollout import SparseRolloutActor, parse_sampling

from tests.integration.openrlhf.rollout_helpers import ENGINE, direct, openrlhf_params, save_tiny
from tests.unit.decoding.drive import alive
from tests.unit.decoding.tracking import track_engines

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19], [20, 21, 22], [23, 24, 25, 26, 27],
           [28, 29, 30], [31, 32, 33, 34]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def actor(ckpt):
    made = SparseRolloutActor(str(ckpt), sampler={**ENGINE, "max_num_seqs": 8}, max_model_len=48, seed=3)
    yield made
    asyncio.run(made.close())


def test_greedy_and_seeded_generate_equal_a_direct_generate(actor):
    async def run():
        greedy = await actor.generate(PROMPTS[0], openrlhf_params(temperature=0.0, max_tokens=12))
        seeded = await actor.generate(PROMPTS[2], openrlhf_params(temperature=1.0, max_tokens=12, seed=11))
        return greedy.outputs[0], seeded.outputs[0]

    greedy, seeded = asyncio.run(run())
    for out, (tokens, logps) in ((greedy, direct(actor.model, PROMPTS[0], max_new_tokens=12)),
                                 (seeded, direct(actor.model, PROMPTS[2], max_new_tokens=12, temperature=1.0,
                                                 seed=11))):
        assert out.token_ids == tokens and out.finish_reason in ("stop", "length")
        got = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(logps), rtol=0, atol=1e-5)
        assert out.text == " ".join(f"w{t}" if t > 2 else "<eos>" for t in tokens)


def test_eight_concurrent_requests_share_the_running_batch_and_each_equals_it_alone(actor):
    async def run():
        params = openrlhf_params(temperature=0.0, max_tokens=10)
        return await asyncio.gather(*[actor.generate(p, params) for p in PROMPTS]), await actor.state()

    outs, state = asyncio.run(run())
    assert state["max_resident"] > 1  # they shared steps
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, logps = direct(actor.model, prompt, max_new_tokens=10)
        assert out.outputs[0].token_ids == tokens and out.prompt_token_ids == prompt
        got = [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs, strict=True)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(logps), rtol=0, atol=1e-5)
    assert actor.get_num_unfinished_requests() == 0


def test_top_logprobs_stop_tokens_and_max_tokens(actor):
    async def run():
        top = await actor.generate(PROMPTS[1], openrlhf_params(temperature=0.0, max_tokens=4, logprobs=3))
        first = top.outputs[0].token_ids[0]
        stopped = await actor.generate(PROMPTS[1], openrlhf_params(temperature=0.0, max_tokens=4,
                                                                   stop_token_ids=[first]))
        none = await actor.generate(PROMPTS[1], openrlhf_params(temperature=0.0, max_tokens=None, logprobs=None))
        return top.outputs[0], stopped.outputs[0], none.outputs[0]

    top, stopped, none = asyncio.run(run())
    assert all(len(d) in (3, 4) and {r.rank for r in d.values()} >= {1, 2, 3} for d in top.logprobs)
    assert top.logprobs[0][top.token_ids[0]].rank == 1  # greedy: the top token
    assert stopped.token_ids == [top.token_ids[0]] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == top.token_ids[0]
    # max_tokens None: until the context (48) is full, or a stop token
    assert none.logprobs is None and (len(none.token_ids) == 48 - 3 or none.finish_reason == "stop")


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1.2), ("presence_penalty", 0.5), ("frequency_penalty", 0.1), ("min_p", 0.05),
    ("n", 2), ("stop", ["w5"]), ("min_tokens", 2), ("top_p", 0.0), ("temperature", -1.0), ("max_tokens", 0),
    ("logprobs", 1.5), ("stop_token_ids", [-1]),
])
def test_a_field_the_sampler_cannot_honour_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"sampling_params.{field}"):
        parse_sampling("r", [5, 6], openrlhf_params(**{field: value}), max_model_len=32, vocab_size=128)


def test_neutral_values_of_the_refused_fields_are_accepted():
    """vLLM's own defaults of the fields the sampler refuses (``best_of`` may equal ``n`` = 1)."""
    neutral = {"n": 1, "best_of": 1, "stop": [], "bad_words": [], "logit_bias": None, "prompt_logprobs": None,
               "presence_penalty": 0.0, "min_p": 0.0, "min_tokens": 0, "top_k": 0, "max_tokens": 5,
               "detokenize": False}
    req = parse_sampling("r", [5, 6], neutral, max_model_len=32, vocab_size=128)
    assert req.params.max_tokens == 5 and req.params.top_k is None and not req.detokenize
    with pytest.raises(ValueError, match=r"sampling_params\.best_of"):
        parse_sampling("r", [5, 6], {**neutral, "best_of": 2}, max_model_len=32, vocab_size=128)


def test_prompts_and_actor_arguments_refused_by_name(actor, ckpt):
    with pytest.raises(ValueError, match="prompt_token_ids: expected at most 47"):
        parse_sampling("r", list(range(3, 51)), openrlhf_params(), max_model_len=48, vocab_size=128)
    with pytest.raises(ValueError, match=r"prompt_token_ids: expected token ids in \[0, 128\)"):
        parse_sampling("r", [5, 500], openrlhf_params(), max_model_len=48, vocab_size=128)
    with pytest.raises(ValueError, match="multi_modal_data"):
        asyncio.run(actor.generate([5, 6], openrlhf_params(), multi_modal_data={"image": [object()]}))
    with pytest.raises(ValueError, match="images"):
        asyncio.run(actor.generate_responses("w5", None, openrlhf_params(), 32, None, images=[object()]))
    with pytest.raises(ValueError, match="update_weight_cuda_ipc: CUDA IPC"):
        asyncio.run(actor.update_weight_cuda_ipc("lm_head.weight", torch.float32, (128, 64), {}))
    with pytest.raises(ValueError, match="use_ray: OpenRLHF's stateless group is NCCL"):
        asyncio.run(actor.init_process_group("127.0.0.1", 29555, 1, 2, "openrlhf", backend="gloo", use_ray=False))
    with pytest.raises(ValueError, match="rank_offset/world_size"):
        asyncio.run(actor.init_process_group("127.0.0.1", 29555, 0, 2, "openrlhf", backend="gloo", use_ray=True))
    with pytest.raises(RuntimeError, match="call init_process_group first"):
        asyncio.run(actor.update_weight("lm_head.weight", torch.float32, (128, 64)))
    with pytest.raises(ValueError, match="tags: expected some of"):
        asyncio.run(actor.wake_up(tags=["everything"]))
    with pytest.raises(ValueError, match=r"tensor_parallel_size: .* expected 1, got 2"):
        SparseRolloutActor(str(ckpt), sampler=ENGINE, max_model_len=48, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="mm_pad_token_ids"):
        SparseRolloutActor(str(ckpt), sampler=ENGINE, max_model_len=48, mm_pad_token_ids={7})
    with pytest.raises(ValueError, match="budget: policy 'rkv' needs a budget"):
        SparseRolloutActor(str(ckpt), sampler={"policy": "rkv"}, max_model_len=48)


def test_sleep_leaves_nothing_of_the_engine_alive_and_wake_up_serves_again(ckpt, monkeypatch):
    refs = track_engines(monkeypatch, "sparsecorr.decoding.scheduler")
    actor = SparseRolloutActor(str(ckpt), sampler={**ENGINE, "max_num_seqs": 2}, max_model_len=48)
    params = openrlhf_params(temperature=0.0, max_tokens=6)
    gc.collect()
    gc.disable()
    try:
        async def run():
            before = await actor.generate(PROMPTS[0], params)
            running = asyncio.ensure_future(actor.generate(PROMPTS[3], openrlhf_params(temperature=0.0, max_tokens=20)))
            await asyncio.sleep(0.05)
            await actor.sleep(level=1)  # the running row finishes first
            finished = running.done()
            live_asleep = alive(refs)
            late = asyncio.ensure_future(actor.generate(PROMPTS[1], params))
            await asyncio.sleep(0.05)
            held = not late.done() and (await actor.state())["held"] == ["kv_cache", "weights"]
            await actor.wake_up(tags=["weights"])
            still_held = not late.done()
            await actor.wake_up(tags=["kv_cache"])
            return before, finished, live_asleep, held, still_held, await late, await actor.generate(PROMPTS[0], params)

        before, finished, live_asleep, held, still_held, late, after = asyncio.run(run())
        assert refs and finished and live_asleep == 0 and held and still_held
        assert late.outputs[0].token_ids == direct(actor.model, PROMPTS[1], max_new_tokens=6)[0]
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        asyncio.run(actor.close())
        assert alive(refs) == 0
    finally:
        gc.enable()


def test_pause_generation_holds_new_requests_until_resume(actor):
    async def run():
        await actor.pause_generation()
        late = asyncio.ensure_future(actor.generate(PROMPTS[0], openrlhf_params(temperature=0.0, max_tokens=3)))
        await asyncio.sleep(0.05)
        held = not late.done()
        await actor.reset_prefix_cache()
        await actor.resume_generation()
        return held, await late

    held, late = asyncio.run(run())
    assert held and len(late.outputs[0].token_ids) <= 3
