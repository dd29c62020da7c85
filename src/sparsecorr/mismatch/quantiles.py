r"""Exact quantiles of masked tensors, globally, per row, or per position bin.

All quantiles use numpy's default ("linear") definition: for \(n\) valid values sorted as
\(x_{(0)} \le \dots \le x_{(n-1)}\), the \(q\)-quantile is
\(x_{(k)} + (h - k)(x_{(k+1)} - x_{(k)})\) with \(h = q (n - 1)\), \(k = \lfloor h \rfloor\).
Unlike ``torch.quantile`` there is no size limit (it refuses inputs over 16M elements), masked
and non-finite entries are ignored, and nothing synchronises with the host.

Sparrow (Zhou et al., 2026, arXiv 2606.08446) groups tokens into bins of *total* context
length (prompt + generated, 2,000 tokens per bin) and tracks the 5th percentile of the
per-token acceptance rate per bin: [`binned_quantile`][sparsecorr.mismatch.binned_quantile].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import (
    check_dim,
    check_float_tensor,
    check_int,
    check_int_tensor,
    check_levels,
    check_mask,
)

__all__ = ["binned_quantile", "masked_quantile"]


def _as_q(q: float | Sequence[float] | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, bool]:
    levels = check_levels("q", q)
    scalar = not isinstance(q, (Sequence, torch.Tensor))
    return torch.tensor(levels, dtype=torch.float64, device=device), scalar


def _interpolate(sorted_x: torch.Tensor, n: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Linear-interpolated quantiles of the first ``n`` entries of each sorted row.

    Every level's two neighbours are read in one gather; their positions are at most
    ``max(n - 1, 0)``, inside the row (``n <= L``, ``L >= 1``).

    sorted_x ``[R, L]`` (valid values first, ascending), n ``[R]`` -> ``[R, Q]``.
    """
    last = (n - 1).clamp(min=0)[:, None]  # [R, 1] int64
    h = last * q  # [R, Q] float64
    lo = h.floor()
    frac = (h - lo).float()
    lo = lo.long()
    x_lo, x_hi = sorted_x.gather(1, torch.cat([lo, torch.minimum(lo + 1, last)], dim=1)).chunk(2, dim=1)
    # numpy's lerp form: exact at frac == 0
    out = torch.where(frac > 0, x_lo + frac * (x_hi - x_lo), x_lo)
    return out.masked_fill_((n == 0)[:, None], float("nan"))


def masked_quantile(
    x: torch.Tensor,
    mask: torch.Tensor,
    q: float | Sequence[float] | torch.Tensor,
    *,
    dim: int | None = None,
) -> torch.Tensor:
    """Exact quantile(s) of the valid (masked-in, finite) entries of ``x``.

    Args:
        x: values.
        mask: bool, True = the entry counts.
        q: a level in [0, 1] or a sequence of levels.
        dim: ``None`` over all entries, or the dimension to reduce (in ``[-x.dim(), x.dim())``;
            an out-of-range dim is refused).

    Returns:
        float32; NaN where no entry is valid (all masked, all non-finite, or an empty input).
        A trailing ``[Q]`` axis when ``q`` is a sequence.

    Shapes:
        x, mask: ``[...]`` -> ``[]`` / ``[Q]`` (``dim=None``), else ``x.shape`` without ``dim``
        (plus ``[Q]``).
    """
    check_float_tensor("x", x)
    check_mask(mask, x)
    d = check_dim("dim", dim, max(x.dim(), 1), allow_none=True)
    qt, scalar = _as_q(q, x.device)
    if d is not None and x.dim() == 0:
        d = None  # a 0-d input reduces to itself
    xf = x.float()
    valid = mask & torch.isfinite(xf)
    out_shape: tuple[int, ...] = () if dim is None else tuple(s for i, s in enumerate(x.shape) if i != d)
    if x.numel() == 0:  # nothing to reduce (a static shape): NaN for every output position
        res = torch.full((*out_shape, qt.numel()), float("nan"), device=x.device)
        return res[..., 0] if scalar else res
    if dim is None:
        rows, vrows = xf.reshape(1, -1), valid.reshape(1, -1)
    else:
        rows = xf.movedim(d, -1).reshape(-1, x.shape[d])
        vrows = valid.movedim(d, -1).reshape(-1, x.shape[d])
    filled = torch.where(vrows, rows, float("inf"))
    sorted_x = filled.sort(dim=1).values
    res = _interpolate(sorted_x, vrows.sum(1), qt).reshape(*out_shape, qt.numel())
    return res[..., 0] if scalar else res


