"""`SamplerSpec`: validated once (a ValueError naming the field, as each surface calls it), and
the same settings given to each surface (the CLI's flags, TRL's config, verl's engine options,
OpenRLHF's launcher flags) give equal specs."""

from __future__ import annotations

import argparse

import pytest

from sparsecorr.decoding import RKV, Dense
from sparsecorr.decoding.backends import NAMES
from sparsecorr.sampler import BACKENDS, SamplerSpec, spec_from


def test_backends_are_the_registry_of_backends():
    assert set(BACKENDS) == set(NAMES)


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="h2o"), "policy: expected one of"),
    (dict(policy="rkv", policy_kwargs={"nope": 1}, budget=4), "policy_kwargs: rkv does not take"),
    (dict(policy="rkv"), "budget: policy 'rkv' needs a budget or a schedule"),
    (dict(policy="rkv", budget=4, schedule="s.json"), "budget/schedule: expected one of them"),
    (dict(policy="dense", budget=4), "policy: expected a sparse KV policy"),
    (dict(policy="rkv", schedule="/no/such.json"), "schedule: expected a BudgetSchedule JSON file"),
    (dict(policy="rkv", budget=0), "budget: expected None or an int >= 1, got 0"),
    (dict(policy="rkv", budget=True), "budget: expected None or an int >= 1, got True"),
    (dict(backend="vllm"), "backend: expected one of"),
    (dict(cuda_graph=1), "cuda_graph: expected None, True or False, got 1"),
    (dict(fused="yes"), "fused: expected None, True or False"),
    (dict(fused=True, cuda_graph=False), "fused: compiles the CUDA-graph decode step"),
    (dict(prefill_chunk=0), "prefill_chunk: expected None or an int >= 1"),
    (dict(max_num_seqs=-2), "max_num_seqs: expected None or an int >= 1"),
    (dict(max_kv_bytes=1.5), "max_kv_bytes: expected None or an int >= 1"),
    (dict(policy_kwargs=[1]), "policy_kwargs: expected a mapping"),
])
def test_a_bad_field_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplerSpec(**kwargs)


def test_spec_from_names_the_surface_field():
    with pytest.raises(ValueError, match=r"^fused_step: compiles"):
        spec_from({"fused": True, "cuda_graph": False}, rename={"fused": "fused_step"})
    with pytest.raises(ValueError, match=r"^--sparsecorr\.budget/--sparsecorr\.schedule: expected one"):
        spec_from({"policy": "rkv", "budget": 3, "schedule": "x"}, where="--sparsecorr.")


def test_what_the_engine_takes(tmp_path):
    spec = SamplerSpec(policy="rkv", policy_kwargs={"buffer": 2}, budget=8, prefill_chunk=None, max_num_seqs=3)
    kw = spec.generate_kwargs("cpu")
    assert isinstance(kw.pop("policy"), RKV) and kw == {
        "budget": 8, "backend": "auto", "prefill_chunk": None, "cuda_graph": False, "fused": None,
        "max_num_seqs": 3, "max_kv_bytes": None}
    assert spec.generate_kwargs("cuda")["cuda_graph"] is True
    sk = spec.scheduler_kwargs("cpu", max_model_len=64)
    assert sk["prefill_chunk"] == 64 and sk["max_model_len"] == 64 and sk["policy"].buffer == 2
    assert isinstance(SamplerSpec().build_policy(), Dense) and SamplerSpec().build_budget() is None
    from sparsecorr.schedules import BudgetSchedule

    path = BudgetSchedule(bin_size=16, budgets=(4, 8)).save(tmp_path / "s.json")
    with_schedule = SamplerSpec(policy="streaming_llm", schedule=path)
    assert with_schedule.schedule == str(path) and isinstance(with_schedule.build_budget(), BudgetSchedule)


def _cli_spec(argv):
    from sparsecorr.commands import decode

    parser = argparse.ArgumentParser()
    decode.add_parser(parser.add_subparsers())
    args = parser.parse_args(["decode", "--model", "m", "--prompts", "p", "--out", "o", *argv])
    return decode.sampler_spec(args)


def test_the_four_surfaces_give_equal_specs():
    """One setting (R-KV at budget 64, the torch backend, graphs off, chunks of 128, at most 16
    rows) through each surface's own names."""
    want = SamplerSpec(policy="rkv", budget=64, backend="torch", cuda_graph=False, fused=False, prefill_chunk=128,
                       max_num_seqs=16)
    cli = _cli_spec(["--policy", "rkv", "--budget", "64", "--backend", "torch", "--cuda-graph", "off",
                     "--fused", "off", "--prefill-chunk", "128"])
    assert cli == SamplerSpec(**{**want.__dict__, "max_num_seqs": None})  # the CLI runs one batch: no cap flag
    pytest.importorskip("trl")
    from sparsecorr_trl.config import SparseCorrConfig

    trl = SparseCorrConfig(policy="rkv", budget=64, backend="torch", cuda_graph=False, fused_step=False,
                           sparse_max_num_seqs=16).sampler_spec()
    assert trl == SamplerSpec(**{**want.__dict__, "prefill_chunk": 512})  # TRL has no chunk field: the default
    from sparsecorr_verl.rollout.options import EngineOptions

    verl = EngineOptions(policy="rkv", budget=64, backend="torch", cuda_graph=False, fused_step=False,
                         prefill_chunk=128, max_batch_size=16).sampler_spec()
    assert verl == want
    from sparsecorr_openrlhf.rollout.flags import parse_rollout_args

    flags, rest = parse_rollout_args(["--sparsecorr.rollout", "rkv", "--sparsecorr.budget", "64",
                                      "--sparsecorr.backend", "torch", "--sparsecorr.cuda_graph", "off",
                                      "--sparsecorr.fused", "off", "--sparsecorr.prefill_chunk", "128",
                                      "--sparsecorr.max_num_seqs", "16", "--actor.num_nodes", "1"])
    assert flags == want and rest == ["--actor.num_nodes", "1"]


def test_each_surface_names_its_own_field():
    from sparsecorr_verl.rollout.options import EngineOptions

    with pytest.raises(ValueError, match=r"^max_batch_size: expected None or an int >= 1"):
        EngineOptions(max_batch_size=0)
    with pytest.raises(ValueError, match=r"^fused_step: compiles"):
        EngineOptions(fused_step=True, cuda_graph=False)
    pytest.importorskip("trl")
    from sparsecorr_trl.config import SparseCorrConfig

    with pytest.raises(ValueError, match=r"^sparse_max_num_seqs: expected None or an int >= 1"):
        SparseCorrConfig(policy="rkv", budget=4, sparse_max_num_seqs=0)
    with pytest.raises(ValueError, match=r"^--budget: expected None or an int >= 1"):
        _cli_spec(["--policy", "rkv", "--budget", "0"])
