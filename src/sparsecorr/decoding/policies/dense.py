"""``Dense()``: no compression, no selection: the reference the sparse policies are measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Kind, KVPolicy

__all__ = ["Dense"]


@dataclass(frozen=True)
class Dense(KVPolicy):
    """Attend to the whole KV cache (kind ``"dense"``; the budget is ignored)."""

    name: ClassVar[str] = "dense"
    kind: ClassVar[Kind] = "dense"
    ignores_budget: ClassVar[bool] = True
