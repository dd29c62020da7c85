"""``SparseCorrReplica``: verl's ``RolloutReplica`` for ``rollout.name=sparsecorr``.

verl builds one replica per ``tensor_model_parallel_size * data_parallel_size *
pipeline_model_parallel_size`` GPUs; this backend runs one server per GPU, so all three must be
1 (the replica says so, naming the field, otherwise). ``launch_servers`` starts one Ray actor,
``sparsecorr_server_<replica>_0``, on the node of the replica's worker, sharing its GPU (hybrid
and colocated) or taking it (standalone), and loads the inference copy there.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout.replica import RolloutReplica

from .server import SparseCorrServer

__all__ = ["SparseCorrReplica", "check_parallelism", "server_name"]


def server_name(replica_rank: int, name_suffix: str = "", *, role: str = "") -> str:
    """The Ray name of a replica's server actor (the hybrid adapter looks it up by name)."""
    return f"sparsecorr_server_{role + '_' if role else ''}{replica_rank}_0{name_suffix}"


def check_parallelism(config) -> None:
    """One GPU per replica: tensor, data and pipeline parallel sizes must be 1; no PD split."""
    for name in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        value = getattr(config, name, 1)
        if value != 1:
            raise ValueError(f"rollout.{name}: the sparsecorr rollout runs one server per GPU (no tensor, data "
                             f"or pipeline parallel rollout), expected 1, got {value}")
    disagg = getattr(config, "disaggregation", None)
    if disagg is not None and getattr(disagg, "enabled", False):
        raise ValueError("rollout.disaggregation.enabled: prefill/decode disaggregation is not supported by the "
                         "sparsecorr rollout, expected false, got true")


class SparseCorrReplica(RolloutReplica):
    """A replica of one `SparseCorrServer` actor."""

    def __init__(self, replica_rank, config, model_config, gpus_per_node: int = 8, is_reward_model: bool = False,
                 is_teacher_model: bool = False, name_suffix: str = "") -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model,
                         name_suffix)
        check_parallelism(self.config)
        self.server_class = ray.remote(SparseCorrServer)

    def rollout_worker_use_gpu(self) -> bool:
        return True

    async def launch_servers(self) -> None:
        """Start the server actor beside the replica's worker and load the model in it."""
        if len(self.workers) != 1:
            raise ValueError(f"workers: expected the one worker of this replica, got {len(self.workers)}")

        def where(_worker) -> tuple[str, str]:
            import ray as ray_

            ctx = ray_.get_runtime_context()  # the GPU Ray gave the worker, whatever its env says
            return ctx.get_node_id(), ",".join(str(i) for i in ctx.get_accelerator_ids().get("GPU", []))

        node_id, devices = await self.workers[0].__ray_call__.remote(where)
        role = "reward" if self.is_reward_model else "teacher" if self.is_teacher_model else ""
        strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        server = self.server_class.options(
            scheduling_strategy=strategy, name=server_name(self.replica_rank, self.name_suffix, role=role),
            max_concurrency=self.max_concurrency, num_cpus=0,
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
        ).remote(config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
                 workers=list(self.workers), replica_rank=self.replica_rank, node_rank=0,
                 cuda_visible_devices=devices)
        self.servers = [server]
        await server.launch_server.remote()
        address, _ = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = address
