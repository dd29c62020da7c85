"""Bool-mask helpers shared by every layer (plain torch: the same code on every device)."""

from __future__ import annotations

import torch

__all__ = ["and_rows", "count_rows", "extremes", "masked_extremes", "row_any", "rows_count", "rows_total",
           "total"]


def total(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """0-d sum of every entry; of a ``[B, T]`` tensor as its row sums, then their sum.

    Every batch sum of the loss path goes through here: under ``torch.compile`` a row
    reduction fuses into the loop over rows that computes ``x``, even when that loop reads a
    ``[B]`` value it waits for (the veto's row test), so the sums of a stage cost no pass over
    ``[B, T]`` of their own; a flat sum of such an ``x`` is one more pass (inductor
    materialises ``x`` and reads it back). ``dtype`` is the accumulation dtype of both steps.
    """
    if x.dim() == 2:
        return x.sum(dim=-1, dtype=dtype).sum()
    return x.sum(dtype=dtype)


def extremes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d ``(min, max)`` of a non-empty tensor; of a ``[B, T]`` one per row first (as ``total``)."""
    if x.dim() == 2:
        return x.amin(dim=-1).amin(), x.amax(dim=-1).amax()
    return x.amin(), x.amax()


def masked_extremes(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d ``(min, max)`` of ``x`` over ``mask`` (``(+inf, -inf)`` when nothing is masked in;
    0 for an empty tensor). ``[B, T]`` -> ``[]``, ``[]``"""
    if x.numel() == 0:
        z = torch.zeros((), device=x.device)
        return z, z
    return extremes(torch.where(mask, x, float("inf")))[0], extremes(torch.where(mask, x, float("-inf")))[1]


def row_any(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rows of a ``[B, T]`` mask with a True entry (False for ``T = 0``)."""
    return mask.any(dim=-1)


def and_rows(mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``mask & rows[:, None]`` (``mask`` ``[B, T]``, ``rows`` ``[B]`` bool), a new tensor."""
    return mask & rows.reshape(-1, 1)


def count_rows(mask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """0-d float32: rows of a ``[B, T]`` mask with a True entry (among the ``[B]`` bool
    ``rows``, when given), from the int32 row counts that ``total`` makes of the same mask, so
    a compiled graph computes them once."""
    nonempty = mask.sum(dim=-1, dtype=torch.int32) > 0  # [B]
    return (nonempty if rows is None else nonempty & rows).sum(dtype=torch.float32)


def rows_count(mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    r"""0-d float32 \(\sum_i \text{rows}_i \sum_t \text{mask}_{i,t}\): the True entries of a
    ``[B, T]`` mask on the rows ``rows`` (``[B]`` bool) keeps, from its int32 row counts (the
    row test waits for no token pass: ``RowFactor``)."""
    return (mask.sum(dim=-1, dtype=torch.int32) * rows).sum(dtype=torch.int64).float()


def rows_total(x: torch.Tensor, rows: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    r"""0-d \(\sum_i \text{rows}_i \sum_t x_{i,t}\) of a ``[B, T]`` tensor on the rows ``rows``
    (``[B]`` bool) keeps."""
    return (x.sum(dim=-1, dtype=dtype) * rows).sum()
