r"""`SamplerSpec`: how the sparse sampler runs, validated once, shared by every surface.

The same engine options used to be written four times: ``sparsecorr decode``'s flags
(``commands/decode.py``), TRL's ``SparseCorrConfig``, verl's ``EngineOptions``
(``rollout.engine_kwargs.sparsecorr``) and OpenRLHF's ``--sparsecorr.*`` launcher flags. Each
now builds one `SamplerSpec` from its own names (`spec_from` renames a field in the error it
raises, e.g. verl's ``fused_step`` for ``fused``), and hands the engine what the spec says:

- `SamplerSpec.generate_kwargs` for the one-shot ``sparsecorr.decoding.generate``;
- `SamplerSpec.scheduler_kwargs` for the continuous-batching ``Scheduler`` (the verl server, the
  OpenRLHF rollout actor).

Per-request sampling (temperature, top-p, top-k, ``max_tokens``, stop tokens, log-probs) is not
here: it belongs to each request (``RequestParams``) or to the ``generate`` call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BACKENDS", "SamplerSpec", "spec_from"]

#: the backend names (`sparsecorr.decoding.backends.NAMES`; kept here so importing a glue's
#: options stays light)
BACKENDS = ("auto", "torch", "reference", "flashinfer")


def _check_count(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}: expected None or an int >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SamplerSpec:
    """The sparse sampler's engine options; ``__post_init__`` validates them (a ``ValueError``
    naming the field, what was expected and what was given).

    Attributes:
        policy: a KV policy name of the registry (``sparsecorr.decoding.get_policy``: ``dense``,
            ``streaming_llm``, ``snapkv``, ``rkv``, ``block_topk``, or one registered).
        policy_kwargs: the policy's arguments, e.g. ``{"sink": 4}``.
        budget: a constant KV budget (tokens per layer and head).
        schedule: path of a ``BudgetSchedule`` JSON (budget by context length). A policy that
            uses a budget needs exactly one of ``budget`` and ``schedule``; ``dense`` takes neither.
        backend: ``auto`` | ``torch`` | ``reference`` | ``flashinfer``.
        cuda_graph: replay decode steps as CUDA graphs; None = on for a model on CUDA.
        fused: compile the captured step (``sparsecorr.decoding.fused``); None = on with the
            CUDA-graph step; True needs ``cuda_graph`` not False.
        prefill_chunk: prompt tokens per prefill forward (None = the whole prompt at once).
        max_num_seqs: most rows resident at once (None = the memory plan decides).
        max_kv_bytes: bytes the KV pool and the policy's state may take (None = free device
            memory on CUDA; see ``sparsecorr.decoding.memory``).
    """

    policy: str = "dense"
    policy_kwargs: Mapping[str, Any] = field(default_factory=dict)
    budget: int | None = None
    schedule: str | None = None
    backend: str = "auto"
    cuda_graph: bool | None = None
    fused: bool | None = None
    prefill_chunk: int | None = 512
    max_num_seqs: int | None = None
    max_kv_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy_kwargs, Mapping):
            raise ValueError(f"policy_kwargs: expected a mapping of the policy's arguments, got "
                             f"{type(self.policy_kwargs).__name__}")
        object.__setattr__(self, "policy_kwargs", dict(self.policy_kwargs))
        if isinstance(self.schedule, Path):
            object.__setattr__(self, "schedule", str(self.schedule))
        uses_budget = not self.build_policy().ignores_budget
        _check_count("budget", self.budget)
        if self.budget is not None and self.schedule is not None:
            raise ValueError("budget/schedule: expected one of them, got both")
        if uses_budget and self.budget is None and self.schedule is None:
            raise ValueError(f"budget: policy {self.policy!r} needs a budget or a schedule, got neither")
        if not uses_budget and (self.budget is not None or self.schedule is not None):
            raise ValueError(f"policy: expected a sparse KV policy when a budget or schedule is given, "
                             f"got {self.policy!r}")
        if self.schedule is not None and (not isinstance(self.schedule, str) or not Path(self.schedule).is_file()):
            raise ValueError(f"schedule: expected a BudgetSchedule JSON file, got {self.schedule!r} (not found)")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {self.backend!r}")
        for name in ("cuda_graph", "fused"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: expected None, True or False, got {value!r}")
        if self.fused and self.cuda_graph is False:
            raise ValueError("fused: compiles the CUDA-graph decode step, got fused=True with cuda_graph=False")
        for name in ("prefill_chunk", "max_num_seqs", "max_kv_bytes"):
            _check_count(name, getattr(self, name))

    # -- what the engine takes -----------------------------------------------------------------
    def build_policy(self):
        """The ``KVPolicy`` object (a fresh one per call)."""
        from .decoding.policies import get_policy

        try:
            return get_policy(self.policy, **dict(self.policy_kwargs))
        except ValueError as exc:  # get_policy names its own arguments (name, kwargs)
            msg = str(exc)
            for own, ours in (("name:", "policy:"), ("kwargs:", "policy_kwargs:")):
                if msg.startswith(own):
                    msg = ours + msg[len(own):]
            raise ValueError(msg) from None

    def build_budget(self):
        """``generate``'s ``budget``: an int, a loaded ``BudgetSchedule``, or None (dense)."""
        if self.schedule is not None:
            from .schedules import BudgetSchedule

            return BudgetSchedule.load(self.schedule)
        return self.budget

    def cuda_graph_for(self, device_type: str) -> bool:
        """``cuda_graph`` resolved for a model on ``device_type`` (None = on for ``cuda``)."""
        return device_type == "cuda" if self.cuda_graph is None else self.cuda_graph

    def generate_kwargs(self, device_type: str) -> dict[str, Any]:
        """The keywords of ``sparsecorr.decoding.generate`` this spec sets (``policy``,
        ``budget``, ``backend``, ``prefill_chunk``, ``cuda_graph``, ``fused``, ``max_num_seqs``,
        ``max_kv_bytes``) for a model on ``device_type``."""
        return {"policy": self.build_policy(), "budget": self.build_budget(), "backend": self.backend,
                "prefill_chunk": self.prefill_chunk, "cuda_graph": self.cuda_graph_for(device_type),
                "fused": self.fused, "max_num_seqs": self.max_num_seqs, "max_kv_bytes": self.max_kv_bytes}

    def scheduler_kwargs(self, device_type: str, *, max_model_len: int) -> dict[str, Any]:
        """The keywords of ``sparsecorr.decoding.Scheduler`` this spec sets, for a model on
        ``device_type`` serving requests of at most ``max_model_len`` tokens
        (``prefill_chunk=None``: the whole prompt at once, i.e. ``max_model_len``)."""
        kw = self.generate_kwargs(device_type)
        kw["prefill_chunk"] = self.prefill_chunk or max_model_len
        return {**kw, "max_model_len": max_model_len}


def spec_from(values: Mapping[str, Any], *, rename: Mapping[str, str] | None = None, where: str = "") -> SamplerSpec:
    """A `SamplerSpec` from a surface's own fields: ``values`` keyed by `SamplerSpec`'s field
    names; ``rename`` maps a spec field to the surface's name (e.g. ``{"fused": "fused_step"}``)
    and ``where`` prefixes it (e.g. ``"--sparsecorr."``), so the ``ValueError`` names the field
    the user set."""
    rename = dict(rename or {})
    try:
        return SamplerSpec(**values)
    except ValueError as exc:
        msg = str(exc)
        name, sep, rest = msg.partition(":")
        if sep and " " not in name:
            parts = [where + rename.get(n, n) for n in name.split("/")]
            msg = "/".join(parts) + sep + rest
        raise ValueError(msg) from None