def _scatter_by_bin(
    x: torch.Tensor, valid: torch.Tensor, bins: torch.Tensor, n_bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values regrouped as ``[n_bins, max_count]`` (+inf padding) and counts ``[n_bins]``.

    Within a row, positions grow with t, so each (row, bin) is a contiguous run of t and a
    token's slot in its bin is: tokens of earlier rows in that bin + its rank in the run.
    """
    b = x.shape[0]
    idx_dtype = torch.int32 if x.numel() < 2**31 - 1 else torch.long  # halves memory traffic
    vi = valid.to(idx_dtype)
    bins = bins.to(torch.long)
    rowbin = torch.zeros(b, n_bins + 1, dtype=idx_dtype, device=x.device)
    rowbin.scatter_add_(1, torch.where(valid, bins, n_bins), vi)
    rowbin = rowbin[:, :n_bins]  # [B, n_bins] valid tokens of row b in bin k
    counts = rowbin.sum(0)
    before_rows = rowbin.cumsum(0) - rowbin  # same bin, earlier rows
    before_bins = rowbin.cumsum(1) - rowbin  # same row, earlier bins
    cb = bins.clamp(max=max(n_bins - 1, 0))
    rank = vi.cumsum(1) - 1 - before_bins.gather(1, cb)  # rank within the (row, bin) run
    slot = before_rows.gather(1, cb) + rank
    width = max(int(counts.max()), 1)
    # one scatter of every element; invalid ones land in a dump slot that is cut off
    flat = torch.where(valid, cb * width + slot.long(), n_bins * width)
    padded = torch.full((n_bins * width + 1,), float("inf"), device=x.device)
    padded.scatter_(0, flat.reshape(-1), x.reshape(-1))
    padded = padded[:-1].reshape(n_bins, width)
    return padded, counts.long()


def _padded_quantiles(padded: torch.Tensor, counts: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Linear-interpolated quantiles ``[n_bins, Q]`` of +inf-padded rows, by partial selection.

    Levels at or below the median read the smallest ``k`` entries of each row (``topk``, no full
    sort); levels above read the largest, mirrored; a full sort is used only when ``k`` would
    exceed half the row.
    """
    n = counts.double()[:, None]
    h = q[None, :] * (n - 1).clamp(min=0)
    lo = h.floor().long()
    hi = (lo + 1).clamp(max=(counts[:, None] - 1).clamp(min=0))
    frac = (h - lo.double()).float()
    width = padded.shape[1]
    need = int(hi.max()) + 1 if hi.numel() else 1
    if need <= width // 2:
        head = padded.topk(need, dim=1, largest=False, sorted=True).values
    else:
        head = padded.sort(dim=1).values
    x_lo = head.gather(1, lo.clamp(max=head.shape[1] - 1))
    x_hi = head.gather(1, hi.clamp(max=head.shape[1] - 1))
    out = torch.where(frac > 0, x_lo + frac * (x_hi - x_lo), x_lo)
    return torch.where(counts[:, None] > 0, out, float("nan"))


def binned_quantile(
    x: torch.Tensor,
    mask: torch.Tensor,
    q: float | Sequence[float] | torch.Tensor,
    *,
    bin_size: int = 2000,
    offset: torch.Tensor | None = None,
    n_bins: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact quantile(s) of ``x`` per bin of absolute position, in one sort.

    Token ``t`` of sequence ``b`` sits at position ``offset[b] + t`` (``offset`` = prompt
    lengths, so bins are over total context length as in Sparrow) and falls in bin
    ``position // bin_size``.

    Args:
        x: per-token values (e.g. acceptance rates).
        mask: bool, True = the token counts.
        q: a level or a sequence of levels (Sparrow: 0.05).
        bin_size: tokens per bin (Sparrow: 2,000).
        offset: ``[B]`` integer position of each row's first token, >= 0 (default 0).
        n_bins: number of bins to report, an int >= 0 (default: up to the last occupied bin;
            passing it avoids one host synchronisation). Tokens beyond the last bin are dropped.

    Returns:
        ``(values, counts)``: values ``[n_bins]`` (``[n_bins, Q]`` for a sequence of levels,
        NaN for empty bins) and token counts ``[n_bins]`` (int64). An empty input (B = 0 or
        T = 0) or an all-masked one gives NaN values with zero counts for the ``n_bins`` asked
        for (no bins when ``n_bins`` is None).

    Shapes:
        x, mask: ``[B, T]``; offset: ``[B]``.
    """
    check_float_tensor("x", x, ndim=2)
    check_mask(mask, x)
    check_int("bin_size", bin_size, low=1)
    check_int("n_bins", n_bins, low=0, allow_none=True)
    b, t = x.shape
    if offset is None:
        offset = torch.zeros(b, dtype=torch.long, device=x.device)
    check_int_tensor("offset", offset, shape=(b,), nonnegative=True)
    qt, scalar = _as_q(q, x.device)
    xf = x.float()
    valid = mask & torch.isfinite(xf)
    max_off = int(offset.max()) if b else 0
    pos_dtype = torch.int32 if max_off + t < 2**31 - 1 else torch.long
    pos = offset.to(pos_dtype)[:, None] + torch.arange(t, device=x.device, dtype=pos_dtype)[None, :]
    bins = torch.div(pos, bin_size, rounding_mode="floor")
    if n_bins is None:
        n_bins = int(bins[valid].max()) + 1 if bool(valid.any()) else 0
    if n_bins == 0:
        empty = torch.empty(0, dtype=torch.float32, device=x.device)
        return (empty if scalar else empty.reshape(0, qt.numel())), empty.long()
    valid = valid & (bins < n_bins)
    padded, counts = _scatter_by_bin(xf, valid, bins, n_bins)
    out = _padded_quantiles(padded, counts, qt)
    return (out[:, 0] if scalar else out), counts
