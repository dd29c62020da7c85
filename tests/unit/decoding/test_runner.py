"""Issue 50 (point 4): the model runner owns the decode step.

On the CPU the graph path runs through `EagerRunner` (the ``cpu_graphs`` fixture): the same
static-buffer function a CUDA graph captures, here the forward **and** the sampling. Checked: the
graph path (padded buckets, EOS read a step late, sampling inside the step) gives the eager path's
tokens, lengths, finish reasons, budgets, attended KV and log-probs (within 2e-5), greedy and
seeded; the warm-up does not advance the generator; a row's draw does not depend on the rows
beside it; the loop no longer knows about graphs, buckets, padding or the EOS lag."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import sparsecorr.decoding.graphs as graphs_mod
from sparsecorr.decoding import RKV, BlockTopK, Dense, StreamingLLM, generate
from sparsecorr.decoding.graphs import DecodeGraphs, EagerRunner
from sparsecorr.decoding.runner import ModelRunner, StepOutput
from sparsecorr.decoding.sampling import Sampling, sample
from tests.models import tiny_model
from tests.unit.decoding.drive import decode_steps

FIELDS = ("tokens", "mask", "lengths", "budget", "kv_kept", "pruned")


def _gen(model, policy, *, graph: bool, temperature: float, eos, seed=0, **kw):
    ids = torch.randint(3, 128, (7, 8), generator=torch.Generator().manual_seed(5))
    return generate(model, ids, policy=policy, budget=None if policy.name == "dense" else 6, max_new_tokens=20,
                    temperature=temperature, generator=torch.Generator().manual_seed(seed), eos_token_id=eos,
                    cuda_graph=graph, logprobs_topk=3, prefill_chunk=4, **kw)


def _assert_same(got, ref):
    assert got.finish_reason == ref.finish_reason
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    torch.testing.assert_close(got.rollout_logp, ref.rollout_logp, atol=2e-5, rtol=0)
    torch.testing.assert_close(got.topk_logp, ref.topk_logp, atol=2e-5, rtol=0)
    assert torch.equal(got.topk_ids, ref.topk_ids)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0),
                                      dict(temperature=0.8, top_k=20, top_p=0.9)],
                         ids=["greedy", "seeded", "seeded-topk-topp"])
@pytest.mark.parametrize("policy", [Dense(), RKV(window=3, buffer=2), BlockTopK(page_size=4, dense_layers=1)],
                         ids=lambda p: p.name)
def test_graph_path_equals_eager_path(policy, sampling, cpu_graphs):
    model = tiny_model("qwen3", num_layers=2)
    sampling = dict(sampling)
    temperature = sampling.pop("temperature")
    free = _gen(model, policy, graph=False, temperature=temperature, eos=None, **sampling)
    # an EOS set that ends rows at several different steps: the graph batch pads, then shrinks
    eos = sorted({int(free.tokens[r, 2 + 2 * r]) for r in range(7)})
    ref = _gen(model, policy, graph=False, temperature=temperature, eos=eos, **sampling)
    got = _gen(model, policy, graph=True, temperature=temperature, eos=eos, **sampling)
    assert got.meta["cuda_graph"] == "on" and got.meta["graph_captures"] >= 2  # a smaller bucket was met
    assert "eos" in ref.finish_reason and ref.lengths.unique().numel() > 2
    _assert_same(got, ref)


def test_seeded_runs_repeat_and_depend_on_the_seed(cpu_graphs):
    model = tiny_model("qwen3", num_layers=2)
    a = _gen(model, Dense(), graph=True, temperature=1.0, eos=[7, 50], seed=3)
    b = _gen(model, Dense(), graph=True, temperature=1.0, eos=[7, 50], seed=3)
    c = _gen(model, Dense(), graph=True, temperature=1.0, eos=[7, 50], seed=4)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


def test_the_default_generator_samples_the_same_on_both_paths(cpu_graphs):
    """No generator: both paths draw from torch's default one (the warm-up restores it too)."""
    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (5, 6), generator=torch.Generator().manual_seed(1))
    runs = []
    for graph in (False, True):
        torch.manual_seed(123)
        runs.append(generate(model, ids, policy=Dense(), budget=None, max_new_tokens=12, temperature=1.0,
                             eos_token_id=[5, 9, 31], cuda_graph=graph))
    assert runs[1].meta["cuda_graph"] == "on"
    assert torch.equal(runs[0].tokens, runs[1].tokens) and runs[0].finish_reason == runs[1].finish_reason


