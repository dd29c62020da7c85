r"""A policy's state beside the KV pool, and the hooks through which the engine runs it.

The engine, the cache and the graph runner never ask which policy they run. They call the
hooks of the `PolicyState` the policy makes for each ``generate`` call
(`sparsecorr.decoding.policies.KVPolicy.new_state`); a hook's default is what a dense policy
does (nothing beside K/V, attention over every valid slot), and a policy overrides only the
hooks it needs (kvpress's presses have the same shape: one base class that does the shared
work, one file per method). In the order a call meets them:

- **allocate** (``__init__``): the buffers the policy keeps beside the pool's K, V and
  positions: SnapKV's and R-KV's observation ring, R-KV's key norms and unit-key sums,
  BlockTopK's page sums (`buffers`; `added_to`: the ones a step adds to, which a CUDA graph's
  warm-up step must restore);
- **plan** each forward once, on the host (`plan`): the policy's part of the ``Step`` (ring
  columns, BlockTopK's pages, budgets and keep counts), with ``static=True`` at the fixed sizes a
  CUDA graph captures; `derive`: the part's device work (BlockTopK's selection plan), run by the
  eager step at once and by a captured step inside the graph; `page_selection`: the keep counts
  of a paged kernel's selected-page table;
- **per layer**: `written` (after the layer's K/V write), `all_written` (after the last
  layer's), `observe` (the layer's queries) and `attend` (how the layer attends: by default the
  backend over the valid slots, `sparsecorr.decoding.cache.SparseKVCache.attend_dense`);
- **at a compression event**: `event` (once per event), `score_inputs` (what ``score`` reads
  beside keys and positions), `compacting` / `compacted` (around the pool's compaction);
- **when rows leave the batch**: `select_rows`;
- **on the host**: `attended` (slots each query reads, for ``RolloutBatch.kv_kept``),
  `needs_mask` and `static_pages`.

Every hook takes explicit tensors; shapes are per hook (``B`` rows, ``L`` layers, ``H_kv`` KV
heads, ``S`` slots, ``W`` the observation window).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..pool import KVPool

__all__ = ["PlanInputs", "PolicyState"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    """What a step's planner knows on the host (read-only): ``count`` ``[B]`` valid slots per row
    before the forward, ``ctx`` ``[B]`` tokens fed per row, ``real`` ``[B]`` real tokens of the
    chunk per row, ``slots`` ``[B, Q]`` the write slots, ``offsets`` ``[Q]`` the chunk's token
    offsets (``arange(Q)``, made once per step), ``q_len``, ``decode``, ``static`` (a CUDA
    graph's fixed sizes), ``budget_at`` (budget by context length) and ``to_dev`` (a host tensor
    to the device without a sync; the identity when ``static``: the graph runner copies)."""

    count: torch.Tensor
    ctx: torch.Tensor
    real: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor
    q_len: int
    decode: bool
    static: bool
    budget_at: Callable[[torch.Tensor], torch.Tensor]
    to_dev: Callable[[torch.Tensor], torch.Tensor]


class PolicyState:
    """The state and hooks of a policy for one call; this base is the dense policy's (nothing
    beside K/V). ``table``: budget by context length (CPU long, -1 = dense)."""

    def __init__(self, policy, pool: KVPool, *, q_heads: int, table: torch.Tensor) -> None:
        self.policy, self.pool = policy, pool

    # -- what the policy keeps beside K/V ------------------------------------------------------
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the state holds (for ``allocated_bytes``)."""
        return []

    def added_to(self) -> list[torch.Tensor]:
        """The buffers a step adds to (not overwrites): a graph's warm-up step restores them."""
        return []

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (device long) of every buffer (after the pool's)."""

    @property
    def static_pages(self) -> int:
        """Pages per row a paged kernel's selected-page table lists in a captured step (0: no
        selection table)."""
        return 0

    # -- once per forward -------------------------------------------------------------------
    def plan(self, inputs: PlanInputs) -> Any:
        """The policy's part of the step (a dataclass of tensors and host ints, or None)."""
        return None

    def derive(self, part: Any) -> None:
        """The part's device work, from its tensors (eager: right after `plan`; a captured step:
        inside the graph, from the static twin)."""

    def page_selection(self, part: Any) -> tuple[torch.Tensor | None, int]:
        """A paged single-token step's selected-page table: keep counts per row (CPU ``[B]``) and
        entries per row; ``(None, 0)``: no selection table."""
        return None, 0

    def needs_mask(self, decode: bool) -> bool:
        """Whether a forward of full rows needs the boolean mask tensor (a selection combines it
        with its page mask) instead of plain causal attention."""
        return False

    # -- per layer ----------------------------------------------------------------------------
    def written(self, layer: int, key: torch.Tensor, step) -> None:
        """After layer ``layer`` wrote its K/V (``key [B, H_kv, Q, D]``) at ``step.slots``."""

    def all_written(self, step) -> None:
        """After the last layer's write (work done once per step for every layer)."""

    def observe(self, layer: int, query: torch.Tensor, step) -> None:
        """Layer ``layer``'s queries ``[B, H_q, Q, D]`` (before it attends)."""

    def attend(self, cache, layer: int, query, key, value, scaling: float) -> torch.Tensor:
        """How layer ``layer`` attends: over every valid slot (`SparseKVCache.attend_dense`)."""
        return cache.attend_dense(layer, query, key, value, scaling)

    # -- compression ------------------------------------------------------------------------
    def event(self, *, counts: torch.Tensor, counts_host: torch.Tensor, budgets_host: torch.Tensor,
              most: int, top: int, ctx: torch.Tensor, forced: bool) -> Any:
        """Once per compression event, before any layer is scored: ``counts`` ``[B]`` (device) and
        ``counts_host`` valid slots per row (``most``: their maximum), ``budgets_host`` slots each
        row keeps (``top``: their maximum), ``ctx`` tokens fed per row (host), ``forced``: a
        replay of recorded kept sets (nothing is scored)."""
        return None

    def score_inputs(self, event: Any, keys: torch.Tensor, first: int, stop: int, s: int) -> dict:
        """What ``policy.score`` reads beside keys, validity and positions for layers
        ``first .. stop - 1`` stacked along the batch, layer-major (``keys [n·B, H_kv, s, D]``):
        at least ``queries`` ``[n·B, H_q, W, D]`` (none here), and optionally ``query_valid``
        ``[n·B, W]``, ``key_norms``, ``unit_sum`` (the keywords `compress` passes on). Only the
        state knows ``first`` and ``stop``; ``score`` is told no layer id (`KVPolicy.score`)."""
        n_b, h, _, d = keys.shape
        return {"queries": keys.new_zeros(n_b, h, 0, d)}

    def compacting(self, event: Any, valid: torch.Tensor, index: torch.Tensor, kept: torch.Tensor,
                   first: int) -> None:
        """Before the pool moves the kept slots of layers ``first ..`` to the front: ``valid``
        ``[n, B, H_kv, S]`` (before), ``index``, ``kept`` ``[n, B, H_kv, K]``."""

    def compacted(self, event: Any, index: torch.Tensor, kept: torch.Tensor, first: int) -> None:
        """After the pool's compaction of layers ``first .. first + n - 1``."""

    # -- host accounting --------------------------------------------------------------------
    def attended(self, after: torch.Tensor, *, ctx: torch.Tensor,
                 budget_at: Callable[[torch.Tensor], torch.Tensor], layers: int) -> torch.Tensor:
        """Mean slots each of the last fed queries read per layer and KV head (``after``
        ``[B, Q]``: the valid slots including the query's; ``ctx`` ``[B]`` tokens fed)."""
        return after.float()
