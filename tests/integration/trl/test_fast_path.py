"""Issue 34: SparseGRPOTrainer's rollouts take the engine's fast path (CUDA graphs, backend
``auto``) on a CUDA model, say what ran, and can turn graphs off. On the CPU the graph code path
runs with the eager stand-in runner (the capture itself is tested in tests/gpu)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("trl")
from sparsecorr_trl import SparseCorrConfig
from sparsecorr_trl.rollout import sparse_rollouts, use_cuda_graph

import sparsecorr.decoding.engine as engine_mod
import sparsecorr.decoding.graphs as graphs_mod
from sparsecorr.decoding import StreamingLLM
from sparsecorr.decoding.pool import KVPool
from tests.integration.trl.test_sparse_rollouts import _trainer
from tests.models import tiny_model


@pytest.fixture
def cpu_graphs(monkeypatch):
    monkeypatch.setattr(graphs_mod, "CudaGraphRunner", graphs_mod.EagerRunner)
    monkeypatch.setattr(graphs_mod, "check_graph_device", lambda device: None)


def _rollouts(model, **kw):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23]]
    return sparse_rollouts(model, prompts, policy=StreamingLLM(sink=1, buffer=2), budget=4, max_new_tokens=10,
                           eos_token_id=[2], pad_token_id=0, generator=torch.Generator().manual_seed(0),
                           sampling={"temperature": 1.0, "top_k": None, "top_p": None}, **kw)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(policy="streaming_llm", budget=4, cuda_graph="yes"), "cuda_graph"),
    (dict(policy="streaming_llm", budget=4, cuda_graph=1), "cuda_graph"),
    (dict(cuda_graph=True), "cuda_graph"),
    (dict(policy="streaming_llm", budget=4, backend="vllm"), "backend"),
    (dict(policy="streaming_llm", budget=4, fused_step="yes"), "fused_step"),
    (dict(policy="streaming_llm", budget=4, fused_step=1), "fused_step"),
    (dict(policy="streaming_llm", budget=4, cuda_graph=False, fused_step=True), "fused_step"),
    (dict(fused_step=True), "fused_step"),
])
def test_bad_fast_path_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseCorrConfig(**kwargs)


def test_graphs_default_on_for_cuda_only():
    model = tiny_model("qwen3")
    assert use_cuda_graph(model, None) is False and use_cuda_graph(model, False) is False
    assert use_cuda_graph(model, True) is True
    meta = torch.nn.Linear(2, 2, device="meta")  # a parameter on a non-CUDA device
    assert use_cuda_graph(meta, None) is False


def test_cpu_rollouts_run_eager_and_say_so():
    out = _rollouts(tiny_model("qwen3"))
    assert (out.cuda_graph, out.backend) == ("off", "torch")
    m = out.stats.as_metrics()
    assert m["sparsecorr/rollout/cuda_graph"] == 0.0 and m["sparsecorr/rollout/flashinfer"] == 0.0
    with pytest.raises(ValueError, match="cuda_graph: needs the model on a CUDA device"):
        _rollouts(tiny_model("qwen3"), cuda_graph=True)


def test_graph_rollouts_equal_eager_rollouts(cpu_graphs):
    """The graph path the trainer takes on a GPU samples what the eager path samples."""
    model = tiny_model("qwen3")
    eager = _rollouts(model, cuda_graph=False)
    graph = _rollouts(model, cuda_graph=True)
    assert graph.cuda_graph == "on" and graph.stats.as_metrics()["sparsecorr/rollout/cuda_graph"] == 1.0
    assert graph.fused == "on" and graph.stats.as_metrics()["sparsecorr/rollout/fused"] == 1.0
    assert eager.fused == "off" and eager.stats.as_metrics()["sparsecorr/rollout/fused"] == 0.0
    unfused = _rollouts(model, cuda_graph=True, fused_step=False)
    assert (unfused.cuda_graph, unfused.fused) == ("on", "off") and unfused.completions == graph.completions
    assert graph.completions == eager.completions
    for a, b in zip(graph.logprobs, eager.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-5, rtol=0)


def test_trainer_rollouts_use_graphs_and_free_their_pool(tmp_path, cpu_graphs, monkeypatch):
    """cuda_graph=True (what None resolves to on a CUDA model) reaches generate, is logged, and
    every step's pool is gone before the next step, with the cycle collector off."""
    pools: list[weakref.ref] = []

    class Tracked(KVPool):
        def __init__(self, **kw):
            super().__init__(**kw)
            pools.append(weakref.ref(self))

    monkeypatch.setattr(engine_mod, "KVPool", Tracked)
    cfg = SparseCorrConfig("sparse_rl", policy="streaming_llm", policy_kwargs={"sink": 1}, budget=4,
                           cuda_graph=True)
    trainer = _trainer(tmp_path, cfg)
    gc.disable()
    try:
        trainer.train()
        alive = sum(r() is not None for r in pools)
    finally:
        gc.enable()
    assert len(pools) >= 2 and alive == 0
    assert trainer.sparsecorr_rollout_engine == {"backend": "torch", "cuda_graph": "on", "fused": "on"}
    logged = [row["sparsecorr/rollout/cuda_graph"] for row in trainer.state.log_history
              if "sparsecorr/rollout/cuda_graph" in row]
    assert logged and all(v == 1.0 for v in logged)


def test_graphs_can_be_turned_off(tmp_path, cpu_graphs):
    cfg = SparseCorrConfig("sparse_rl", policy="streaming_llm", policy_kwargs={"sink": 1}, budget=4,
                           cuda_graph=False)
    trainer = _trainer(tmp_path, cfg, max_steps=1)
    trainer.train()
    assert trainer.sparsecorr_rollout_engine == {"backend": "torch", "cuda_graph": "off", "fused": "off"}
