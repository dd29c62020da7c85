"""``SparseCorrServerAdapter``: verl's in-worker rollout for ``rollout.name=sparsecorr``.

verl resolves it from ``_ROLLOUT_REGISTRY[("sparsecorr", "async")]`` in each trainer worker
(hybrid mode) and each checkpoint-engine worker (colocated and standalone). It holds no model:
it forwards verl's memory calls to the replica's server actor (``resume(tags)`` -> ``wake_up``,
``release`` -> ``sleep``) and streams the actor's weights to it. verl's ``naive`` sync hands
over full tensors with Hugging Face names (FSDP gathers each one); the adapter moves them to
the host in buckets of ``rollout.checkpoint_engine.update_weights_bucket_megabytes`` and the
server copies them into its inference copy in place, on its engine thread between two steps (a
DTensor is gathered here first). verl's ``BucketedWeightSender`` / ``BucketedWeightReceiver``
(CUDA IPC, GPU to GPU) is not used: verl 0.9.1 ships it inside its vLLM package, which does not
import without vLLM (docs: "verl", Weight updates).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from .replica import check_parallelism, server_name

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
    """The trainer side of one sparsecorr replica (verl's ``BaseRollout``)."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **_unused) -> None:
        super().__init__(config, model_config, device_mesh)
        check_parallelism(self.config)
        self.replica_rank = int(os.environ.get("RANK", "0")) if replica_rank == -1 else int(replica_rank)
        self._server = None

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
        """Copy the actor's full tensors into the server's inference copy, in buckets.

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
        for bucket in host_buckets(weights, bucket_bytes=megabytes << 20):
            await self.server.update_weights.remote(bucket)
        if global_steps is not None:
            await self.server.set_global_steps.remote(global_steps)
