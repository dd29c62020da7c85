"""Issue 34: with CUDA graphs the decode loop reads a step's EOS flags one step late (the host
launches the next forward before it waits), with the same results as eager decoding: tokens,
lengths, finish reasons, budgets and attended KV equal, log-probs within float noise."""

from __future__ import annotations

import pytest
import torch

import sparsecorr.decoding.engine as engine_mod
import sparsecorr.decoding.graphs as graphs_mod
import sparsecorr.decoding.runner as runner_mod
from sparsecorr.decoding import RKV, Dense, StreamingLLM, generate
from tests.models import tiny_model


def _gen(model, policy, graph, eos):
    ids = torch.randint(3, 128, (6, 9), generator=torch.Generator().manual_seed(3))
    return generate(model, ids, policy=policy, budget=None if policy.name == "dense" else 6, max_new_tokens=24,
                    temperature=1.0, generator=torch.Generator().manual_seed(0), eos_token_id=eos,
                    cuda_graph=graph, logprobs_topk=2, prefill_chunk=4)


@pytest.mark.parametrize("policy", [Dense(), StreamingLLM(sink=1, buffer=2), RKV(window=3, buffer=2)],
                         ids=lambda p: p.name)
def test_graph_steps_with_late_eos_equal_eager_steps(policy, cpu_graphs):
    model = tiny_model("qwen3", num_layers=2)
    eos = [5, 17, 40, 99]
    eager, graph = _gen(model, policy, False, eos), _gen(model, policy, True, eos)
    assert graph.meta["cuda_graph"] == "on"
    assert "eos" in eager.finish_reason and "length" in eager.finish_reason  # rows stop at different steps
    assert graph.finish_reason == eager.finish_reason
    for name in ("tokens", "mask", "lengths", "budget", "kv_kept"):
        assert torch.equal(getattr(graph, name), getattr(eager, name)), name
    torch.testing.assert_close(graph.rollout_logp, eager.rollout_logp, atol=2e-5, rtol=0)


def test_graph_steps_launch_the_next_forward_before_reading_eos(cpu_graphs, monkeypatch):
    events = []
    real_read, real_feed, real_run = runner_mod._read_eos, engine_mod.Engine.feed, graphs_mod.DecodeGraphs.run
    monkeypatch.setattr(runner_mod, "_read_eos", lambda *a: events.append("read") or real_read(*a))
    monkeypatch.setattr(engine_mod.Engine, "feed",
                        lambda self, *a, **kw: events.append("feed") or real_feed(self, *a, **kw))
    # a graph step's forward is the replay (the runner plans it and calls the graphs, not feed)
    monkeypatch.setattr(graphs_mod.DecodeGraphs, "run",
                        lambda self, *a, **kw: events.append("feed") or real_run(self, *a, **kw))
    model = tiny_model("qwen3", num_layers=2)
    prefill = ["feed"] * 3  # 9 prompt tokens in chunks of 4
    for graph, order in ((False, ["read", "feed", "read"]), (True, ["feed", "read", "feed"])):
        events.clear()
        _gen(model, Dense(), graph, [5, 17, 40, 99])
        # eager: step 0's flags are read before step 0's forward; graphs: after it is launched
        assert events[:6] == prefill + order, (graph, events[:8])
