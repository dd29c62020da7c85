"""Weight updates of ``rollout.name=sparsecorr`` through verl 0.9.1's bucketed transfer.

verl's vLLM backend moves the actor's full tensors into a colocated inference process with
``BucketedWeightSender`` / ``BucketedWeightReceiver`` (verl 0.9.1,
``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``; used by
``vllm_rollout.py::ServerAdapter.update_weights`` and ``utils.py::update_weights_from_ipc``):

- the sender (in the trainer or checkpoint-engine worker) binds a ZMQ ``REQ`` socket on an
  ``ipc://`` path and fills one bucket of ``bucket_size_mb`` MiB: a CUDA buffer shared through
  CUDA IPC, or a POSIX shared-memory segment (``use_shm=True``: no IPC support, the CPU);
- each tensor lands at an offset aligned to its element size; a full bucket is announced with
  its ``{name: shape, dtype, offset}`` table and the sender waits for the receiver's
  acknowledgement before it refills the buffer; the last bucket carries ``is_last``;
- the receiver (in the inference process) connects a ``REP`` socket, views each tensor in the
  shared buffer and hands the bucket to a callback; it closes (never unlinks) the segment; the
  sender unlinks it and removes the socket file.

This module loads verl's own file and runs its classes unchanged; it adds only what the
sparsecorr server needs around them: the file is loaded by path (its package ``__init__``
imports vLLM and raises without it), on the CPU its device helpers are bound to the CPU (verl's
platform probe falls back to CUDA on a machine with no accelerator), and each socket gets a
receive timeout so a peer that dies leaves no thread waiting forever.
"""

from __future__ import annotations

import importlib.util
import os
import types
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import torch

__all__ = ["full_tensors", "receive_buckets", "send_buckets", "transfer_module", "unavailable_reason",
           "zmq_handle"]

_RELATIVE = Path("workers", "rollout", "vllm_rollout", "bucketed_weight_transfer.py")
_MODULES: dict[str, types.ModuleType] = {}


def unavailable_reason() -> str | None:
    """Why verl's bucketed transfer cannot run in this process (``None`` when it can)."""
    if importlib.util.find_spec("zmq") is None:
        return "pyzmq is not installed (verl's bucketed transfer imports zmq)"
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return "verl is not installed"
    if not Path(spec.submodule_search_locations[0], _RELATIVE).is_file():
        return f"this verl has no {_RELATIVE.as_posix()} (verl 0.9.1 ships it)"
    return None


class _CpuDevice:
    """What verl's transfer calls on ``get_torch_device()``, for host memory (no-ops)."""

    @staticmethod
    def synchronize() -> None: ...

    @staticmethod
    def ipc_collect() -> None: ...

    @staticmethod
    def empty_cache() -> None: ...


def transfer_module(device_type: str) -> types.ModuleType:
    """verl's ``bucketed_weight_transfer`` module, loaded from its file (once per device type).

    On ``device_type="cpu"`` its device helpers (``get_torch_device``, ``is_support_ipc``,
    ``get_device_name``, ``get_device_id``) are bound to the host: shared memory, no IPC.

    Raises:
        ImportError: `unavailable_reason` is not None.
    """
    if device_type in _MODULES:
        return _MODULES[device_type]
    reason = unavailable_reason()
    if reason is not None:
        raise ImportError(f"verl's bucketed weight transfer: {reason}")
    root = importlib.util.find_spec("verl").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(f"sparsecorr_verl._verl_bucketed_{device_type}",
                                                  Path(root, _RELATIVE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if device_type == "cpu":
        module.get_torch_device = lambda: _CpuDevice
        module.is_support_ipc = lambda: False
        module.get_device_name = lambda: "cpu"
        module.get_device_id = lambda: 0
    _MODULES[device_type] = module
    return module


def zmq_handle(replica_rank: int) -> str:
    """A fresh ``ipc://`` path for one update of one replica (verl names its path after the Ray
    job, replica and rank; a fresh one per update cannot meet a stale socket file)."""
    return f"ipc:///tmp/sparsecorr-weights-{os.getpid()}-{int(replica_rank)}-{uuid.uuid4().hex[:12]}.sock"


def _timed(module: types.ModuleType, base: type, timeout_s: float) -> type:
    """``base`` whose socket gives up after ``timeout_s`` without a message (``zmq.Again``)."""
    zmq = module.zmq

    class Timed(base):
        def _init_socket(self) -> None:
            super()._init_socket()
            self.socket.setsockopt(zmq.RCVTIMEO, max(1, int(timeout_s * 1000)))

    return Timed


def full_tensors(weights: Iterable | AsyncIterator) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs with each DTensor gathered (``full_tensor``), detached; a sync or
    async iterable in, an async iterator out (what the sender iterates)."""

    def plain(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()

    async def gen():
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                yield name, plain(tensor)
        else:
            for name, tensor in weights:
                yield name, plain(tensor)

    return gen()


async def send_buckets(weights: Iterable | AsyncIterator, *, handle: str, bucket_megabytes: int, use_shm: bool,
                       device_type: str, timeout_s: float) -> None:
    """Send ``weights`` with verl's ``BucketedWeightSender`` (buckets of ``bucket_megabytes``).

    Raises:
        ValueError: ``bucket_megabytes`` < 1.
        TimeoutError: the receiver sent nothing back for ``timeout_s`` seconds.
    """
    if int(bucket_megabytes) < 1:
        raise ValueError(f"rollout.checkpoint_engine.update_weights_bucket_megabytes: expected >= 1, "
                         f"got {bucket_megabytes}")
    module = transfer_module(device_type)
    sender = _timed(module, module.BucketedWeightSender, timeout_s)(
        zmq_handle=handle, bucket_size_mb=int(bucket_megabytes), use_shm=use_shm)
    try:
        await sender.async_send_weights(full_tensors(weights))
    except module.zmq.Again as exc:
        raise TimeoutError(f"weight update over {handle}: the server acknowledged no bucket for "
                           f"{timeout_s} s") from exc


def receive_buckets(handle: str, *, device: torch.device, use_shm: bool, timeout_s: float,
                    on_bucket: Callable[[list[tuple[str, torch.Tensor]], bool], None]) -> None:
    """Receive with verl's ``BucketedWeightReceiver`` (blocking: run it off the event loop);
    ``on_bucket(bucket, is_last)`` gets each bucket's ``(name, tensor)`` views, valid only
    during the call (the sender refills the buffer after it returns).

    Raises:
        TimeoutError: the sender sent nothing for ``timeout_s`` seconds (the socket is closed).
    """
    module = transfer_module(device.type)
    receiver = _timed(module, module.BucketedWeightReceiver, timeout_s)(
        zmq_handle=handle, device=device, use_shm=use_shm)
    try:
        receiver.receive_weights(on_bucket)
    except module.zmq.Again as exc:
        raise TimeoutError(f"weight update over {handle}: no bucket arrived for {timeout_s} s") from exc
