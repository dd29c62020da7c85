"""``SparseCorrServer``: the rollout server of ``rollout.name=sparsecorr`` (a Ray actor's body).

It holds an inference copy of the policy (the model at ``model_config.local_path``: in
``rollout.dtype``, bf16 by default, on CUDA; in the checkpoint's own dtype on the CPU; eval
mode, no gradients, no training hooks) and serves verl's token-in / token-out contract from
``sparsecorr.decoding.generate``:

- ``generate(prompt_ids, sampling_params, request_id) -> TokenOutput(token_ids, log_probs,
  stop_reason)``: concurrent requests are batched by `RequestBatcher`; ``log_probs`` are the
  sparse sampler's log-probs of the sampled tokens (the tempered, truncated distribution it
  sampled from), which verl's agent loop stores as ``rollout_log_probs``;
- ``update_weights(named_tensors)``: copies the actor's full tensors into the copy, in place;
- ``sleep`` / ``release_kv_cache`` wait for the running batch and take no new one (the engine
  allocates its KV pool, graphs and plans per call and frees them when the call returns, so
  nothing of the engine's stays allocated); ``sleep`` also moves the weights of a CUDA copy to
  the host. ``wake_up`` / ``resume_kv_cache`` undo them;
- ``abort_all_requests`` resolves the waiting requests as ``stop_reason="aborted"``.

Seeds: a request with ``sampling_params["seed"]`` is batched only with requests of the same
seed, and its batch samples with ``torch.Generator().manual_seed(seed)`` over the rows ordered by
``request_id``. Without a seed the server's own generator (seeded once with ``rollout.seed +
replica_rank``) samples, so runs repeat when the batches do; with ``rollout.full_determinism``
every request without a seed gets ``rollout.seed + replica_rank``, as verl's vLLM server does, so
every batch samples from a freshly seeded generator.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from .batcher import RequestBatcher
from .options import EngineOptions, engine_options
from .requests import Completion, parse_request, run_batch

__all__ = ["SparseCorrServer", "load_policy_copy"]

logger = logging.getLogger("sparsecorr_verl")
_MULTI_MODAL = ("image_data", "video_data", "audio_data")


def _field(config: Any, name: str, default: Any = None) -> Any:
    get = getattr(config, "get", None)
    value = get(name, default) if get is not None else getattr(config, name, default)
    return default if value is None else value


def load_policy_copy(path: str, *, device: torch.device, dtype: str = "bfloat16") -> torch.nn.Module:
    """The inference copy: ``path``'s causal LM on ``device`` (``dtype`` on CUDA, the checkpoint's
    own dtype elsewhere), in eval mode with every parameter frozen."""
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype) if device.type == "cuda" else "auto"
    if device.type == "cuda" and not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"rollout.dtype: expected a torch dtype name such as 'bfloat16', got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    model.to(device).eval()
    model.requires_grad_(False)
    return model


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
        self._batcher: RequestBatcher | None = None
        self._generator: torch.Generator | None = None
        self._weights_on_host = False

    # -- start-up ------------------------------------------------------------------------------
    async def launch_server(self, **_unused: Any) -> None:
        """Load the inference copy and start the batcher (``**_unused``: verl's multi-node args)."""
        if self.model is not None:
            return
        path = _field(self.model_config, "local_path") or _field(self.model_config, "path")
        self.model = load_policy_copy(str(path), device=self.device, dtype=str(_field(self.config, "dtype", "bfloat16")))
        hf = self.model.config
        self.max_model_len = int(_field(self.config, "max_model_len", getattr(hf, "max_position_embeddings", 0)))
        if self.max_model_len < 2:
            raise ValueError(f"rollout.max_model_len: expected >= 2 (or a model with max_position_embeddings), "
                             f"got {self.max_model_len}")
        gen_cfg = _field(self.model_config, "generation_config")
        eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        self.eos_token_id = eos if eos is not None else getattr(hf, "eos_token_id", None)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        seed = int(_field(self.config, "seed", 0)) + int(self.replica_rank)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        max_batch = self.options.max_batch_size or int(_field(self.config, "max_num_seqs", 1024))
        self._batcher = RequestBatcher(self._run, max_batch=max_batch, window_s=self.options.batch_window_ms / 1000)
        self._generate_kwargs = dict(policy=self.options.build_policy(), budget=self.options.build_budget(),
                                     backend=self.options.backend, prefill_chunk=self.options.prefill_chunk,
                                     cuda_graph=self.options.cuda_graph_for(self.device.type),
                                     fused=self.options.fused_step)
        logger.info("sparsecorr rollout server %d: %s on %s (%s), policy %s", self.replica_rank,
                    type(self.model).__name__, self.device, next(self.model.parameters()).dtype, self.options.policy)

    def get_server_address(self) -> tuple[str, int]:
        """No HTTP server: verl's load balancer only needs a unique id per replica."""
        return f"sparsecorr-replica-{self.replica_rank}", 0

    def get_master_address(self) -> tuple[None, None]:
        return None, None

    def _run(self, requests) -> list[Completion]:
        key = requests[0].key
        generator = self._generator if key.seed is None else \
            torch.Generator(device=self.device).manual_seed(key.seed)
        return run_batch(self.model, requests, generate_kwargs=self._generate_kwargs,
                         eos_token_id=self.eos_token_id, generator=generator)

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id: str, *,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, priority: int = 0, **extra: Any):
        """verl's ``generate``: one request's tokens, log-probs and stop reason (``TokenOutput``).

        Raises:
            ValueError: a multi-modal input, an over-long ``prompt_ids``, an unsupported sampling
                parameter (each naming the field).
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
        n = len(prompt_ids)
        params = dict(sampling_params or {})
        if bool(_field(self.config, "full_determinism", False)) and params.get("seed") is None:
            params["seed"] = int(_field(self.config, "seed", 0)) + int(self.replica_rank)  # as verl's vLLM server
        request = parse_request(request_id, prompt_ids, params,
                                max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                default_max_tokens=max(1, min(response_len, prompt_len + response_len - n)))
        done = await self._batcher.submit(request)
        extra_fields = {"global_steps": self.global_steps}
        if done is None:
            return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted", extra_fields=extra_fields)
        return TokenOutput(token_ids=done.token_ids, log_probs=done.log_probs if request.logprobs else None,
                           stop_reason="completed", extra_fields={**extra_fields, "finish_reason": done.finish_reason})

    async def abort_all_requests(self, reject_request: bool = False, **_unused: Any) -> dict[str, Any]:
        """Resolve every waiting request as aborted; the running batch finishes first. Requests
        arriving afterwards wait for `resume_generation` (``reject_request``: are aborted)."""
        await self.launch_server()
        ids = await self._batcher.abort(reject=reject_request)
        return {"aborted_count": len(ids), "request_ids": ids}

    async def resume_generation(self) -> None:
        await self.launch_server()
        self._batcher.resume()

    async def wait_for_requests_to_drain(self) -> None:
        await self.launch_server()
        async with self._batcher.engine_lock:
            pass

    # -- memory --------------------------------------------------------------------------------
    async def release_kv_cache(self) -> None:
        """Take no new batch and wait for the running one: the engine then holds no KV pool,
        graph or plan (it frees them at the end of every call)."""
        await self.launch_server()
        await self._batcher.pause_engine()
        _empty_device_cache(self.device)

    async def resume_kv_cache(self) -> None:
        await self.launch_server()
        if not self._weights_on_host:
            self._batcher.resume_engine()

    async def clear_kv_cache(self) -> None:
        """Nothing to clear: the engine keeps no prefix cache between calls."""

    async def sleep(self) -> None:
        """`release_kv_cache`, and the weights of a CUDA copy to the host (with
        ``rollout.free_cache_engine``)."""
        if not bool(_field(self.config, "free_cache_engine", True)):
            return
        await self.release_kv_cache()
        await self.release_weights()

    async def release_weights(self) -> None:
        await self.launch_server()
        async with self._batcher.engine_lock:
            if self.device.type == "cuda":
                self.model.to("cpu")
                _empty_device_cache(self.device)
            self._weights_on_host = True
        await self._batcher.pause_engine()

    async def resume_weights(self) -> None:
        await self.launch_server()
        if self._weights_on_host:
            self.model.to(self.device)
            self._weights_on_host = False

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
        in place, after the running batch; returns how many were copied.

        Raises:
            ValueError: a name the model does not have, or a shape that differs.
        """
        await self.launch_server()
        async with self._batcher.engine_lock:
            return copy_weights(self.model, named_tensors)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def start_profile(self, **_unused: Any) -> None:
        """Profiling is not wired to the sparse engine (a no-op, as verl allows)."""

    async def stop_profile(self) -> None:
        """See `start_profile`."""

    async def state(self) -> dict[str, Any]:
        """What the server holds now (for tests and logs)."""
        return {"launched": self.model is not None, "weights_on_host": self._weights_on_host,
                "waiting": 0 if self._batcher is None else self._batcher.waiting,
                "batches_run": 0 if self._batcher is None else self._batcher.batches_run,
                "global_steps": self.global_steps}


def copy_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy full tensors into ``model``'s parameters and buffers by name, in place (cast to each
    target's dtype and device). A DTensor is gathered first."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    copied = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise ValueError(f"named_tensors: {name!r} is not a parameter or buffer of the inference "
                                 f"copy ({type(model).__name__})")
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"named_tensors[{name!r}]: expected shape {tuple(target.shape)}, "
                                 f"got {tuple(tensor.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            copied += 1
    return copied


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
