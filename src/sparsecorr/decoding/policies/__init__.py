"""KV-cache policies: which past tokens a sparse sampler keeps (eviction) or attends to (selection).

| policy | rule | kind | source |
|---|---|---|---|
| ``Dense()`` | everything | dense | — |
| ``StreamingLLM(sink=4)`` | first ``sink`` + most recent | eviction | Xiao et al., 2024 |
| ``SnapKV(window=8, kernel=7)`` | observation-window attention (causal in the window), pooled before it | eviction | Li et al., 2024 |
| ``RKV(window=8, kernel=7, mix=0.1, buffer=128)`` | R-KV's code: 0.1·importance − 0.9·softmax(thresholded key redundancy) | eviction | R-KV, as Sparse-RL uses it |
| ``RKV(variant="sparse_rl")`` | the same, summed over KV heads: one kept set per layer | eviction | Sparse-RL's SGLang fork |
| ``RKV(scoring="minmax")`` | the earlier min-max mix of SnapKV's votes and the mean key cosine | eviction | — |
| ``BlockTopK(page_size=16, ...)`` | top pages by mean-key · mean-query | selection | Sparrow |

An eviction policy keeps ``budget`` slots at a compression, which runs once a row holds more
than ``budget + buffer``: the step that triggers it attends ``budget + buffer + 1`` tokens. Each
eviction policy's kept sets are tested against a port of its authors' code
(``tests/unit/decoding/references``).
"""

from __future__ import annotations

from .base import EvictionPolicy, KeepSet, KVPolicy, compress, group_scores
from .block_topk import (
    BlockTopK,
    Selection,
    SelectionPlan,
    SelectionState,
    gather_mask,
    keep_counts,
    page_means,
    pages_to_mask,
    rank_pages,
    select_pages,
    selection_plan,
)
from .dense import Dense
from .rkv import RKV, RKVState, key_redundancy
from .snapkv import RingState, SnapKV, pool_scores, ring_order, ring_slots
from .state import PlanInputs, PolicyState
from .streaming_llm import StreamingLLM

#: the registry: name -> policy class (`register_policy` adds one)
POLICIES: dict[str, type[KVPolicy]] = {p.name: p for p in (Dense, StreamingLLM, SnapKV, RKV, BlockTopK)}


def register_policy(cls: type[KVPolicy]) -> type[KVPolicy]:
    """Add a policy class to the registry `POLICIES` under its ``name`` (usable as a class
    decorator). A new policy is one file (a `KVPolicy` subclass, with a `PolicyState` subclass
    where it keeps state of its own) plus this call.

    What sees a registered policy: `get_policy` (by name); ``sparsecorr decode --policy NAME``
    and ``sparsecorr calibrate --policy NAME``, once the registering module is imported
    (``--policy-module MODULE``, or ``--policy MODULE:CLASS``, which imports and registers the
    class: `import_policy`); and the registry-driven tests (tests/unit/decoding/test_registry.py)
    when the test registers it. Registration is per process: a module that is not imported
    registers nothing. Raises ``ValueError`` for a non-policy or a name already taken by
    another class."""
    if not (isinstance(cls, type) and issubclass(cls, KVPolicy)) or cls.name == KVPolicy.name:
        raise ValueError(f"cls: expected a KVPolicy subclass with a name of its own, got {cls!r}")
    if POLICIES.get(cls.name, cls) is not cls:
        raise ValueError(f"cls: the name {cls.name!r} is taken by {POLICIES[cls.name].__name__}")
    POLICIES[cls.name] = cls
    return cls


def import_policy(spec: str) -> str:
    """``"package.module:Class"``: import the module, register ``Class`` (`register_policy`;
    registering the same class again is a no-op) and return its registry name. Raises
    ``ValueError`` naming ``spec`` when the module or class is missing or is not a policy."""
    import importlib

    module, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not (sep and module and attr):
        raise ValueError(f"spec: expected 'package.module:Class', got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"spec: cannot load {spec!r}: {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, KVPolicy)):
        raise ValueError(f"spec: expected a KVPolicy subclass, got {spec!r} = {cls!r}")
    return register_policy(cls).name


def get_policy(name: str, **kwargs: object) -> KVPolicy:
    """A policy by name (``dense``, ``streaming_llm``, ``snapkv``, ``rkv``, ``block_topk``, or one
    added by `register_policy`)."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"name: expected one of {sorted(POLICIES)}, got {name!r}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"kwargs: {name} does not take {sorted(kwargs)}: {exc}") from None


__all__ = [
    "POLICIES", "RKV", "BlockTopK", "Dense", "EvictionPolicy", "KVPolicy", "KeepSet", "PlanInputs", "PolicyState",
    "RKVState", "RingState", "Selection", "SelectionPlan", "SelectionState", "SnapKV", "StreamingLLM", "compress",
    "gather_mask", "get_policy", "group_scores", "import_policy", "keep_counts", "key_redundancy", "page_means",
    "pages_to_mask",
    "pool_scores", "rank_pages", "register_policy", "ring_order", "ring_slots", "select_pages", "selection_plan",
]
