r"""A toy KV policy in one file: keep every other token (and the recent window).

``EveryOther(window=4, buffer=4)`` is an eviction policy whose score prefers even positions:
\(\mathrm{score}_j = 1\) where the true position is even, else 0 (ties go to the more recent
token, as for every policy). It needs nothing beside the pool, so it defines its score and
inherits every hook of `EvictionPolicy`; its own state (``ToyState``) only counts what the
engine hands it, to show where a policy's state is called. Nothing else of sparsecorr changes
for it: `register_policy` puts it in the registry (the registry-driven tests do that in a
fixture and take it out again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsecorr.decoding.policies import EvictionPolicy, PolicyState
from sparsecorr.decoding.policies.base import check_int


class ToyState(PolicyState):
    """Counts the hooks the engine calls: steps planned, layers observed, compression events."""

    def __init__(self, policy, pool, *, q_heads, table):
        super().__init__(policy, pool, q_heads=q_heads, table=table)
        self.calls = {"plan": 0, "observe": 0, "event": 0}

    def plan(self, inputs):
        self.calls["plan"] += 1
        return None

    def observe(self, layer, query, step):
        self.calls["observe"] += 1

    def event(self, **kw):
        self.calls["event"] += 1
        return None


@dataclass(frozen=True)
class EveryOther(EvictionPolicy):
    """Keep the tokens at even positions first (see the module docstring)."""

    name: ClassVar[str] = "every_other"
    state_type: ClassVar[type[PolicyState]] = ToyState
    window: int = 4
    buffer: int = 4
    sink: int = 0

    def __post_init__(self) -> None:
        check_int("window", self.window, minimum=0)
        check_int("buffer", self.buffer, minimum=0)
        check_int("sink", self.sink, minimum=0)

    def score(self, *, keys, queries, valid, positions, query_valid=None) -> torch.Tensor:
        return (positions % 2 == 0).float()  # [B, H_kv, S]
