r"""What every KV policy shares: the interface, protection of sinks and the recent window, top-k.

A policy only *scores* (eviction) or *selects* (selection); this module turns scores into a
kept set. Eviction policies (StreamingLLM, SnapKV, R-KV) drop KV for good: the engine calls
[`compress`][sparsecorr.decoding.policies.compress] when a row's cache exceeds
``budget + buffer`` and keeps the ``budget`` best-scored tokens, always including the first
``sink`` tokens and the most recent ``window`` tokens. Selection policies (BlockTopK) keep the
whole cache and restrict which part of it each decode step attends to.

Shapes (per layer): keys ``[B, H_kv, S, D]`` (post-RoPE), queries ``[B, H_q, W, D]`` (the last
W queries, post-RoPE, ``H_q = H_kv · G``), valid ``[B, H_kv, S]`` bool, positions
``[B, H_kv, S]`` (true absolute positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

__all__ = ["KVPolicy", "KeepSet", "check_int", "compress", "group_scores"]

Kind = Literal["dense", "eviction", "selection"]


def check_int(name: str, value: object, *, minimum: int) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class KVPolicy:
    """Base of every policy (frozen dataclasses). Eviction policies define ``sink``, ``window``
    and ``buffer`` fields and `score`; selection policies define ``attend_mask``."""

    name: ClassVar[str] = "base"
    kind: ClassVar[Kind] = "dense"

    @property
    def evicts(self) -> bool:
        return self.kind == "eviction"

    def score(self, *, keys: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor,
              positions: torch.Tensor, query_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Per-slot scores ``[B, H_kv, S]`` (higher = keep). ``query_valid [B, W]`` marks which
        observation-window queries are real (None = all; a row that has seen fewer than W tokens
        has fewer)."""
        raise NotImplementedError(f"{type(self).__name__} does not score tokens")


@dataclass(frozen=True)
class KeepSet:
    """Kept slots per (sequence, KV head), sorted by position.

    Shapes:
        index: ``[B, H_kv, K]`` long; valid: ``[B, H_kv, K]`` bool.
    """

    index: torch.Tensor
    valid: torch.Tensor


def group_scores(queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                 query_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the observation-window queries to the keys, summed over the window and
    averaged over the query heads of each KV group: ``[B, H_kv, S]`` (SnapKV's importance).

    Softmax over valid keys only, in float32; window queries with ``query_valid`` False
    (``[B, W]``) do not vote.
    """
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    q = queries.float().reshape(b, hkv, g, w, d)
    logits = torch.einsum("bhgwd,bhsd->bhgws", q, keys.float()) * d**-0.5
    logits = logits.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if query_valid is not None:
        probs = probs * query_valid[:, None, None, :, None].to(probs.dtype)
    return probs.sum(dim=3).mean(dim=2)


def _protected(policy: KVPolicy, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Slots that must be kept: the first ``sink`` and the last ``window`` valid positions."""
    sink, recent = getattr(policy, "sink", 0), getattr(policy, "window", 0)
    big = torch.iinfo(torch.long).max
    pos = torch.where(valid, positions, big)
    # rank of each valid slot by position, from the start and from the end
    order = pos.argsort(dim=-1)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(pos.shape[-1], device=pos.device).expand_as(order))
    n = valid.sum(-1, keepdim=True)
    return valid & ((rank < sink) | (rank >= n - recent))


def compress(policy: KVPolicy, *, keys: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor,
             positions: torch.Tensor, budget: int | torch.Tensor,
             query_valid: torch.Tensor | None = None, max_budget: int | None = None) -> KeepSet:
    """Keep the ``budget`` best-scored valid slots of every (sequence, KV head).

    Sinks and the recent window always survive; invalid slots never do; equal scores are
    broken in favour of the more recent position. The budget is a hard cap: if it is smaller
    than ``sink + window``, the most recent protected tokens are the ones kept. ``budget`` may be a
    ``[B]`` tensor (one budget per sequence, e.g. from a schedule). ``query_valid`` (``[B, W]``)
    marks the real observation-window queries; it is passed to ``policy.score`` only when given.
    ``max_budget`` (the host-known maximum of ``budget``) lets a caller pass ``budget`` already on
    the device without a sync (the engine moves its budgets once per compression, not per layer).

    Returns:
        `KeepSet` with ``K = max budget`` columns, sorted by position.
    """
    b, _, s = valid.shape
    budgets = torch.as_tensor(budget).reshape(-1).long()
    top_budget = int(budgets.max()) if max_budget is None else max_budget  # no sync: host or given
    k = int(min(top_budget, s))
    budgets = budgets.to(valid.device, non_blocking=True).expand(b)
    extra = {} if query_valid is None else {"query_valid": query_valid}
    scores = policy.score(keys=keys, queries=queries, valid=valid, positions=positions, **extra).double()
    # ties (frequent after max pooling) go to the more recent token, by true position, so the
    # kept set does not depend on where a row's tokens sit in the slot axis (padding, batching)
    scores = scores + positions.double() * 1e-12
    # protected slots outrank every score, and among themselves the most recent wins
    # (1e15 + position is exact in float64; regular scores are far below it)
    scores = torch.where(_protected(policy, valid, positions), 1e15 + positions.double(), scores)
    scores = scores.masked_fill(~valid, -torch.inf)
    top = scores.topk(k, dim=-1).indices  # [B, H, K]
    rank = torch.arange(k, device=valid.device)
    kept = valid.gather(-1, top) & (rank[None, None, :] < budgets[:, None, None])
    # sort by position; dropped entries go last
    big = torch.iinfo(torch.long).max
    pos = torch.where(kept, positions.gather(-1, top), big)
    order = pos.argsort(dim=-1)
    return KeepSet(index=top.gather(-1, order), valid=kept.gather(-1, order))
