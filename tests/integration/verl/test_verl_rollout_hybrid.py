"""``SparseCorrServer`` (``rollout.name=sparsecorr``) serving a hybrid family (issue #52): a tiny
Gemma 3 checkpoint (sliding-window layers beside full ones; window 8 < prompt + response, so the
ring wraps) loaded the way verl hands it over; 8 concurrent greedy requests under RKV each equal
a direct ``generate`` of their prompt; the same for GPT-OSS (sinks too), which the server loads
with transformers' default attention (GPT-OSS has no SDPA: ``_supports_sdpa = False`` in 5.9 and
5.24). Needs Ray and verl, like the other
``test_verl_rollout_*`` files (``make test-lowest``)."""

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
)
from tests.unit.decoding.families import WINDOW, build, family

pytestmark = pytest.mark.usefixtures("verl_ray")
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def verl_ray():
    need_verl_and_ray()


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_hybrid_family_served_equals_direct_generate(name, tmp_path):
    assert max(len(p) for p in PROMPTS) + MAX_TOKENS > WINDOW  # the sliding layers' ring wraps
    model = build(family(name), max_position_embeddings=64)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(tmp_path)
    server = make_server(tmp_path)
    requests = [(f"req-{i}", PROMPTS[i // 4]) for i in range(8)]

    async def run():
        await server.launch_server()
        params = {"temperature": 0.0, "logprobs": True, "max_tokens": MAX_TOKENS}
        return await asyncio.gather(*[server.generate(p, dict(params), rid) for rid, p in requests])

    outs = asyncio.run(run())
    copy = policy_copy(tmp_path)
    assert copy.config.model_type == model.config.model_type
    assert list(copy.config.layer_types) == list(model.config.layer_types)
    ref = direct(copy, list(PROMPTS), max_new_tokens=MAX_TOKENS)
    for (_, prompt), out in zip(requests, outs, strict=True):
        tokens, logp = ref[PROMPTS.index(prompt)]
        assert out.stop_reason == "completed" and out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(logp), rtol=0, atol=1e-5)
