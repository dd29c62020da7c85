"""Fast bool-mask arithmetic shared by every layer (CPU kernels measured in bench_losses.py).

On the CPU, torch's kernels that read a ``bool`` tensor alongside a float one (``torch.where``
with a bool condition, ``mask.any(dim)``, comparisons that produce a bool) take the slow,
non-vectorised path, and a bool or ``uint8`` mask multiplied into a float tensor is first
converted in a hidden temporary the size of the float tensor (whose first write, page faults
included, costs more than the multiply). So: bool-with-bool and uint8-with-uint8 operations
(``and_rows``, ``row_any``, ``count_rows``: fast, no conversion), and float masks
kept in a buffer that is reused (``_checks.finite_in_scratch``) for the float multiplies on hot paths;
``zero_outside_`` and ``as_float`` for the rest.
"""

from __future__ import annotations

import torch

__all__ = ["and_rows", "as_float", "count_float", "count_rows", "float_into_", "row_any", "zero_outside_"]


def _u8(mask: torch.Tensor) -> torch.Tensor:
    return mask.view(torch.uint8)


def zero_outside_(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with every entry outside ``mask`` set to 0, in place. ``x`` must be finite (NaN
    times 0 is NaN: clean it with ``nan_to_num_`` first). Same as ``torch.where(mask, x, 0)``.
    The multiply converts the mask to ``x``'s dtype in a temporary: on a hot path, multiply by
    a float mask kept in a buffer instead (``_checks.finite_in_scratch``)."""
    return x.mul_(_u8(mask))


def as_float(mask: torch.Tensor) -> torch.Tensor:
    """The bool ``mask`` as a float32 0/1 tensor."""
    return _u8(mask).to(torch.float32)


def row_any(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rows of a ``[B, T]`` mask with a True entry (``mask.any(-1)``)."""
    if mask.shape[-1] == 0:
        return torch.zeros(mask.shape[:-1], dtype=torch.bool, device=mask.device)
    return _u8(mask).amax(dim=-1).bool()


def and_rows(mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``mask & rows[:, None]`` (``mask`` ``[B, T]``, ``rows`` ``[B]`` bool), a new tensor."""
    return torch.mul(_u8(mask), _u8(rows).reshape(-1, 1)).view(torch.bool)


def count_rows(mask: torch.Tensor) -> torch.Tensor:
    """0-d float32: rows of a ``[B, T]`` mask with a True entry (``mask.any(-1).sum()``; exact
    below 2^24 rows)."""
    if mask.shape[-1] == 0:
        return torch.zeros((), device=mask.device)
    return _u8(mask).amax(dim=-1).sum(dtype=torch.float32)  # [B]: tiny


def count_float(mask_f: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-d count of ``mask`` (bool) given the same mask as float 0/1 ``mask_f``: a float32 sum,
    3x faster than ``count_nonzero``, while the count fits a float32 integer (2^24 entries);
    above that ``count_nonzero(mask)`` (int64), exact."""
    return mask_f.sum() if mask_f.numel() <= 1 << 24 else torch.count_nonzero(mask)


def float_into_(buf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``buf`` (float, same shape) overwritten with the bool ``mask`` as 1.0 / 0.0 and returned:
    copied from the mask's ``uint8`` bytes (10x faster than the bool-to-float copy)."""
    return buf.copy_(_u8(mask))
