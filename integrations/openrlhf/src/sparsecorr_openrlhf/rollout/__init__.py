"""Sparse rollouts inside OpenRLHF: `SparseRolloutActor` stands in for OpenRLHF's vLLM
``RolloutRayActor`` (same methods and return shapes), served by the bundled sparse decoding
engine's continuous-batching scheduler; `create_sparse_engines` builds them where OpenRLHF's
``create_vllm_engines`` would; `parse_rollout_args` reads the launcher's ``--sparsecorr.rollout``
and engine flags into a ``sparsecorr.sampler.SamplerSpec``.

Importing this package imports nothing heavy: each name loads its module on first use (the
engine needs transformers; `create_sparse_engines` Ray; the executors of ``generate_responses``
OpenRLHF's ``openrlhf.utils.agent``, and so ``aiohttp``). Neither vLLM nor Ray is imported by
the actor itself.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"SparseRolloutActor": "actor", "load_executor": "actor", "actor_kwargs": "engines",
          "create_sparse_engines": "engines", "ENGINE_FLAGS": "flags", "parse_rollout_args": "flags",
          "ActorOutput": "requests", "CompletionOutput": "requests", "Logprob": "requests",
          "parse_sampling": "requests"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
