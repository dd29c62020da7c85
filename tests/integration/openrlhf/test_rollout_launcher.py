"""``python -m sparsecorr_openrlhf.train_ppo_ray --sparsecorr.rollout POLICY``: the flags are
listed by ``--help``, build a ``SamplerSpec`` (errors naming the flag), turn on OpenRLHF's rollout
log-probs, swap OpenRLHF's ``create_vllm_engines`` for the sparse actors' builder, and a dry run
prints each actor's arguments; without ``--sparsecorr.rollout`` nothing changes (no Ray or vLLM
needed: OpenRLHF's entry point is replaced by a recorder)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import sparsecorr_openrlhf.train_ppo_ray as launcher

from sparsecorr.sampler import SamplerSpec


@pytest.fixture
def recorder(monkeypatch):
    calls: dict = {}
    monkeypatch.setattr(launcher, "install", lambda spec: calls.setdefault("install", spec))
    monkeypatch.setattr(launcher, "_init_ray", lambda spec: calls.setdefault("ray", spec))
    monkeypatch.setattr(launcher, "use_sparse_engines", lambda sampler: calls.setdefault("sampler", sampler))
    monkeypatch.setattr(launcher.runpy, "run_module", lambda name, run_name, alter_sys: calls.setdefault(
        "argv", list(sys.argv[1:])))
    monkeypatch.delenv("SPARSECORR_OPENRLHF", raising=False)
    return calls


def test_help_lists_the_rollout_flags(monkeypatch, capsys):
    monkeypatch.setattr(launcher.runpy, "run_module", lambda *a, **k: (_ for _ in ()).throw(SystemExit(0)))
    launcher.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("rollout", "policy_kwargs", "budget", "schedule", "backend", "cuda_graph", "fused", "prefill_chunk",
                 "max_num_seqs", "max_kv_bytes", "dry_run"):
        assert f"--sparsecorr.{flag}" in out


def test_the_rollout_flags_swap_the_engines_and_turn_on_rollout_logprobs(recorder):
    launcher.main(["--sparsecorr.rollout", "rkv", "--sparsecorr.budget", "256", "--sparsecorr.policy_kwargs",
                   '{"buffer": 32}', "--vllm.num_engines", "2", "--sparsecorr.cap", "1.5"])
    assert recorder["sampler"] == SamplerSpec(policy="rkv", policy_kwargs={"buffer": 32}, budget=256)
    assert recorder["argv"] == ["--vllm.num_engines", "2", "--algo.advantage.is_correction_level", "token"]
    assert recorder["install"]["numbers"] == {"cap": 1.5}


def test_without_the_rollout_flag_nothing_changes(recorder):
    argv = ["--vllm.num_engines", "2", "--algo.advantage.is_correction_level", "off"]
    launcher.main(argv)
    assert "sampler" not in recorder and recorder["argv"] == argv


@pytest.mark.parametrize("given, want", [
    ([], ["--algo.advantage.is_correction_level", "token"]),
    (["--algo.advantage.is_correction_level", "off"], ["--algo.advantage.is_correction_level", "token"]),
    (["--algo.advantage.is_correction_level=off"], ["--algo.advantage.is_correction_level=token"]),
    (["--algo.advantage.is_correction_level", "seq"], ["--algo.advantage.is_correction_level", "seq"]),
])
def test_rollout_logprobs_are_turned_on_unless_already(given, want):
    assert launcher.with_rollout_logprobs(given, {"name": "sparse_rl"}) == want
    assert launcher.with_rollout_logprobs(given, {"name": "none"}) == given  # no correction: as given


def test_a_dry_run_prints_each_actors_arguments(recorder, capsys):
    launcher.main(["--sparsecorr.rollout", "streaming_llm", "--sparsecorr.budget", "128", "--sparsecorr.max_num_seqs",
                   "64", "--vllm.num_engines", "2", "--actor.model_name_or_path", "/ckpt", "--train.seed", "7",
                   "--data.max_len", "4096", "--vllm.enforce_eager", "--train.colocate_all", "--sparsecorr.dry_run"])
    actors = json.loads(capsys.readouterr().out)
    assert "install" not in recorder and "argv" not in recorder  # nothing started
    assert [a["seed"] for a in actors] == [7, 8] and [a["bundle_index"] for a in actors] == [0, 1]
    assert all(a["model"] == "/ckpt" and a["max_model_len"] == 4096 and a["num_gpus"] == 0.2 for a in actors)
    spec = SamplerSpec(**actors[0]["sampler"])
    assert spec == SamplerSpec(policy="streaming_llm", budget=128, max_num_seqs=64, cuda_graph=False, fused=False)


@pytest.mark.parametrize("argv, match", [
    (["--sparsecorr.budget", "8"], "--sparsecorr.budget: an engine option of the sparse rollout actors"),
    (["--sparsecorr.rollout", "rkv"], "--sparsecorr.budget: policy 'rkv' needs a budget or a schedule"),
    (["--sparsecorr.rollout", "dense", "--sparsecorr.budget", "8"], "--sparsecorr.rollout: expected a sparse KV"),
    (["--sparsecorr.rollout", "nope"], "--sparsecorr.rollout: expected one of"),
    (["--sparsecorr.rollout", "rkv", "--sparsecorr.budget", "0"], "--sparsecorr.budget: expected None or an int"),
    (["--sparsecorr.rollout", "dense", "--sparsecorr.backend", "vllm"], "--sparsecorr.backend: expected one of"),
    (["--sparsecorr.rollout", "dense", "--sparsecorr.policy_kwargs", "{"], "--sparsecorr.policy_kwargs: expected a"),
    (["--sparsecorr.rollout", "dense", "--sparsecorr.dry_run"], "--vllm.num_engines: sparse rollout actors"),
    (["--sparsecorr.rollout", "dense", "--sparsecorr.dry_run", "--vllm.num_engines", "1",
      "--vllm.tensor_parallel_size", "2"], "--vllm.tensor_parallel_size: the sparse rollout engine runs on one GPU"),
    (["--sparsecorr.rollout", "dense", "--sparsecorr.dry_run", "--vllm.num_engines", "1",
      "--data.max_images_per_prompt", "2"], "--data.max_images_per_prompt: the sparse rollout actors serve text"),
])
def test_bad_rollout_flags_are_refused_by_name(recorder, argv, match):
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        launcher.main(argv)
    assert "argv" not in recorder


def test_use_sparse_engines_replaces_openrlhfs_engine_builder(monkeypatch):
    import sparsecorr_openrlhf.rollout.engines as engines

    fake = types.ModuleType("openrlhf.trainer.ray")
    fake.create_vllm_engines = None
    monkeypatch.setitem(sys.modules, "openrlhf.trainer.ray", fake)
    seen = {}
    monkeypatch.setattr(engines, "create_sparse_engines", lambda *a, **k: seen.update(args=a, kwargs=k) or ["e"])
    spec = SamplerSpec(policy="snapkv", budget=64)
    launcher.use_sparse_engines(spec)
    assert fake.create_vllm_engines(2, 1, "/ckpt", 42, False, False, False, 2048, None, 0.9, True,
                                    "processed_logprobs", agent_func_path=None) == ["e"]
    assert seen["args"][:3] == (2, 1, "/ckpt") and seen["kwargs"]["sampler"] is spec


def test_the_launcher_imports_no_engine_without_the_rollout_flag(tmp_path):
    """The glue's loss path needs no transformers: the rollout flags load the engine only when
    ``--sparsecorr.rollout`` is given."""
    import os
    import subprocess

    code = ("import sys, sparsecorr_openrlhf.train_ppo_ray as l; l.parse_rollout_args(['--x']); "
            "assert 'transformers' not in sys.modules and 'sparsecorr.decoding' not in sys.modules")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr
