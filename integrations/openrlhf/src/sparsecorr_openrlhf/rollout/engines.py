"""`create_sparse_engines`: OpenRLHF's ``create_vllm_engines`` for sparse rollout actors.

Same positional arguments as OpenRLHF 0.11.2's ``create_vllm_engines``
(``openrlhf/trainer/ray/vllm_engine.py``), called the same way by its launcher
(``openrlhf/cli/train_ppo_ray.py``), plus the ``SamplerSpec``. The placement follows it: with
a shared placement group (hybrid, ``--train.colocate_all``) engine ``i`` takes bundle ``i``
with 0.2 GPU; otherwise one packed group of ``{"GPU": 1, "CPU": 1}`` bundles is made, an
engine per bundle. With ``vllm_enable_sleep`` the engines are put to sleep after creation.

`actor_kwargs` builds each actor's arguments without Ray (the launcher's dry run prints them).
What maps and what is refused:

- ``tensor_parallel_size > 1`` and ``max_images_per_prompt > 0``: refused by name;
- ``enforce_eager``: CUDA graphs off unless ``--sparsecorr.cuda_graph`` says otherwise;
- ``logprobs_mode``: None or ``processed_logprobs`` (the sparse sampler records the log-prob of
  the distribution it sampled: after temperature and top-k / top-p); another is refused;
- ``enable_prefix_caching``, ``gpu_memory_utilization``: not used (no prefix cache; the memory
  plan takes 0.9 of free memory, or ``--sparsecorr.max_kv_bytes``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparsecorr.sampler import SamplerSpec

__all__ = ["actor_kwargs", "create_sparse_engines"]


def actor_kwargs(num_engines: int, tensor_parallel_size: int, pretrain: str, seed: int, full_determinism: bool,
                 enable_prefix_caching: bool, enforce_eager: bool, max_model_len: int, shared_pg=None,
                 gpu_memory_utilization=None, vllm_enable_sleep=False, logprobs_mode=None,
                 agent_func_path: str | None = None, remote_rm_url: str | None = None,
                 max_images_per_prompt: int = 0, *, sampler: SamplerSpec) -> list[dict[str, Any]]:
    """Each engine's ``SparseRolloutActor`` arguments (``sampler`` as a dict of its fields) and
    its Ray resources (``num_gpus``, ``bundle_index``)."""
    if tensor_parallel_size != 1:
        raise ValueError(f"--vllm.tensor_parallel_size: the sparse rollout engine runs on one GPU (no tensor "
                         f"parallelism yet), expected 1, got {tensor_parallel_size}")
    if max_images_per_prompt:
        raise ValueError(f"--data.max_images_per_prompt: the sparse rollout actors serve text prompts only, "
                         f"expected 0, got {max_images_per_prompt}")
    if logprobs_mode not in (None, "processed_logprobs"):
        raise ValueError(f"logprobs_mode: the sparse sampler records processed log-probs, expected None or "
                         f"'processed_logprobs', got {logprobs_mode!r}")
    if not isinstance(num_engines, int) or num_engines < 1:
        raise ValueError(f"--vllm.num_engines: expected an int >= 1, got {num_engines!r}")
    if enforce_eager and sampler.cuda_graph is None:
        sampler = dataclasses.replace(sampler, cuda_graph=False, fused=False if sampler.fused is None else sampler.fused)
    fields = {f.name: getattr(sampler, f.name) for f in dataclasses.fields(sampler)}
    hybrid = shared_pg is not None
    return [{"model": pretrain, "sampler": dict(fields), "max_model_len": max_model_len, "seed": seed + i,
             "dtype": "bfloat16", "tensor_parallel_size": 1, "full_determinism": full_determinism,
             "agent_func_path": agent_func_path, "remote_rm_url": remote_rm_url,
             "num_gpus": 0.2 if hybrid else 1, "bundle_index": i} for i in range(num_engines)]


def create_sparse_engines(num_engines: int, tensor_parallel_size: int, pretrain: str, seed: int,
                          full_determinism: bool, enable_prefix_caching: bool, enforce_eager: bool, max_model_len: int,
                          shared_pg=None, gpu_memory_utilization=None, vllm_enable_sleep=False, logprobs_mode=None,
                          agent_func_path: str | None = None, remote_rm_url: str | None = None,
                          max_images_per_prompt: int = 0, *, sampler: SamplerSpec) -> list:
    """The sparse rollout actors (Ray actor handles), placed as OpenRLHF places its engines."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .actor import SparseRolloutActor

    every = actor_kwargs(num_engines, tensor_parallel_size, pretrain, seed, full_determinism, enable_prefix_caching,
                         enforce_eager, max_model_len, shared_pg, gpu_memory_utilization, vllm_enable_sleep,
                         logprobs_mode, agent_func_path, remote_rm_url, max_images_per_prompt, sampler=sampler)
    if shared_pg is None:
        shared_pg = placement_group([{"GPU": 1, "CPU": 1} for _ in range(num_engines)], strategy="PACK")
        ray.get(shared_pg.ready())
    remote = ray.remote(SparseRolloutActor)
    engines = []
    for kwargs in every:
        num_gpus, bundle = kwargs.pop("num_gpus"), kwargs.pop("bundle_index")
        strategy = PlacementGroupSchedulingStrategy(placement_group=shared_pg, placement_group_capture_child_tasks=True,
                                                    placement_group_bundle_index=bundle)
        engines.append(remote.options(num_cpus=num_gpus, num_gpus=num_gpus,
                                      scheduling_strategy=strategy).remote(**kwargs))
    if vllm_enable_sleep:
        ray.get([e.sleep.remote() for e in engines])
    return engines
