"""The receiving end of OpenRLHF's weight sync, for one sparse rollout actor (tensor parallel 1).

Ported from OpenRLHF 0.11.2's ``WorkerWrap`` (``openrlhf/trainer/ray/vllm_worker_wrap.py``), the
vLLM worker extension its engines load, in this project's words:

- `WeightGroup.join` is ``init_process_group(master_address, master_port, rank_offset,
  world_size, group_name, backend, use_ray)``: this actor is rank ``rank_offset`` (its one
  worker). With ``use_ray`` it joins ``ray.util.collective`` group ``group_name`` with
  ``backend`` (``nccl``, or ``gloo`` on the CPU), as ``--vllm.sync_with_ray`` makes the trainer do
  (``ppo_actor.py`` ``_init_vllm_sync_group``); without, OpenRLHF's
  ``stateless_init_process_group`` (vLLM's ``StatelessProcessGroup`` and ``PyNcclCommunicator``:
  CUDA and vLLM needed, as on the trainer side).
- `WeightGroup.receive` is ``update_weight(name, dtype, shape)``'s broadcast from rank 0 into a
  new tensor on the actor's device.
- `receive_cuda_ipc` is ``update_weight_cuda_ipc``: the trainer's tensor opened from its CUDA
  IPC handle (the handle of this GPU, found by its UUID; its device index rewritten to ours).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WeightGroup", "physical_gpu_id", "receive_cuda_ipc"]


class WeightGroup:
    """The actor's membership of the trainer's weight-sync group."""

    def __init__(self) -> None:
        self.group: Any = None
        self.use_ray = False
        self.rank: int | None = None

    def join(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str = "nccl", use_ray: bool = False, *, device: torch.device) -> None:
        """Join (blocking until every rank joined). ValueError on a bad argument."""
        if not group_name:
            raise ValueError("group_name: expected a non-empty name, got ''")
        if not isinstance(world_size, int) or world_size < 2 or not 0 < int(rank_offset) < world_size:
            raise ValueError(f"rank_offset/world_size: expected 0 < rank_offset < world_size (rank 0 is the "
                             f"trainer), got {rank_offset}/{world_size}")
        rank = int(rank_offset)  # tensor parallel 1: the actor's one worker
        if use_ray:
            import ray.util.collective as collective

            collective.init_collective_group(world_size=world_size, rank=rank, backend=backend, group_name=group_name)
            self.group = group_name
        else:
            if device.type != "cuda":
                raise ValueError(f"use_ray: OpenRLHF's stateless group is NCCL through vLLM (CUDA only); the actor "
                                 f"is on {device}: set --vllm.sync_with_ray (with --vllm.sync_backend gloo on the "
                                 f"CPU), got use_ray=False")
            from openrlhf.utils.distributed_util import stateless_init_process_group

            self.group = stateless_init_process_group(master_address, master_port, rank, world_size, device)
        self.use_ray, self.rank = bool(use_ray), rank

    def receive(self, dtype: torch.dtype, shape, *, device: torch.device) -> torch.Tensor:
        """One tensor broadcast by rank 0 (``dtype`` and ``shape`` as the trainer sends it)."""
        if self.group is None:
            raise RuntimeError("update_weight: no weight-sync group; call init_process_group first")
        weight = torch.empty(tuple(shape), dtype=dtype, device=device)
        if self.use_ray:
            import ray.util.collective as collective

            collective.broadcast(weight, 0, group_name=self.group)
        else:
            self.group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
        return weight


def physical_gpu_id(device: torch.device) -> str:
    """The UUID of ``device``'s GPU (the key of OpenRLHF's ``ipc_handles``)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def receive_cuda_ipc(ipc_handles: dict, *, device: torch.device) -> torch.Tensor:
    """The trainer's tensor behind this GPU's CUDA IPC handle (``torch.multiprocessing``'s
    ``reduce_tensor`` pair: a rebuild function and its arguments, the 7th the device index)."""
    if device.type != "cuda":
        raise ValueError(f"update_weight_cuda_ipc: CUDA IPC shares GPU memory; the sparse rollout actor is on "
                         f"{device} (use init_process_group + update_weight), got a CUDA IPC handle")
    key = physical_gpu_id(device)
    if key not in ipc_handles:
        raise ValueError(f"ipc_handles: expected a handle for this GPU ({key}), got handles for {sorted(ipc_handles)}")
    rebuild, args = ipc_handles[key]
    args = list(args)
    args[6] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild(*args)
