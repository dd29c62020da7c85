"""The sparse rollout actor as OpenRLHF drives it, on a local Ray (CPU; one declared GPU so
OpenRLHF's placement runs): built by `create_sparse_engines` on a packed placement group, its
``generate_responses`` running OpenRLHF's ``SingleTurnAgentExecutor``, 8 concurrent ``generate``
calls, ``sleep`` / ``wake_up``, and a weight update through ``init_process_group`` +
``update_weight`` over gloo between two processes (a trainer actor doing what OpenRLHF's
``_init_vllm_sync_group`` and ``broadcast_to_vllm`` do with ``--vllm.sync_with_ray
--vllm.sync_backend gloo``): the next greedy output is that of the new weights loaded directly.
Needs Ray, ``aiohttp`` and ``pylatexenc`` (``make test-lowest`` installs them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.integration.openrlhf.rollout_helpers import (
    ENGINE,
    direct,
    need_openrlhf_executors,
    need_ray,
    openrlhf_params,
    save_tiny,
    word_tokenizer,
)

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19], [20, 21, 22], [23, 24, 25, 26, 27],
           [28, 29, 30], [31, 32, 33, 34]]


@pytest.fixture(scope="module")
def ray_cluster():
    need_ray()
    need_openrlhf_executors()
    import ray

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, namespace="sparsecorr-openrlhf",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return (save_tiny(tmp_path_factory.mktemp("old"), seed=0), save_tiny(tmp_path_factory.mktemp("new"), seed=1))


@pytest.fixture(scope="module")
def engine(ray_cluster, ckpts):
    from sparsecorr_openrlhf.rollout import create_sparse_engines

    from sparsecorr.sampler import SamplerSpec

    engines = create_sparse_engines(1, 1, str(ckpts[0]), 0, False, False, True, 48,
                                    sampler=SamplerSpec(**ENGINE, max_num_seqs=8))
    assert len(engines) == 1
    return engines[0]


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_generate_responses_and_eight_concurrent_requests_through_ray(ray_cluster, engine, ckpts):
    model = _model(ckpts[0])
    params = openrlhf_params(temperature=1.0, max_tokens=8, seed=5)
    [single] = ray_cluster.get(engine.generate_responses.remote("w5 w6 w7 w8", "x", params, 32, word_tokenizer()))
    tokens, logps = direct(model, [5, 6, 7, 8], max_new_tokens=8, temperature=1.0, seed=5)
    assert single["observation_tokens"] == [5, 6, 7, 8, *tokens]
    torch.testing.assert_close(torch.tensor(single["rollout_log_probs"][4:]), torch.tensor(logps), rtol=0, atol=1e-5)
    greedy = openrlhf_params(temperature=0.0, max_tokens=6)
    outs = ray_cluster.get([engine.generate.remote(p, greedy) for p in PROMPTS])
    assert [o.outputs[0].token_ids for o in outs] == [direct(model, p, max_new_tokens=6)[0] for p in PROMPTS]
    assert ray_cluster.get(engine.state.remote())["max_resident"] > 1
    assert ray_cluster.get(engine.get_num_unfinished_requests.remote()) == 0


def test_sleep_and_wake_up_through_ray(ray_cluster, engine):
    ray_cluster.get(engine.sleep.remote())
    assert ray_cluster.get(engine.state.remote())["held"] == ["kv_cache", "weights"]
    ray_cluster.get(engine.wake_up.remote(tags=["weights"]))
    ray_cluster.get(engine.wake_up.remote(tags=["kv_cache"]))
    out = ray_cluster.get(engine.generate.remote([5, 6], openrlhf_params(temperature=0.0, max_tokens=2)))
    assert len(out.outputs[0].token_ids) <= 2


def test_a_weight_update_over_gloo_changes_the_next_greedy_output_as_loading_would(ray_cluster, engine, ckpts):
    import ray

    @ray.remote(num_cpus=0)
    class Trainer:
        """OpenRLHF's rank 0: its sync-group set-up and per-parameter broadcast, with Ray's
        collective group (``ppo_actor.py``: ``_init_vllm_sync_group``, ``_broadcast_param``)."""

        def __init__(self, path, engines):
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(path)
            self.engines = engines

        def init_sync_group(self):
            import ray.util.collective as collective

            refs = [e.init_process_group.remote("127.0.0.1", 0, i + 1, len(self.engines) + 1, "openrlhf",
                                                backend="gloo", use_ray=True) for i, e in enumerate(self.engines)]
            collective.init_collective_group(world_size=len(self.engines) + 1, rank=0, backend="gloo",
                                             group_name="openrlhf")
            ray.get(refs)

        def broadcast_to_engines(self):
            import ray.util.collective as collective

            params = list(self.model.named_parameters())
            for count, (name, param) in enumerate(params, 1):
                refs = [e.update_weight.remote(name, dtype=param.dtype, shape=param.shape,
                                               empty_cache=count == len(params)) for e in self.engines]
                collective.broadcast(param.data, 0, group_name="openrlhf")
                ray.get(refs)
            return len(params)

    greedy = openrlhf_params(temperature=0.0, max_tokens=8)
    before = ray_cluster.get(engine.generate.remote(PROMPTS[0], greedy)).outputs[0].token_ids
    new_tokens = direct(_model(ckpts[1]), PROMPTS[0], max_new_tokens=8)[0]
    assert before == direct(_model(ckpts[0]), PROMPTS[0], max_new_tokens=8)[0] and before != new_tokens
    trainer = Trainer.remote(str(ckpts[1]), [engine])
    ray_cluster.get(trainer.init_sync_group.remote())
    assert ray_cluster.get(trainer.broadcast_to_engines.remote()) > 0
    after = ray_cluster.get(engine.generate.remote(PROMPTS[0], greedy)).outputs[0].token_ids
    assert after == new_tokens
