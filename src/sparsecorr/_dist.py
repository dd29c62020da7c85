"""Small ``torch.distributed`` helpers: every reduction takes an optional process group.

With ``group=None`` and no initialised process group, every helper is the identity, so the
single-process path has no dependency on ``torch.distributed``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_varlen", "all_reduce_max", "all_reduce_min", "all_reduce_sum", "is_distributed", "world_size"]


def is_distributed(group: object | None) -> bool:
    """True when ``group`` was given and torch.distributed is initialised."""
    return group is not None and dist.is_available() and dist.is_initialized()


def world_size(group: object | None) -> int:
    return dist.get_world_size(group) if is_distributed(group) else 1


def _reduce(x: torch.Tensor, op: object, group: object | None) -> torch.Tensor:
    if not is_distributed(group):
        return x
    y = x.clone()
    dist.all_reduce(y, op=op, group=group)
    return y


def all_reduce_sum(x: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group`` (``x`` itself without a group)."""
    return _reduce(x, dist.ReduceOp.SUM, group)


def all_reduce_max(x: torch.Tensor, group: object | None = None) -> torch.Tensor:
    return _reduce(x, dist.ReduceOp.MAX, group)


def all_reduce_min(x: torch.Tensor, group: object | None = None) -> torch.Tensor:
    return _reduce(x, dist.ReduceOp.MIN, group)


def all_gather_varlen(x: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Concatenate 1-D tensors of different lengths from every rank (rank order)."""
    if not is_distributed(group):
        return x
    n = world_size(group)
    size = torch.tensor([x.numel()], device=x.device, dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    lens = [int(s.item()) for s in sizes]
    cap = max(lens)
    padded = torch.zeros(cap, dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x.reshape(-1)
    out = [torch.zeros_like(padded) for _ in range(n)]
    dist.all_gather(out, padded, group=group)
    return torch.cat([o[:k] for o, k in zip(out, lens)])
