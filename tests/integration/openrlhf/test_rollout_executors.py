"""OpenRLHF 0.11.2's own agent executors (``openrlhf/utils/agent.py``) against the sparse rollout
actor, in process (a tiny Qwen3 on the CPU): ``SingleTurnAgentExecutor.execute`` records the
sparse sampler's log-probs as ``rollout_log_probs`` (equal to a direct ``generate`` on the same
prompt and seed), a ``MultiTurnAgentExecutor`` round continues from the environment's feedback,
and ``generate_responses`` runs the executor ``num_samples`` times concurrently. The executors
need ``aiohttp`` and ``pylatexenc`` (``make test-lowest`` installs them); without, skipped."""

from __future__ import annotations

import asyncio

import pytest
import torch
from sparsecorr_openrlhf.rollout import SparseRolloutActor

from tests.integration.openrlhf.rollout_helpers import (
    ENGINE,
    direct,
    need_openrlhf_executors,
    openrlhf_params,
    save_tiny,
    word_tokenizer,
)

PROMPT = "w5 w6 w7 w8"


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    need_openrlhf_executors()
    made = SparseRolloutActor(str(save_tiny(tmp_path_factory.mktemp("tiny"))), sampler={**ENGINE, "max_num_seqs": 4},
                              max_model_len=64, seed=1)
    yield made
    asyncio.run(made.close())


def test_single_turn_executor_records_the_sparse_samplers_logprobs(actor):
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    params = openrlhf_params(temperature=1.0, max_tokens=10, seed=7)
    out = asyncio.run(SingleTurnAgentExecutor().execute(prompt=PROMPT, label="x", sampling_params=params,
                                                       max_length=32, hf_tokenizer=word_tokenizer(), llm_engine=actor))
    prompt = [5, 6, 7, 8]
    tokens, logps = direct(actor.model, prompt, max_new_tokens=10, temperature=1.0, seed=7)
    assert out["observation_tokens"] == prompt + tokens and out["action_ranges"] == [(4, 4 + len(tokens))]
    assert out["rollout_log_probs"][:4] == [0.0] * 4
    torch.testing.assert_close(torch.tensor(out["rollout_log_probs"][4:]), torch.tensor(logps), rtol=0, atol=1e-5)
    assert out["truncated"] == (len(tokens) == 10 and tokens[-1] != 2)


class _TwoTurns:
    """An environment of two turns: after the first action it answers ``w40 w41``, then stops."""

    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return states

    async def step(self, state_dict, **kwargs):
        self.turn += 1
        return {"rewards": torch.tensor(float(self.turn)), "scores": torch.tensor(1.0),
                "environment_feedback": " w40 w41" if self.turn == 1 else "", "done": self.turn == 2}


def test_a_multi_turn_round_continues_from_the_feedback(actor):
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

    instance = type("TwoTurns", (_TwoTurns, AgentInstanceBase), {})
    prompt = [5, 6, 7, 8]
    stop = direct(actor.model, prompt, max_new_tokens=3)[0][-1]  # the first action ends at its 3rd token (or before)
    params = openrlhf_params(temperature=0.0, max_tokens=6, stop_token_ids=[stop])
    out = asyncio.run(MultiTurnAgentExecutor(instance).execute(prompt=PROMPT, label="x", sampling_params=params,
                                                              max_length=24, hf_tokenizer=word_tokenizer(),
                                                              llm_engine=actor))
    first, first_lp = direct(actor.model, prompt, max_new_tokens=20, eos=(2, stop))
    ctx = prompt + first + [40, 41]
    second, second_lp = direct(actor.model, ctx, max_new_tokens=24 - len(ctx), eos=(2, stop))
    assert out["observation_tokens"] == ctx + second
    assert out["action_ranges"] == [(4, 4 + len(first)), (len(ctx), len(ctx) + len(second))]
    want = [0.0] * 4 + first_lp + [0.0, 0.0] + second_lp
    torch.testing.assert_close(torch.tensor(out["rollout_log_probs"]), torch.tensor(want), rtol=0, atol=1e-5)
    assert out["reward"] == 3.0


def test_generate_responses_runs_the_executor_per_sample(actor):
    params = openrlhf_params(temperature=1.0, max_tokens=5)
    outs = asyncio.run(actor.generate_responses(PROMPT, "x", params, 32, word_tokenizer(), num_samples=3))
    assert len(outs) == 3 and all(o["observation_tokens"][:4] == [5, 6, 7, 8] for o in outs)
    assert all(len(o["rollout_log_probs"]) == len(o["observation_tokens"]) for o in outs)
    assert actor.get_num_unfinished_requests() == 0
