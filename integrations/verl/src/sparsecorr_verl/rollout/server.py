"""``SparseCorrServer``: the rollout server of ``rollout.name=sparsecorr`` (a Ray actor's body).

It holds an inference copy of the policy (the model at ``model_config.local_path``: in
``rollout.dtype``, bf16 by default, on CUDA; in the checkpoint's own dtype on the CPU; eval
mode, no gradients, no training hooks) and one continuous-batching
``sparsecorr.decoding.Scheduler`` over it, made at launch and kept for the server's lifetime.
The scheduler lives on its own engine thread (`EngineDriver`, ``driver.py``): nothing that
blocks runs on the actor's event loop (loading, weight copies and moves, every step).

- ``generate(prompt_ids, sampling_params, request_id) -> TokenOutput(token_ids, log_probs,
  stop_reason)``: the request joins the running batch at the next step, with its own sampling
  parameters; ``log_probs`` are the sparse sampler's log-probs of the sampled tokens (the
  tempered, truncated distribution it sampled from), which verl's agent loop stores as
  ``rollout_log_probs``. A bad request raises a ValueError naming the field, to its caller only.
- ``abort_all_requests`` aborts the queued requests (no tokens) AND the running rows (their
  partial tokens and log-probs), each returned with ``stop_reason="aborted"``, as verl's vLLM
  server does; new requests then wait for `resume_generation` (``reject_request=True``: they,
  and any request already waiting at that gate, return aborted at once).
- ``wait_for_requests_to_drain`` returns once every submitted request (queued and running) has
  its result.
- ``release_kv_cache`` / ``sleep`` stop handing requests to the scheduler, let the running rows
  finish (they are not aborted: verl aborts first when it wants that), then free the
  scheduler's pool, graphs and buffers (``Scheduler.release``); ``sleep`` then moves the weights
  of a CUDA copy to the host. Requests arriving meanwhile wait. ``resume_kv_cache`` / ``wake_up``
  undo them (the pool is allocated again at the next step).
- ``update_weights_from_ipc(zmq_handle, use_shm=...)`` receives the actor's weights through
  verl's own ``BucketedWeightReceiver`` (CUDA IPC, or shared memory: ``weights.py``) and copies
  each bucket into the copy, in place, on the engine thread between two steps; the adapter
  sends with verl's ``BucketedWeightSender`` from the same node. ``update_weights(named_tensors)``
  is the path where that does not apply (full tensors through Ray; see `copy_weights`).

Seeds: a request with ``sampling_params["seed"]`` samples from its own generator seeded with it,
so its tokens do not depend on which requests share its steps (as vLLM's per-request seed).
Without a seed the scheduler's generator (seeded once with ``rollout.seed + replica_rank``)
samples; with ``rollout.full_determinism`` every request without a seed gets ``rollout.seed +
replica_rank``, as verl's vLLM server does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import torch

from sparsecorr.decoding.driver import EngineDriver, copy_weights, load_inference_copy

from .gate import Gate
from .options import EngineOptions, engine_options
from .requests import parse_request
from .weights import receive_buckets, unavailable_reason

__all__ = ["SparseCorrServer", "copy_weights", "load_policy_copy"]

logger = logging.getLogger("sparsecorr_verl")
_MULTI_MODAL = ("image_data", "video_data", "audio_data")


def _field(config: Any, name: str, default: Any = None) -> Any:
    get = getattr(config, "get", None)
    value = get(name, default) if get is not None else getattr(config, name, default)
    return default if value is None else value


def load_policy_copy(path: str, *, device: torch.device, dtype: str = "bfloat16") -> torch.nn.Module:
    """The inference copy: `sparsecorr.decoding.driver.load_inference_copy` (``dtype`` on CUDA,
    the checkpoint's own elsewhere; transformers' default attention for the model)."""
    return load_inference_copy(path, device=device, dtype=dtype, where="rollout.dtype")


class SparseCorrServer:
    """One rollout server (one GPU, or the CPU): verl's server contract over the sparse engine.

    Args:
        config: verl's ``RolloutConfig`` (or its DictConfig).
        model_config: verl's ``HFModelConfig`` (``local_path``, ``hf_config``, ``generation_config``).
        rollout_mode: verl's ``RolloutMode`` (hybrid, colocated, standalone).
        workers: the trainer (hybrid) or checkpoint-engine workers of this replica.
        replica_rank: this replica's rank.
        node_rank: always 0 (one server per replica).
        cuda_visible_devices: the GPU of the replica's worker ("" on the CPU).
    """

    def __init__(self, config: Any, model_config: Any, rollout_mode: Any, workers: list | None = None,
                 replica_rank: int = 0, node_rank: int = 0, cuda_visible_devices: str = "") -> None:
        if cuda_visible_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        self.config, self.model_config = config, model_config
        self.rollout_mode, self.workers = rollout_mode, workers or []
        self.replica_rank, self.node_rank = replica_rank, node_rank
        self.options: EngineOptions = engine_options(config)
        self.global_steps: int | None = None
        self.model: torch.nn.Module | None = None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._driver: EngineDriver | None = None
        self._launch_lock = threading.Lock()
        self._gate = Gate()
        self._weights_on_host = False
        self._kv_released = False

    # -- start-up ------------------------------------------------------------------------------
    async def launch_server(self, **_unused: Any) -> None:
        """Load the inference copy and start the engine thread with its scheduler, off the event
        loop (``**_unused``: verl's multi-node args)."""
        if self._driver is None:
            await asyncio.to_thread(self._launch)

    def _launch(self) -> None:
        with self._launch_lock:
            if self._driver is not None:
                return
            path = _field(self.model_config, "local_path") or _field(self.model_config, "path")
            model = load_policy_copy(str(path), device=self.device, dtype=str(_field(self.config, "dtype", "bfloat16")))
            hf = model.config
            max_model_len = int(_field(self.config, "max_model_len", getattr(hf, "max_position_embeddings", 0)))
            if max_model_len < 2:
                raise ValueError(f"rollout.max_model_len: expected >= 2 (or a model with max_position_embeddings), "
                                 f"got {max_model_len}")
            gen_cfg = _field(self.model_config, "generation_config")
            eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
            self.eos_token_id = eos if eos is not None else getattr(hf, "eos_token_id", None)
            self.eos_token_ids = () if self.eos_token_id is None else tuple(
                [self.eos_token_id] if isinstance(self.eos_token_id, int) else self.eos_token_id)
            self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
            self.max_model_len = max_model_len
            driver = EngineDriver(lambda: self._scheduler(model), name=f"sparsecorr-engine-{self.replica_rank}")
            driver.start()
            self.model, self._driver = model, driver
            plan = driver.plan
            logger.info("sparsecorr rollout server %d: %s on %s (%s), policy %s, %d rows resident at most "
                        "(%s; %d bytes a row)", self.replica_rank, type(model).__name__, self.device,
                        next(model.parameters()).dtype, self.options.policy, plan.rows, plan.source, plan.row_bytes)

    def _scheduler(self, model: torch.nn.Module):
        """The server's one `Scheduler` (built on the engine thread)."""
        from sparsecorr.decoding import Scheduler

        spec = self.options.sampler_spec()
        seed = int(_field(self.config, "seed", 0)) + int(self.replica_rank)
        kwargs = spec.scheduler_kwargs(self.device.type, max_model_len=self.max_model_len)
        kwargs["max_num_seqs"] = spec.max_num_seqs or int(_field(self.config, "max_num_seqs", 1024))
        return Scheduler(model, **kwargs, eos_token_id=self.eos_token_id,
                         generator=torch.Generator(device=self.device).manual_seed(seed))

    def get_server_address(self) -> tuple[str, int]:
        """No HTTP server: verl's load balancer only needs a unique id per replica."""
        return f"sparsecorr-replica-{self.replica_rank}", 0

    def get_master_address(self) -> tuple[None, None]:
        return None, None

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id: str, *,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, priority: int = 0, **extra: Any):
        """verl's ``generate``: one request's tokens, log-probs and stop reason (``TokenOutput``).

        ``stop_reason`` is ``completed`` (``extra_fields["finish_reason"]``: ``eos`` or
        ``length``) or ``aborted`` (the tokens decoded before the abort, possibly none).

        Raises:
            ValueError: a multi-modal input, an over-long ``prompt_ids``, an unsupported or bad
                sampling parameter, a request id already in flight (each naming the field).
            RuntimeError: the engine step that decoded this request failed (only its rows fail;
                the server goes on serving).
        """
        from verl.workers.rollout.replica import TokenOutput

        await self.launch_server()
        given = {"image_data": image_data, "video_data": video_data, "audio_data": audio_data,
                 "mm_processor_kwargs": mm_processor_kwargs or None, **extra}
        mm = [k for k, v in given.items() if v is not None and (k in _MULTI_MODAL or k.startswith("mm_"))]
        if mm:
            raise ValueError(f"{mm[0]}: the sparsecorr rollout serves text prompts only (multi-modal inputs "
                             "are not supported), got a value")
        unknown = sorted(k for k, v in extra.items() if v is not None)
        if unknown:
            raise ValueError(f"{unknown[0]}: not an argument of the sparsecorr server's generate, got a value")
        prompt_len, response_len = int(_field(self.config, "prompt_length", 0)), int(_field(self.config, "response_length", 1))
        params = dict(sampling_params or {})
        if bool(_field(self.config, "full_determinism", False)) and params.get("seed") is None:
            params["seed"] = int(_field(self.config, "seed", 0)) + int(self.replica_rank)  # as verl's vLLM server
        request = parse_request(request_id, prompt_ids, params, max_model_len=self.max_model_len,
                                vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
                                default_max_tokens=max(1, min(response_len, prompt_len + response_len - len(prompt_ids))))
        extra_fields = {"global_steps": self.global_steps}
        if not await self._gate.admitted():
            return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted", extra_fields=extra_fields)
        out = await self._driver.submit(request)
        if out.finish_reason == "error":
            raise RuntimeError(f"request {request.request_id!r}: the sparse engine's step failed: "
                               f"{out.error!r}") from out.error
        tokens = list(out.token_ids)
        log_probs = out.logprobs.tolist() if request.logprobs and tokens else None
        if out.finish_reason == "aborted":
            return TokenOutput(token_ids=tokens, log_probs=log_probs, stop_reason="aborted", extra_fields=extra_fields)
        return TokenOutput(token_ids=tokens, log_probs=log_probs, stop_reason="completed",
                           extra_fields={**extra_fields, "finish_reason": out.finish_reason})

    async def abort_all_requests(self, reject_request: bool = False, **_unused: Any) -> dict[str, Any]:
        """Abort every queued request and every running row (each caller gets its partial tokens
        with ``stop_reason="aborted"``). New requests then wait for `resume_generation`
        (``reject_request``: they, and those already waiting, return aborted at once)."""
        self._gate.close(reject=reject_request)
        if self._driver is None:
            return {"aborted_count": 0, "request_ids": []}
        ids = await self._driver.abort_all()
        return {"aborted_count": len(ids), "request_ids": ids}

    async def abort_request(self, request_id: str, **_unused: Any) -> dict[str, Any]:
        """Abort one request (queued or running): its caller gets its partial tokens, aborted."""
        found = self._driver is not None and await self._driver.abort(str(request_id))
        return {"aborted": found, "request_id": request_id}

    async def resume_generation(self) -> None:
        """Admit requests again after `abort_all_requests`."""
        self._gate.reopen()

    async def wait_for_requests_to_drain(self) -> None:
        """Return once every submitted request (queued and running) has its result."""
        if self._driver is not None:
            await self._driver.drain()

    # -- memory --------------------------------------------------------------------------------
    async def release_kv_cache(self) -> None:
        """Hand the scheduler no new request, let its running rows finish, then free its KV
        pool, graphs and buffers. Requests arriving meanwhile wait for `resume_kv_cache`."""
        await self.launch_server()
        await self._driver.pause()
        await self._driver.call(self._release_engine)
        self._kv_released = True

    def _release_engine(self, scheduler) -> None:  # on the engine thread
        scheduler.release()
        _empty_device_cache(self.device)

    async def resume_kv_cache(self) -> None:
        """Allow admission again (the pool is allocated at the next step); with the weights on
        the host, admission waits for `resume_weights`."""
        await self.launch_server()
        self._kv_released = False
        if not self._weights_on_host:
            await self._driver.resume()

    async def clear_kv_cache(self) -> None:
        """Nothing to clear: the engine keeps no prefix cache between requests."""

    async def sleep(self) -> None:
        """`release_kv_cache`, and the weights of a CUDA copy to the host (with
        ``rollout.free_cache_engine``)."""
        if not bool(_field(self.config, "free_cache_engine", True)):
            return
        await self.release_kv_cache()
        await self.release_weights()

    async def release_weights(self) -> None:
        """Pause the engine first (no step can start on host weights), free its pool, then move
        the weights of a CUDA copy to the host."""
        await self.launch_server()
        await self._driver.pause()
        self._weights_on_host = True
        await self._driver.call(self._weights_to_host)

    def _weights_to_host(self, scheduler) -> None:  # on the engine thread
        scheduler.release()
        if self.device.type == "cuda":
            self.model.to("cpu")
        _empty_device_cache(self.device)

    async def resume_weights(self) -> None:
        """The weights back on the device; admission resumes unless the KV cache is released."""
        await self.launch_server()
        if self._weights_on_host:
            await self._driver.call(lambda _s: self.model.to(self.device))
            self._weights_on_host = False
            if not self._kv_released:
                await self._driver.resume()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep` (``tags``: ``weights`` and/or ``kv_cache``; default both)."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        if "weights" in tags:
            await self.resume_weights()
        if "kv_cache" in tags:
            await self.resume_kv_cache()

    # -- weights -------------------------------------------------------------------------------
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(name, tensor)`` pairs (full tensors, Hugging Face names) into the inference copy
        in place, on the engine thread between two steps; returns how many were copied. verl
        aborts or releases before a weight sync; rows still running then continue on the new
        weights.

        Raises:
            ValueError: a name the model does not have, or a shape that differs.
        """
        await self.launch_server()
        return await self._driver.call(lambda _s: copy_weights(self.model, named_tensors))

    async def update_weights_from_ipc(self, zmq_handle: str, *, use_shm: bool, timeout_s: float = 300.0) -> int:
        """Receive the actor's full tensors from verl's ``BucketedWeightSender`` at ``zmq_handle``
        (CUDA IPC, or shared memory with ``use_shm``) and copy each bucket into the inference copy
        in place, on the engine thread between two steps; returns how many tensors were copied.

        The receiving runs on a worker thread (never the event loop nor the engine thread): the
        engine goes on stepping between buckets, as between the named-tensor path's calls. A
        bucket that fails to copy (an unknown name, a shape that differs) stops the copying; the
        transfer still runs to its end, so the sender is released, then its error is raised here.
        Tensors copied before it stay copied (verl fails the step on the error).

        Raises:
            ValueError: a name the model does not have, or a shape that differs.
            TimeoutError: no bucket arrived for ``timeout_s`` seconds (the socket is closed).
        """
        await self.launch_server()
        copied, failures = [0], []

        def on_bucket(bucket, _is_last) -> None:  # on the receiving thread; views valid during the call
            if failures:
                return
            held = [bucket]  # popped by the engine thread: no closure keeps a view of the buffer
            try:  # a loop of this thread's own: the actor's loop may be busy (an in-process sender blocks it)
                copied[0] += asyncio.run(self._driver.call(lambda _s: copy_weights(self.model, held.pop())))
            except Exception as exc:  # raised below, once the sender is released
                failures.append(exc.with_traceback(None))  # no frame may keep a view of the buffer
            finally:
                held.clear()
                # a no-op barrier: once it runs, the engine thread holds nothing of the copy command
                # (the receiver closes the shared segment, which fails while a view is alive)
                asyncio.run(self._driver.call(lambda _s: None))

        device = torch.device("cuda", torch.cuda.current_device()) if self.device.type == "cuda" else self.device
        await asyncio.to_thread(receive_buckets, str(zmq_handle), device=device, use_shm=bool(use_shm),
                                timeout_s=float(timeout_s), on_bucket=on_bucket)
        if failures:
            raise failures[0]
        return copied[0]

    def transfer_info(self) -> dict[str, Any]:
        """Where this server runs, for the adapter's choice of weight path: its Ray node (None
        outside Ray), its device type, and why verl's bucketed transfer cannot run here (None
        when it can)."""
        node = None
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"node_id": node, "device": self.device.type, "unavailable": unavailable_reason()}

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def start_profile(self, **_unused: Any) -> None:
        """Profiling is not wired to the sparse engine (a no-op, as verl allows)."""

    async def stop_profile(self) -> None:
        """See `start_profile`."""

    async def state(self) -> dict[str, Any]:
        """What the server holds now (for tests and logs)."""
        base = {"launched": self._driver is not None, "weights_on_host": self._weights_on_host,
                "kv_released": self._kv_released, "gate_open": self._gate.open, "global_steps": self.global_steps}
        if self._driver is None:
            return base
        return {**base, **await self._driver.stats()}


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
