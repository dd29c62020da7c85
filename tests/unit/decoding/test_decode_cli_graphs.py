"""Issue 34: ``sparsecorr decode`` replays decode steps as CUDA graphs on a CUDA device
(``--cuda-graph auto``, the default), eagerly elsewhere, and says which ran."""

import json

import pytest

import sparsecorr.decoding.graphs as graphs_mod
from sparsecorr.cli import main
from tests.models import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-graphs") / "model"
    tiny_model("qwen3").save_pretrained(path)
    return path


def _run(tmp_path, model_dir, *extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    return main(["decode", "--model", str(model_dir), "--prompts", str(prompts), "--policy", "streaming_llm",
                 "--budget", "4", "--max-new-tokens", "6", "--out", str(tmp_path / "o.safetensors"),
                 "--device", "cpu", *extra])


def test_auto_is_eager_on_cpu_and_says_so(tmp_path, capsys, model_dir):
    assert _run(tmp_path, model_dir) == 0
    assert "backend torch, cuda_graph off" in capsys.readouterr().out


def test_on_needs_cuda(tmp_path, capsys, model_dir):
    assert _run(tmp_path, model_dir, "--cuda-graph", "on") == 2
    err = capsys.readouterr().err
    assert "--cuda-graph: on needs a CUDA device" in err and err.count("\n") == 1


def test_fused_on_needs_the_graph_step(tmp_path, capsys, model_dir):
    assert _run(tmp_path, model_dir, "--fused", "on") == 2
    err = capsys.readouterr().err
    assert "--fused: on compiles the CUDA-graph step" in err and err.count("\n") == 1


@pytest.mark.slow  # ~15 s idle; make test-slow (CI) runs it
def test_auto_takes_graphs_on_a_cuda_model(tmp_path, capsys, model_dir, monkeypatch):
    """The model reports a CUDA device: ``auto`` asks generate for graphs (run on the CPU with
    the eager stand-in runner)."""
    import torch
    from transformers import PreTrainedModel

    monkeypatch.setattr(graphs_mod, "CudaGraphRunner", graphs_mod.EagerRunner)
    monkeypatch.setattr(graphs_mod, "check_graph_device", lambda device: None)
    monkeypatch.setattr(PreTrainedModel, "device", property(lambda self: torch.device("cuda")))
    assert _run(tmp_path, model_dir) == 0
    assert "cuda_graph on, fused on" in capsys.readouterr().out  # the first call's line
    assert _run(tmp_path, model_dir, "--fused", "off") == 0
    assert "cuda_graph on, fused off" in capsys.readouterr().out
    assert _run(tmp_path, model_dir, "--cuda-graph", "off") == 0
    assert "cuda_graph off, fused off" in capsys.readouterr().out
