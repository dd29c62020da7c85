"""GENERATE: sparse decoding over Hugging Face causal LMs, with KV policies and backends.

``generate(model, input_ids, policy=RKV(), budget=512, max_new_tokens=...) -> RolloutBatch``;
``teacher_forced_logprobs(...)`` for the same path with given tokens; ``Scheduler`` for requests
that join and leave a running batch (``EngineDriver`` runs one on a thread of its own);
(``sparsecorr.sampler.SamplerSpec``: the engine options every surface shares). Backends: ``torch``
(reference, CPU/GPU) and ``flashinfer`` (GPU; imported lazily, never at import time).
"""

from .driver import EngineDriver
from .generate import generate, teacher_forced_logprobs
from .policies import RKV, BlockTopK, Dense, KVPolicy, SnapKV, StreamingLLM, get_policy
from .rollout import KeptAgreement, KeptSets, RolloutBatch
from .scheduler import MemoryPlan, RequestOutput, RequestParams, Scheduler

__all__ = [
    "RKV",
    "BlockTopK",
    "Dense",
    "EngineDriver",
    "KVPolicy",
    "KeptAgreement",
    "KeptSets",
    "MemoryPlan",
    "RequestOutput",
    "RequestParams",
    "RolloutBatch",
    "Scheduler",
    "SnapKV",
    "StreamingLLM",
    "generate",
    "get_policy",
    "teacher_forced_logprobs",
]
