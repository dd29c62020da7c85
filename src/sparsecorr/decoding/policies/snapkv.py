r"""``SnapKV(window=8, kernel=7, pooling="max")`` (Li et al., NeurIPS 2024).

The last ``window`` queries vote for the keys they attend to; votes are summed over the window,
averaged over the query heads of each KV group, and smoothed along the sequence with a 1-D
pooling of width ``kernel`` so neighbouring tokens survive together.

The engine keeps those queries in an **observation ring** (`RingState`, SnapKV's state, which
R-KV extends): every layer's last ``window`` queries, a copy, so no layer's prefill query tensor
stays alive. The query at position \(p\) lives in column \(p \bmod W\), so a step writes each
layer's queries with one scatter at columns planned once per step (`ring_slots`; a dump column
``W`` takes padding and queries older than the window), and the window is put in order (oldest
first, `ring_order`) only when a compression reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..pool import take_rows
from .base import EvictionPolicy, KVPolicy, check_int, group_scores
from .state import PlanInputs, PolicyState

__all__ = ["RingState", "SnapKV", "check_window_policy", "pool_scores", "ring_order", "ring_slots"]


def pool_scores(scores: torch.Tensor, *, kernel: int, pooling: str) -> torch.Tensor:
    """1-D ``max``/``avg`` pooling along the last axis, same length (odd ``kernel``)."""
    if kernel <= 1:
        return scores
    b, h, s = scores.shape
    x = scores.reshape(b * h, 1, s)
    # the pooling's own padding: -inf for max, zeros (counted in the mean) for avg
    if pooling == "max":
        y = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        y = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return y.reshape(b, h, s)


def check_window_policy(policy: KVPolicy) -> None:
    """The arguments every observation-window policy (SnapKV, R-KV) shares."""
    check_int("window", policy.window, minimum=1)
    check_int("sink", policy.sink, minimum=0)
    check_int("buffer", policy.buffer, minimum=0)
    if isinstance(policy.kernel, bool) or not isinstance(policy.kernel, int) or policy.kernel < 1 \
            or policy.kernel % 2 == 0:
        raise ValueError(f"kernel: expected an odd positive int, got {policy.kernel!r}")


def ring_slots(ctx: torch.Tensor, real: torch.Tensor, q_len: int, window: int) -> torch.Tensor:
    """Ring columns of a chunk's queries (host, once per step): token ``i`` of row ``b`` (position
    ``ctx_b + i``) goes to ``(ctx_b + i) mod W`` if it is one of the row's last ``W`` real tokens
    of the chunk, else to the dump column ``W`` (padding, or overwritten within the chunk).

    Shapes:
        ctx, real ``[B]`` (CPU long: tokens fed before the chunk, real tokens in it) -> ``[B, Q]``.
    """
    i = torch.arange(q_len)
    keep = (i < real[:, None]) & (i >= real[:, None] - window)
    return torch.where(keep, (ctx[:, None] + i) % window, window)


def ring_order(ctx: torch.Tensor, window: int, *, columns: torch.Tensor | None = None) -> torch.Tensor:
    """Ring columns in time order (oldest first) after ``ctx_b`` tokens: column
    ``(ctx_b + t) mod W`` holds the ``t``-th oldest of the last ``W`` positions
    (``ctx_b - W + t``; an unseen one while ``ctx_b < W``). ``columns``: ``arange(W)`` if the
    caller keeps one (made here otherwise).

    Shapes:
        ctx ``[B]`` (CPU long) -> ``[B, W]``.
    """
    columns = torch.arange(window) if columns is None else columns
    return (ctx[:, None] + columns) % window


@dataclass
class RingColumns:
    """The ring's part of a step: ``slots`` ``[B, Q]`` (device long, in ``[0, W]``), each query's
    ring column (`ring_slots`)."""

    slots: torch.Tensor


@dataclass(frozen=True)
class RingEvent:
    """What a compression reads of the ring: ``order`` ``[B, W]`` (device; None on a replay) and
    ``query_valid`` ``[B, W]`` (device; None when every row has seen a full window)."""

    order: torch.Tensor | None
    query_valid: torch.Tensor | None


class RingState(PolicyState):
    """The observation ring (see the module docstring): ``win_all`` ``[L, B, H_q, W + 1, D]`` in
    the model's dtype (``win[i]`` per layer), written in place, detached."""

    def __init__(self, policy, pool, *, q_heads: int, table: torch.Tensor) -> None:
        super().__init__(policy, pool, q_heads=q_heads, table=table)
        self.window = policy.window
        k = pool.k[0]
        b, _, _, d = k.shape
        self.win_all = torch.zeros(len(pool.k), b, q_heads, self.window + 1, d, dtype=k.dtype, device=k.device)
        self.win = list(self.win_all.unbind(0))
        self._columns = torch.arange(self.window)  # host: the ring's columns, for its order

    def buffers(self) -> list[torch.Tensor]:
        return [self.win_all]

    def added_to(self) -> list[torch.Tensor]:
        return [self.win_all]  # a warm-up step's query columns: the replay writes them again

    def select_rows(self, rows: torch.Tensor) -> None:
        self.win_all = take_rows(self.win_all, rows)
        self.win = list(self.win_all.unbind(0))

    def plan(self, inputs: PlanInputs) -> RingColumns:
        return RingColumns(slots=inputs.to_dev(ring_slots(inputs.ctx, inputs.real, inputs.q_len, self.window)))

    def observe(self, layer: int, query: torch.Tensor, step) -> None:
        """Write the layer's queries into the ring at the step's columns: one scatter, nothing
        shifted. Shapes: query ``[B, H_q, Q, D]``."""
        win, slots = self.win[layer], step.part.slots
        b, hq, _, d = win.shape
        win.scatter_(2, slots[:, None, :, None].expand(b, hq, slots.shape[1], d), query.detach().to(win.dtype))

    def windows_in_order(self, order: torch.Tensor, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """Layers ``first .. stop - 1``'s observation windows, oldest query first (one gather).

        Shapes:
            order ``[B, W]`` (device long) -> ``[n, B, H_q, W, D]``.
        """
        win = self.win_all[first:stop]
        n, b, hq, _, d = win.shape
        return win.gather(3, order[None, :, None, :, None].expand(n, b, hq, order.shape[1], d))

    def event(self, *, counts, counts_host, budgets_host, most, top, ctx, forced) -> RingEvent:
        w, dev = self.window, self.win_all.device
        qv = None
        if int(ctx.min()) < w:  # a row that has not seen a full window yet
            qv = (torch.arange(w) >= w - ctx.clamp(max=w)[:, None]).to(dev, non_blocking=True)
        # the ring's columns oldest first, only where the policy scores
        order = None if forced else ring_order(ctx, w, columns=self._columns).to(dev, non_blocking=True)
        return RingEvent(order=order, query_valid=qv)

    def score_inputs(self, event: RingEvent, keys: torch.Tensor, first: int, stop: int, s: int) -> dict:
        n = stop - first
        q = self.win_all[first:stop, ..., :self.window, :] if event.order is None \
            else self.windows_in_order(event.order, first, stop)
        out = {"queries": q.reshape(-1, *q.shape[2:])}
        if event.query_valid is not None:
            out["query_valid"] = event.query_valid.repeat(n, 1)
        return out


@dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    """Observation-window attention, pooled. Eviction; scoring costs one W×S attention."""

    name: ClassVar[str] = "snapkv"
    state_type: ClassVar[type[PolicyState]] = RingState
    window: int = 8
    kernel: int = 7
    pooling: str = "max"
    sink: int = 0
    buffer: int = 128

    def __post_init__(self) -> None:
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"pooling: expected 'max' or 'avg', got {self.pooling!r}")
        check_window_policy(self)

    def score(self, *, keys, queries, valid, positions, query_valid=None) -> torch.Tensor:
        # group_scores is exactly 0 at invalid slots of any row with a valid key
        imp = group_scores(queries, keys, valid, query_valid)
        return pool_scores(imp, kernel=self.kernel, pooling=self.pooling)
