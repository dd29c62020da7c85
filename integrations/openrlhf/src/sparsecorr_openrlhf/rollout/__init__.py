"""Sparse rollouts inside OpenRLHF: `SparseRolloutActor` stands in for OpenRLHF's vLLM
``RolloutRayActor`` (same methods and return shapes), served by the bundled sparse decoding
engine's continuous-batching scheduler; `create_sparse_engines` builds them where OpenRLHF's
``create_vllm_engines`` would; `parse_rollout_args` reads the launcher's ``--sparsecorr.rollout``
and engine flags into a ``sparsecorr.decoding.SamplerSpec``.

Importing this package imports neither Ray, vLLM nor OpenRLHF (`actor` needs OpenRLHF's
``openrlhf.utils.agent``, and so ``aiohttp``, only for ``generate_responses``).
"""

from .actor import SparseRolloutActor, load_executor
from .engines import actor_kwargs, create_sparse_engines
from .flags import ENGINE_FLAGS, parse_rollout_args
from .requests import ActorOutput, CompletionOutput, Logprob, parse_sampling

__all__ = ["ENGINE_FLAGS", "ActorOutput", "CompletionOutput", "Logprob", "SparseRolloutActor", "actor_kwargs",
           "create_sparse_engines", "load_executor", "parse_rollout_args", "parse_sampling"]
