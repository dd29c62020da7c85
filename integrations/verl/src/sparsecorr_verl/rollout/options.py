"""The engine knobs of ``rollout.name=sparsecorr``, read from verl's rollout config.

They live where verl keeps each engine's own arguments, ``actor_rollout_ref.rollout.
engine_kwargs.sparsecorr`` (beside ``engine_kwargs.vllm`` / ``.sglang``); ``rollout.custom.
sparsecorr`` is read too when that is where a config put them (setting both is an error).
The defaults are those of the TRL glue's ``SparseCorrConfig``: the ``auto`` backend, CUDA graphs
and the fused step on for a model on a CUDA device; the policy defaults to ``dense`` (the
engine with the full KV cache), since a server needs one. The server's scheduler keeps at most
``max_batch_size`` (default ``rollout.max_num_seqs``) rows resident, fewer when its memory plan
(``max_kv_bytes``, else free device memory) fits fewer.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENGINE_KEY", "EngineOptions", "engine_options"]

ENGINE_KEY = "sparsecorr"
_RENAMED = {"fused": "fused_step", "max_num_seqs": "max_batch_size"}  # SamplerSpec field -> ours


@dataclass(frozen=True)
class EngineOptions:
    """How the server runs its ``sparsecorr.decoding.Scheduler``: verl's names for the fields of
    the shared ``sparsecorr.sampler.SamplerSpec`` (`sampler_spec`), which validates them.

    Attributes:
        policy: KV policy name for ``sparsecorr.decoding.get_policy`` (``dense``,
            ``streaming_llm``, ``snapkv``, ``rkv``, ``block_topk``).
        policy_kwargs: the policy's arguments, e.g. ``{"sink": 4}``.
        budget: a constant KV budget (tokens per layer and head); needs a sparse policy.
        schedule: path of a ``BudgetSchedule`` JSON (budget by context length); exactly one of
            ``budget`` and ``schedule`` with a sparse policy.
        backend: ``generate``'s ``backend``.
        cuda_graph: ``generate``'s ``cuda_graph``; None = on for a model on CUDA.
        fused_step: ``generate``'s ``fused``; None = on whenever the CUDA-graph step is.
        prefill_chunk: ``generate``'s ``prefill_chunk`` (prompt tokens per prefill forward).
        max_batch_size: most requests resident in the running batch at once (the scheduler's
            ``max_num_seqs``); None = ``rollout.max_num_seqs``.
        max_kv_bytes: bytes the scheduler's KV pool and policy state may take (its memory plan);
            None = planned from the device's free memory when the server launches.
        batch_window_ms: deprecated and ignored (the server batched requests in windows before
            it ran on the continuous-batching scheduler; a request now joins the running batch
            at the next step). Setting it warns.
    """

    policy: str = "dense"
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    budget: int | None = None
    schedule: str | None = None
    backend: str = "auto"
    cuda_graph: bool | None = None
    fused_step: bool | None = None
    prefill_chunk: int | None = 512
    max_batch_size: int | None = None
    max_kv_bytes: int | None = None
    batch_window_ms: float | None = None

    def __post_init__(self) -> None:
        self.sampler_spec()  # validates every engine field, named as here
        window = self.batch_window_ms
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window <= 60_000:
                raise ValueError(f"batch_window_ms: expected a number in [0, 60000], got {window!r}")
            warnings.warn("engine_kwargs.sparsecorr.batch_window_ms is deprecated and ignored: the server "
                          "runs on the continuous-batching scheduler, where a request joins the running "
                          "batch at the next step", DeprecationWarning, stacklevel=3)

    def sampler_spec(self):
        """These options as the shared ``sparsecorr.sampler.SamplerSpec`` (``fused_step`` is its
        ``fused``, ``max_batch_size`` its ``max_num_seqs``); a ``ValueError`` names verl's field."""
        from sparsecorr.sampler import spec_from

        return spec_from({"policy": self.policy, "policy_kwargs": self.policy_kwargs, "budget": self.budget,
                          "schedule": self.schedule, "backend": self.backend, "cuda_graph": self.cuda_graph,
                          "fused": self.fused_step, "prefill_chunk": self.prefill_chunk,
                          "max_num_seqs": self.max_batch_size, "max_kv_bytes": self.max_kv_bytes},
                         rename=_RENAMED)

    def build_policy(self):
        """The ``KVPolicy`` object."""
        return self.sampler_spec().build_policy()

    def build_budget(self):
        """``generate``'s ``budget``: an int, a loaded ``BudgetSchedule`` or None (dense)."""
        return self.sampler_spec().build_budget()

    def cuda_graph_for(self, device_type: str) -> bool:
        """``cuda_graph`` resolved for a model on ``device_type``."""
        return self.sampler_spec().cuda_graph_for(device_type)


def _section(container: object, where: str) -> dict[str, Any] | None:
    if container is None:
        return None
    get = getattr(container, "get", None)
    value = get(ENGINE_KEY) if get is not None else None
    if value is None:
        return None
    if not isinstance(value, Mapping) and not hasattr(value, "items"):
        raise ValueError(f"{where}.{ENGINE_KEY}: expected a mapping of engine options, got "
                         f"{type(value).__name__}")
    return {str(k): _plain(v) for k, v in value.items()}


def _plain(value: object) -> object:
    """OmegaConf containers as dicts and lists (the options are plain values)."""
    if hasattr(value, "items") and not isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if not isinstance(value, (str, bytes)) and hasattr(value, "__iter__") and not isinstance(value, Mapping):
        return [_plain(v) for v in value]
    return value


def engine_options(rollout_config: object) -> EngineOptions:
    """The `EngineOptions` in verl's rollout config (a ``RolloutConfig`` or its DictConfig).

    Raises:
        ValueError: on an unknown key (naming it and the known ones), a bad value, or options
            given both under ``engine_kwargs.sparsecorr`` and ``custom.sparsecorr``.
    """
    get = getattr(rollout_config, "get", None)
    read = (lambda k: get(k)) if get is not None else (lambda k: getattr(rollout_config, k, None))
    from_kwargs = _section(read("engine_kwargs"), "rollout.engine_kwargs")
    from_custom = _section(read("custom"), "rollout.custom")
    if from_kwargs is not None and from_custom is not None:
        raise ValueError("rollout.engine_kwargs.sparsecorr / rollout.custom.sparsecorr: expected the engine "
                         "options in one place, got both")
    values = from_kwargs if from_kwargs is not None else (from_custom or {})
    known = set(EngineOptions.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"rollout.engine_kwargs.{ENGINE_KEY}: unknown option(s) {unknown}; expected some "
                         f"of {sorted(known)}")
    if values.get("schedule") is not None:
        values["schedule"] = str(values["schedule"])
    return EngineOptions(**values)