def test_the_captured_step_samples(cpu_graphs, monkeypatch):
    """The graph step's function returns tokens and log-probs (and the top-k), not logits."""
    seen = []
    real = DecodeGraphs._capture

    def capture(self, spec, step, ids):
        c = real(self, spec, step, ids)
        seen.append(c)
        return c

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    model = tiny_model("qwen3", num_layers=2)
    _gen(model, Dense(), graph=True, temperature=1.0, eos=None)
    assert seen
    fn = seen[0].runner.fn
    assert fn.func is graphs_mod._graph_step
    out = fn()
    assert len(out) == 4 and out[0].dtype == torch.long and out[0].shape == (7,)
    assert out[1].dtype == torch.float32 and out[2].shape == out[3].shape == (7, 3)


def test_the_warm_up_does_not_advance_the_generator():
    g = torch.Generator().manual_seed(11)
    want = torch.empty(4).exponential_(generator=torch.Generator().manual_seed(11))
    runner = EagerRunner(lambda: torch.empty(4).exponential_(generator=g), generators=(g,))
    torch.testing.assert_close(runner.replay(), want)  # the replay draws what the first eager step would


def test_the_warm_up_restores_the_generator_when_it_raises():
    g = torch.Generator().manual_seed(2)
    state = g.get_state()

    def fn():
        torch.empty(8).exponential_(generator=g)
        raise RuntimeError("failed compile")

    with pytest.raises(RuntimeError):
        EagerRunner(fn, generators=(g,))
    assert torch.equal(g.get_state(), state)


def test_a_rows_draw_does_not_depend_on_its_neighbours():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    samp = lambda seed: Sampling(temperature=1.0, top_k=None, top_p=None, k=0,  # noqa: E731
                                 generator=torch.Generator().manual_seed(seed))
    full = sample(logits, samp(1), rows=torch.arange(6), batch=6)[0]
    assert torch.equal(full, sample(logits, samp(1))[0])  # all rows in order: the plain draw
    some = torch.tensor([4, 1, 5])
    assert torch.equal(sample(logits[some], samp(1), rows=some, batch=6)[0], full[some])
    padded = torch.tensor([4, 1, 5, 0])  # a dummy row added: the others draw the same
    assert torch.equal(sample(logits[padded], samp(1), rows=padded, batch=6)[0][:3], full[some])


def _third_token(model, ids) -> tuple[int, int]:
    """A row and its third greedy token, one that row does not produce before."""
    free, _ = decode_steps(model, ids, Dense(), None, steps=6)
    for r in range(ids.shape[0]):
        tok = int(free["tokens"][r, 2])
        if tok not in free["tokens"][r, :2].tolist():
            return r, tok
    raise AssertionError("no row has a new third token")


def test_step_outputs_are_frozen_and_say_which_rows_finished(cpu_graphs):
    """Drive the runner step by step: the eager path reports EOS with the token, the graph path
    one step late (the row was fed its EOS token, its next token dropped)."""
    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(2))
    r, eos_tok = _third_token(model, ids)
    for graphs in (False, True):
        fields, runner = decode_steps(model, ids, Dense(), None, steps=6, eos=[eos_tok], graphs=graphs)
        assert fields["finish_reason"][r] == "eos" and int(fields["lengths"][r]) == 3
        assert isinstance(runner, ModelRunner) and (runner.graphs is not None) == graphs
    out = StepOutput(rows=torch.arange(2), tokens=torch.zeros(2, dtype=torch.long), logp=torch.zeros(2), topk=None,
                     eos=torch.zeros(0, dtype=torch.long), late_eos=torch.zeros(0, dtype=torch.long),
                     fed=torch.arange(2), kept=torch.zeros(2), hidden=None, running=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.running = 0


def test_late_eos_is_reported_after_the_next_forward(cpu_graphs):
    """The runner's own protocol: on the graph path the EOS of step t's tokens comes back in step
    t + 1's ``late_eos`` (its rows among that step's ``fed``), eagerly in step t's ``eos``."""
    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(2))
    r, eos_tok = _third_token(model, ids)
    reports = {}
    real_step = ModelRunner.step

    def step(self, **kw):
        out = real_step(self, **kw)
        reports.setdefault(self.graphs is not None, []).append((out.rows.tolist(), out.eos.tolist(),
                                                                 out.late_eos.tolist(), out.fed.tolist()))
        return out

    import unittest.mock

    with unittest.mock.patch.object(ModelRunner, "step", step):
        decode_steps(model, ids, Dense(), None, steps=6, eos=[eos_tok], graphs=False)
        decode_steps(model, ids, Dense(), None, steps=6, eos=[eos_tok], graphs=True)
    eager, graph = reports[False], reports[True]
    # step index 1 samples token 2: row r's EOS, read at once eagerly
    assert r in eager[1][1] and r in eager[1][0] and r not in eager[1][2]
    assert r not in eager[2][3]  # eager: not fed again
    # graph: step 2 feeds row r its EOS token and reports it late, without a token for it
    assert r not in graph[1][1] and r in graph[1][0]
    assert r in graph[2][2] and r in graph[2][3] and r not in graph[2][0]


