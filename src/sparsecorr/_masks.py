"""Bool-mask helpers shared by every layer (plain torch: the same code on every device)."""

from __future__ import annotations

import torch

__all__ = ["and_rows", "count_rows", "row_any"]


def row_any(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rows of a ``[B, T]`` mask with a True entry (False for ``T = 0``)."""
    return mask.any(dim=-1)


def and_rows(mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``mask & rows[:, None]`` (``mask`` ``[B, T]``, ``rows`` ``[B]`` bool), a new tensor."""
    return mask & rows.reshape(-1, 1)


def count_rows(mask: torch.Tensor) -> torch.Tensor:
    """0-d float32: rows of a ``[B, T]`` mask with a True entry."""
    return mask.any(dim=-1).sum(dtype=torch.float32)
