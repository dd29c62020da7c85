"""`SparseRolloutActor`: OpenRLHF's rollout actor, served by the sparse decoding engine.

It stands in for OpenRLHF 0.11.2's ``RolloutRayActor`` (``openrlhf/trainer/ray/vllm_engine.py``,
an async Ray actor around vLLM's ``AsyncLLMEngine``) with the same methods, arguments and return
shapes, so OpenRLHF's trainer, samples generator and agent executors drive it unchanged:

- ``generate(prompt_token_ids, sampling_params)``: one request, served by one
  ``sparsecorr.decoding.Scheduler`` on its engine thread (``sparsecorr.decoding.EngineDriver``,
  the verl server's): concurrent requests join the running batch at the next step; the answer
  is vLLM's ``RequestOutput`` shape (``requests.py``) with the sparse sampler's log-probs;
- ``generate_responses(...)``: OpenRLHF's executor (``SingleTurnAgentExecutor``, or the
  ``AgentExecutor`` of ``agent_func_path``) run ``num_samples`` times against this actor;
- weight sync: ``init_process_group`` + ``update_weight`` (the trainer's broadcast from rank 0,
  ``weights.py``) and ``update_weight_cuda_ipc`` (a GPU only), each copied into the inference
  copy on the engine thread between two steps;
- ``sleep(level)`` frees the KV pool, graphs and buffers (nothing of the engine stays alive)
  and moves a CUDA copy's weights to the host; ``wake_up(tags)`` undoes it per tag;
- ``pause_generation`` holds new requests and returns once the running rows finished (vLLM's
  ``mode="keep"`` freezes them mid-response instead); ``resume_generation`` admits again;
- ``reset_prefix_cache``: a no-op (the engine keeps no prefix cache between requests).

The class imports neither Ray nor vLLM; `sparsecorr_openrlhf.rollout.engines` wraps it with
``ray.remote``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import uuid
from typing import Any

import torch

from sparsecorr.decoding import EngineDriver
from sparsecorr.decoding.driver import copy_weights
from sparsecorr.sampler import SamplerSpec

from .requests import ActorOutput, as_output, parse_sampling
from .weights import WeightGroup, receive_cuda_ipc

__all__ = ["SparseRolloutActor", "load_executor"]

logger = logging.getLogger("sparsecorr_openrlhf")


def load_executor(agent_func_path: str | None, remote_rm_url: Any = None):
    """OpenRLHF's executor: the ``AgentExecutor`` class of ``agent_func_path`` (a ``.py`` file,
    an ``AgentExecutorBase`` subclass), else ``SingleTurnAgentExecutor(remote_rm_url)`` (as
    ``RolloutRayActor.__init__`` chooses; ``openrlhf.utils.agent`` needs ``aiohttp``)."""
    from openrlhf.utils.agent import AgentExecutorBase, SingleTurnAgentExecutor

    if not agent_func_path:
        return SingleTurnAgentExecutor(remote_rm_url)
    if not str(agent_func_path).endswith(".py"):
        raise ValueError(f"agent_func_path: expected a Python file, got {agent_func_path!r}")
    spec = importlib.util.spec_from_file_location("agent_module", agent_func_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, "AgentExecutor", None)
    if not (isinstance(cls, type) and issubclass(cls, AgentExecutorBase)):
        raise ValueError(f"agent_func_path: expected a module with an AgentExecutor(AgentExecutorBase) class, "
                         f"got {agent_func_path!r}")
    return cls()


def _own_gpu() -> None:
    """Where Ray was told not to set ``CUDA_VISIBLE_DEVICES`` (``RAY_EXPERIMENTAL_NOSET_CUDA_
    VISIBLE_DEVICES``), make this process see the GPU Ray gave it, as ``RolloutRayActor`` does
    (``_configure_device_env``), before torch touches CUDA."""
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        import ray

        ids = ray.get_gpu_ids()
        if ids:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(ids[0])


def _load(path: str, *, device: torch.device, dtype: str):
    """The inference copy (``dtype`` on CUDA, the checkpoint's own elsewhere), frozen, in eval
    mode; its tokenizer (None when the directory has none) and its stop tokens."""
    from transformers import AutoTokenizer, GenerationConfig

    from sparsecorr.decoding.driver import load_inference_copy

    model = load_inference_copy(path, device=device, dtype=dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception:  # a checkpoint without a tokenizer: outputs carry no text
        tokenizer = None
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except Exception:
        eos = None
    eos = model.config.eos_token_id if eos is None else eos
    eos = () if eos is None else tuple([eos] if isinstance(eos, int) else eos)
    return model, tokenizer, eos


class SparseRolloutActor:
    """One sparse rollout engine (tensor parallel 1) with ``RolloutRayActor``'s interface.

    Args:
        model: the policy's checkpoint directory (OpenRLHF's ``pretrain``).
        sampler: the engine options (a ``SamplerSpec`` or its fields as a dict).
        max_model_len: most tokens (prompt + response) of one request (OpenRLHF's ``max_len``).
        seed: the seed of the sampling generator of requests without their own seed.
        dtype: the copy's dtype on CUDA (OpenRLHF's engines run ``bfloat16``).
        tensor_parallel_size: must be 1 (the engine has no tensor parallelism yet).
        agent_func_path / remote_rm_url: OpenRLHF's executor choice (`load_executor`).
        mm_pad_token_ids: must be empty (text prompts only).
    """

    def __init__(self, model: str, *, sampler: SamplerSpec | dict, max_model_len: int, seed: int = 0,
                 dtype: str = "bfloat16", tensor_parallel_size: int = 1, agent_func_path: str | None = None,
                 remote_rm_url: Any = None, mm_pad_token_ids: Any = None, **_unused: Any) -> None:
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size: the sparse rollout engine runs on one GPU, expected 1, "
                             f"got {tensor_parallel_size!r}")
        if mm_pad_token_ids:
            raise ValueError("mm_pad_token_ids: the sparse rollout actor serves text prompts only (multi-modal "
                             "models are not supported), got image/video pad tokens")
        self.spec = sampler if isinstance(sampler, SamplerSpec) else SamplerSpec(**dict(sampler))
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len: expected an int >= 2, got {max_model_len!r}")
        self.max_model_len, self.seed = max_model_len, int(seed)
        self.agent_func_path, self.remote_rm_url = agent_func_path, remote_rm_url
        _own_gpu()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.tokenizer, self.eos_token_ids = _load(str(model), device=self.device, dtype=dtype)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.executor = None
        self._weights = WeightGroup()
        self._unfinished = 0
        self._held: set[str] = set()  # why admission is held: "paused", "kv_cache", "weights"
        self._driver = EngineDriver(self._scheduler, name="sparsecorr-openrlhf-engine")
        self._driver.start()
        plan = self._driver.plan
        logger.info("sparse rollout actor: %s on %s, %r, %d rows resident at most (%s)", type(self.model).__name__,
                    self.device, self.spec, plan.rows, plan.source)

    def _scheduler(self):  # on the engine thread
        from sparsecorr.decoding import Scheduler

        kwargs = self.spec.scheduler_kwargs(self.device.type, max_model_len=self.max_model_len)
        return Scheduler(self.model, **kwargs, eos_token_id=list(self.eos_token_ids) or None,
                         generator=torch.Generator(device=self.device).manual_seed(self.seed))

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None) -> ActorOutput:
        """One request's vLLM-shaped ``RequestOutput`` (``outputs[0]``: token ids, text,
        ``finish_reason``, per-token ``{token_id: Logprob}`` when ``sampling_params.logprobs``
        is set).

        Raises:
            ValueError: multi-modal data, an over-long prompt, a sampling field the sparse
                sampler cannot honour (each naming it).
            RuntimeError: the engine step that decoded this request failed.
        """
        if multi_modal_data:
            raise ValueError("multi_modal_data: the sparse rollout actor serves text prompts only (multi-modal "
                             "inputs are not supported), got a value")
        request = parse_sampling(uuid.uuid4().hex, prompt_token_ids, sampling_params,
                                 max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                 eos_token_ids=self.eos_token_ids)
        self._unfinished += 1
        try:
            out = await self._driver.submit(request)
        finally:
            self._unfinished -= 1
        return as_output(request, out, tokenizer=self.tokenizer)

    def get_num_unfinished_requests(self) -> int:
        """Requests submitted and not yet answered (OpenRLHF balances engines by it)."""
        return self._unfinished

    async def generate_responses(self, prompt: str, label: str, sampling_params, max_length: int, hf_tokenizer,
                                 num_samples: int = 1, images=None) -> list[dict]:
        """``num_samples`` runs of OpenRLHF's executor on ``prompt``, concurrently (each a dict
        with ``observation_tokens``, ``action_ranges``, ``rollout_log_probs`` ...)."""
        if images:
            raise ValueError("images: the sparse rollout actor serves text prompts only (multi-modal prompts "
                             "are not supported), got images")
        if self.executor is None:
            self.executor = load_executor(self.agent_func_path, self.remote_rm_url)
        runs = [self.executor.execute(prompt=prompt, label=label, sampling_params=sampling_params,
                                      max_length=max_length, hf_tokenizer=hf_tokenizer, llm_engine=self, images=None)
                for _ in range(num_samples)]
        return list(await asyncio.gather(*runs))

    # -- weights -------------------------------------------------------------------------------
    async def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                 backend="nccl", use_ray=False) -> None:
        """Join the trainer's weight-sync group as rank ``rank_offset`` (blocks, off the event
        loop, until every rank joined; `weights.WeightGroup.join`)."""
        await asyncio.to_thread(self._weights.join, master_address, master_port, rank_offset, world_size,
                                group_name, backend, use_ray, device=self.device)

    async def update_weight(self, name, dtype, shape, empty_cache=False) -> None:
        """Receive rank 0's broadcast of ``name`` and copy it into the inference copy, between two
        engine steps (cast to the copy's dtype).

        Raises:
            ValueError: ``name`` is not a parameter or buffer of the copy, or its shape differs
                (after the broadcast was received, so the trainer never hangs).
        """
        weight = await asyncio.to_thread(self._weights.receive, dtype, shape, device=self.device)
        await self._driver.call(lambda _s, w=weight: copy_weights(self.model, [(name, w)]))
        if empty_cache:
            self._empty_cache()

    async def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles, empty_cache=False) -> None:
        """Copy the trainer's tensor behind this GPU's CUDA IPC handle (a GPU only: on the CPU a
        ValueError says to use `update_weight`)."""
        weight = receive_cuda_ipc(ipc_handles, device=self.device)
        if tuple(weight.shape) != tuple(shape) or weight.dtype != dtype:
            raise ValueError(f"ipc_handles[{name!r}]: expected {dtype} {tuple(shape)}, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        await self._driver.call(lambda _s, w=weight: copy_weights(self.model, [(name, w)]))
        torch.cuda.synchronize(self.device)
        if empty_cache:
            self._empty_cache()

    # -- control and memory ----------------------------------------------------------------------
    async def reset_prefix_cache(self) -> None:
        """Nothing to reset: the engine keeps no prefix cache between requests."""

    async def pause_generation(self) -> None:
        """Hand the engine no new request; returns once its running rows finished."""
        self._held.add("paused")
        await self._driver.pause()

    async def resume_generation(self) -> None:
        """Admit requests again (unless the actor sleeps)."""
        self._held.discard("paused")
        await self._resume()

    async def sleep(self, level: int = 1) -> None:
        """Let the running rows finish, free the KV pool, graphs and buffers, and move a CUDA
        copy's weights to the host (``level`` 1 or 2: both keep the weights on the host, as
        the next `update_weight` calls overwrite them anyway)."""
        if level not in (1, 2):
            raise ValueError(f"level: expected 1 or 2, got {level!r}")
        self._held.update(("kv_cache", "weights"))
        await self._driver.pause()
        await self._driver.call(self._release)

    def _release(self, scheduler) -> None:  # on the engine thread
        scheduler.release()
        if self.device.type == "cuda":
            self.model.to("cpu")
        self._empty_cache()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep` for ``tags`` (``weights``, ``kv_cache``; None: both). Requests are admitted
        again once both are awake (the pool is allocated at the next step)."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = sorted(set(tags) - {"weights", "kv_cache"})
        if unknown:
            raise ValueError(f"tags: expected some of ['kv_cache', 'weights'], got {unknown}")
        if "weights" in tags and "weights" in self._held:
            await self._driver.call(lambda _s: self.model.to(self.device))
            self._held.discard("weights")
        if "kv_cache" in tags:
            self._held.discard("kv_cache")
        await self._resume()

    async def _resume(self) -> None:
        if not self._held:
            await self._driver.resume()

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def state(self) -> dict[str, Any]:
        """What the actor holds now (for tests and logs)."""
        return {"held": sorted(self._held), "unfinished": self._unfinished, **await self._driver.stats()}

    async def close(self) -> None:
        """Abort every request and stop the engine thread (nothing of the engine stays alive)."""
        await self._driver.close()
