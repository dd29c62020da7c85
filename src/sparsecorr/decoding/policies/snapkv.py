r"""``SnapKV(window=8, kernel=7, pooling="max")`` (Li et al., NeurIPS 2024).

The last ``window`` queries vote for the keys they attend to; votes are summed over the window,
averaged over the query heads of each KV group, and smoothed along the sequence with a 1-D
pooling of width ``kernel`` so neighbouring tokens survive together.

Reference: github.com/FasterDecoding/SnapKV, ``snapkv/monkeypatch/snapkv_utils.py``
``SnapKVCluster.update_kv``, commit ``e216ddc84c5bd210378cbdbbba12ba02102aa640``. As there, a
window query attends causally inside the observation window (the query of the window's
\(t\)-th key sees the window's keys up to its own), the softmax runs over every key, and only the
keys before the window are voted for and pooled: the pooling stops at the window's boundary
(its ``max`` padding, or the zeros an ``avg`` pooling counts, lie past the last scored key), so
the window's large self-votes do not spill into the last scored tokens. Deliberate differences:
float32 votes (SnapKV rounds them to the model's dtype: ties in bf16, nothing else); for GQA the
votes are averaged over the query heads of a KV group (SnapKV's code scores one KV head per
query head); padding is left out of the softmax; ties go to the more recent token; ``sink``
(0 by default) protects the first tokens.

**Budget**: a compression keeps ``budget`` slots; it runs once a row holds more than ``budget +
buffer``, so the step that triggers it attends ``budget + buffer + 1`` tokens.

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

from ..kernels import window_votes
from ..pool import take_rows
from .base import EvictionPolicy, KVPolicy, check_int, matmul_f32
from .state import PlanInputs, PolicyState

__all__ = ["RingState", "SnapKV", "before_window", "causal_votes", "check_window_policy", "pool_scores", "ring_order",
           "ring_slots"]


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


_HIDDEN = -1e30  # a future key's logit in the window (finite: a row of them gives no NaN)


def causal_votes(queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                 query_valid: torch.Tensor | None = None) -> torch.Tensor:
    r"""SnapKV's votes with its causal mask inside the observation window: the ``W`` window
    queries (oldest first) are the tokens of the row's last ``W`` valid keys, and query \(t\) sees
    the keys of rank \(\le n - W + 1 + t\) (\(n\) valid keys; all keys where that is below 1, a
    query older than every kept key). Softmax over the valid, visible keys; summed over the
    window (``query_valid``: the real queries), averaged over each KV group (`window_votes`).

    Shapes:
        queries ``[B, H_q, W, D]``; keys ``[B, H_kv, S, D]``; valid ``[B, H_kv, S]`` -> ``[B, H_kv, S]`` float32.
    """
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    logits = matmul_f32(queries.reshape(b, hkv, g * w, d), keys.transpose(-1, -2))  # [B, H, G·W, S]
    rank = valid.cumsum(-1)[:, :, None, :]  # [B, H, 1, S]
    own = rank[..., -1:] - w + 1 + torch.arange(w, device=keys.device)[:, None]  # [B, H, W, 1]: the query's key
    future = (rank > own) & (own >= 1)
    if query_valid is not None:
        future &= query_valid[:, None, :, None]
    logits.unflatten(2, (g, w)).masked_fill_(future[:, :, None], _HIDDEN)
    return window_votes(logits, valid, query_valid, group=g, scale=d**-0.5)


def before_window(valid: torch.Tensor, window: int) -> torch.Tensor:
    """The valid slots before the row's last ``window`` valid ones (what SnapKV and R-KV score).

    Shapes: ``[B, H, S]`` bool -> ``[B, H, S]`` bool."""
    rank = valid.cumsum(-1)
    return valid & (rank <= rank[..., -1:] - window)


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
    """Observation-window attention (causal inside the window), pooled over the keys before the
    window (see the module docstring). Eviction; scoring costs one W×S attention."""

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
        votes = causal_votes(queries, keys, valid, query_valid)
        # only the keys before the window are voted for: zeros elsewhere stop the pooling there
        votes = votes.masked_fill_(~before_window(valid, self.window), 0.0)
        return pool_scores(votes, kernel=self.kernel, pooling=self.pooling)