def test_the_loop_knows_nothing_of_graphs_buckets_padding_or_the_eos_lag():
    import sparsecorr.decoding.loops as loops_mod

    text = Path(loops_mod.__file__).read_text()
    assert re.findall(r"graph|bucket|padded|lag|dumm", text, flags=re.IGNORECASE) == []


@pytest.mark.parametrize("policy", [StreamingLLM(sink=1, buffer=2)], ids=lambda p: p.name)
def test_the_runner_holds_no_reference_back_from_its_graphs(policy, cpu_graphs):
    import gc

    from sparsecorr.decoding.engine import Engine

    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(1))
    _, runner = decode_steps(model, ids, policy, 5, steps=5, graphs=True)
    for c in runner.graphs.captured.values():
        refs = gc.get_referents(c.runner, c.runner.fn, *c.runner.fn.args)
        assert not any(isinstance(r, (Engine, ModelRunner)) for r in refs)
    runner.close()
    assert runner.engine is None and runner.graphs is None


def test_the_host_plan_is_frozen_and_the_graph_reads_named_static_buffers(cpu_graphs):
    """Issue 50: the step plan is immutable on the host; a captured step reads its twin's
    buffers (`StaticStep`), refreshed in place, and what a forward makes (masks) is not written
    back into any plan."""
    from sparsecorr.decoding.cache import Step
    from sparsecorr.decoding.graphs import StaticStep

    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(1))
    _, runner = decode_steps(model, ids, RKV(window=2, buffer=2), 5, steps=6, graphs=True)
    engine = runner.engine
    plan = engine.plan(1, torch.ones(len(engine.count), dtype=torch.long), decode=True, static=True)
    assert isinstance(plan, Step) and plan.mask is None  # a static plan's mask is made inside the graph
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mask = None
    (static,) = runner.graphs.captured.values()
    assert isinstance(static, StaticStep) and static.step.mask is None  # the replay's mask was not written back
    addresses = [t.data_ptr() for t in (static.step.slots, static.step.positions, static.step.counts, static.ids)]
    runner.graphs.run(plan, torch.zeros_like(static.ids), engine.capture,
                      rows=torch.arange(static.ids.shape[0]))
    assert [t.data_ptr() for t in (static.step.slots, static.step.positions, static.step.counts, static.ids)] \
        == addresses
    assert torch.equal(static.step.counts, plan.counts)  # refreshed in place from the plan
    runner.close()


@pytest.mark.parametrize("policy", [Dense(), RKV(window=2, buffer=2)], ids=lambda p: p.name)
def test_forward_logits_through_the_graph_equal_the_eager_forward(policy, cpu_graphs):
    """The scheduler's entry (it samples per row itself): a forward-only graph step's logits equal
    the eager step's, step after step with compression, and the graph is captured once."""
    from sparsecorr.decoding.backends import TorchBackend
    from sparsecorr.decoding.cache import ATTN_NAME, active_cache
    from sparsecorr.decoding.engine import Engine, pool_capacity
    from sparsecorr.decoding.hf import sparse_attention
    from sparsecorr.decoding.loops import prefill
    from sparsecorr.decoding.validate import budget_table

    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(3))
    toks = torch.randint(3, 128, (4, 8), generator=torch.Generator().manual_seed(4))
    lens = torch.full((4,), 6)
    logits = {}
    for graph in (False, True):
        table = budget_table(5, dense=policy.kind == "dense", longest=14)
        engine = Engine(model, policy=policy, backend=TorchBackend(), table=table, batch=4,
                        capacity=pool_capacity(policy, table, longest=14, chunk=6), grad=False)
        runner = ModelRunner(engine, graph_runner=EagerRunner if graph else None)
        got = []
        with sparse_attention(model, ATTN_NAME), active_cache(engine.cache), torch.no_grad():
            prefill(engine, ids, lens, 6)
            for t in range(8):
                got.append(runner.forward_logits(toks[:, t:t + 1], torch.ones(4, dtype=torch.long)))
                engine.compress_due()
        logits[graph] = torch.stack(got, 1)
        if graph:
            assert runner.graphs.status == "on" and runner.graphs.captures == 1
            assert runner.graphs.sampling is None  # forward only: the caller samples
        runner.close()
    torch.testing.assert_close(logits[True], logits[False], atol=2e-5, rtol=0)
