"""``SparseCorrServerAdapter``: verl's in-worker rollout for ``rollout.name=sparsecorr``.

verl resolves it from ``_ROLLOUT_REGISTRY[("sparsecorr", "async")]`` in each trainer worker
(hybrid mode) and each checkpoint-engine worker (colocated and standalone). It holds no model:
it forwards verl's memory calls to the replica's server actor (``resume(tags)`` -> ``wake_up``,
``release`` -> ``sleep``) and streams the actor's weights to it.

verl's ``naive`` sync hands over full tensors with Hugging Face names (FSDP gathers each one).
Two paths carry them to the server, which copies them into its inference copy in place, on its
engine thread between two steps:

- **bucketed** (where it applies): verl 0.9.1's own ``BucketedWeightSender`` here and
  ``BucketedWeightReceiver`` in the server (``weights.py``), as verl's vLLM backend does
  (``vllm_rollout.py::ServerAdapter.update_weights``): buckets of
  ``rollout.checkpoint_engine.update_weights_bucket_megabytes`` through CUDA IPC, GPU to GPU
  (shared memory where verl's ``is_support_ipc()`` is false, and on the CPU), over a ZMQ socket
  on the node. It applies when the server runs on this worker's node (the replica pins it
  there) and pyzmq is installed on both sides;
- **named tensors** (where it does not: another node, no pyzmq): the tensors move to the host
  in buckets of the same size and travel as Ray objects (``host_buckets``).

A DTensor is gathered (``full_tensor``) first on either path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from .replica import check_parallelism, server_name
from .weights import send_buckets, unavailable_reason, zmq_handle

logger = logging.getLogger("sparsecorr_verl")

__all__ = ["SparseCorrServerAdapter", "host_buckets"]


def host_buckets(weights: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int):
    """``(name, tensor)`` pairs as lists of host tensors of about ``bucket_bytes`` each (every
    tensor read once, in order; a DTensor gathered with ``full_tensor``)."""
    bucket, size = [], 0
    for name, tensor in weights:
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        host = tensor.detach().to("cpu")
        bucket.append((name, host))
        size += host.numel() * host.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class SparseCorrServerAdapter(BaseRollout):
    """The trainer side of one sparsecorr replica (verl's ``BaseRollout``).

    ``weight_path`` is the path weight updates take (``"bucketed"`` or ``"named_tensors"``),
    chosen at the first update (`choose_weight_path`) unless set before; ``weights_timeout_s``
    bounds the wait for any one message of a bucketed update, on both sides.
    """

    weights_timeout_s: float = 300.0

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **_unused) -> None:
        super().__init__(config, model_config, device_mesh)
        check_parallelism(self.config)
        self.replica_rank = int(os.environ.get("RANK", "0")) if replica_rank == -1 else int(replica_rank)
        self._server = None
        self.weight_path: str | None = None
        self.weight_path_reason: str | None = None
        self._use_shm = True

    @property
    def server(self):
        """The replica's server actor (looked up by name on first use)."""
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    def _frees_memory(self) -> bool:
        return bool(getattr(self.config, "free_cache_engine", True))

    async def resume(self, tags: list[str]) -> None:
        """Bring back ``tags`` (``weights``, ``kv_cache``) on the server."""
        if self._frees_memory():
            await self.server.wake_up.remote(tags=list(tags))

    async def release(self) -> None:
        """Free what the server holds on the GPU (it keeps serving after `resume`)."""
        if self._frees_memory():
            await self.server.sleep.remote()

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps: int | None = None,
                             **kwargs) -> None:
        """Copy the actor's full tensors into the server's inference copy, in buckets (the
        bucketed path or the named-tensor path: the module docstring says which runs when).

        Raises:
            ValueError: another wire format than ``named_tensors`` (the delta engines), or a
                LoRA adapter to serve unmerged (set ``actor_rollout_ref.model.lora.merge=true``).
        """
        if wire_format != "named_tensors":
            raise ValueError(f"wire_format: the sparsecorr rollout takes full named tensors, expected "
                             f"'named_tensors', got {wire_format!r}")
        if kwargs.get("peft_config") and kwargs.get("base_sync_done", False):
            raise ValueError("peft_config: the sparsecorr rollout serves merged weights only (set "
                             "actor_rollout_ref.model.lora.merge=true), got an unmerged LoRA adapter")
        engine = getattr(self.config, "checkpoint_engine", None)
        megabytes = int(getattr(engine, "update_weights_bucket_megabytes", 2048) or 2048)
        if self.weight_path is None:
            await self.choose_weight_path()
        if self.weight_path == "bucketed":
            await self._send_bucketed(weights, megabytes)
        else:
            for bucket in host_buckets(weights, bucket_bytes=megabytes << 20):
                await self.server.update_weights.remote(bucket)
        if global_steps is not None:
            await self.server.set_global_steps.remote(global_steps)

    async def choose_weight_path(self) -> str:
        """``bucketed`` when verl's bucketed transfer can run here and in the server and the server
        is on this node; ``named_tensors`` otherwise (``weight_path_reason`` says why, logged).
        CUDA IPC when both sides are on CUDA and verl's ``is_support_ipc()``; shared memory else."""
        info = await self.server.transfer_info.remote()
        here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        reason = (unavailable_reason() or info["unavailable"]
                  or (None if info["node_id"] == here else f"the server runs on node {info['node_id']}, "
                      f"this worker on {here}"))
        self.weight_path, self.weight_path_reason = ("named_tensors", reason) if reason else ("bucketed", None)
        self._use_shm = not (info["device"] == "cuda" and torch.cuda.is_available() and _ipc_supported())
        logger.info("sparsecorr rollout %d: weight updates %s", self.replica_rank,
                    f"through Ray as named tensors ({reason})" if reason else
                    f"through verl's bucketed transfer ({'shared memory' if self._use_shm else 'CUDA IPC'})")
        return self.weight_path

    async def _send_bucketed(self, weights, megabytes: int) -> None:
        """verl's sender here, the server's receiver there, on one fresh socket path."""
        handle = zmq_handle(self.replica_rank)
        receiving = self.server.update_weights_from_ipc.remote(handle, use_shm=self._use_shm,
                                                             timeout_s=self.weights_timeout_s)
        await send_buckets(weights, handle=handle, bucket_megabytes=megabytes, use_shm=self._use_shm,
                           device_type="cuda" if torch.cuda.is_available() else "cpu",
                           timeout_s=self.weights_timeout_s)
        await receiving


def _ipc_supported() -> bool:
    from verl.utils.device import is_support_ipc

    return bool(is_support_ipc())
