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

from .._checks import check_float_tensor, check_mask

__all__ = ["binned_quantile", "masked_quantile"]


def _as_q(q: float | Sequence[float] | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, bool]:
    scalar = isinstance(q, (int, float))
    qt = torch.as_tensor([q] if scalar else q, dtype=torch.float64, device=device).reshape(-1)
    if qt.numel() == 0 or not torch.all((qt >= 0) & (qt <= 1)):
        raise ValueError(f"q: expected quantile level(s) in [0, 1], got {q!r}")
    return qt, scalar


def _interpolate(sorted_x: torch.Tensor, n: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Linear-interpolated quantiles of the first ``n`` entries of each sorted row.

    sorted_x ``[R, L]`` (valid values first, ascending), n ``[R]`` -> ``[R, Q]``.
    """
    h = q[None, :] * (n[:, None].double() - 1).clamp(min=0)  # [R, Q]
    lo = h.floor().long()
    hi = (lo + 1).clamp(max=(n[:, None] - 1).clamp(min=0))
    frac = (h - lo.double()).float()
    width = sorted_x.shape[1]
    x_lo = sorted_x.gather(1, lo.clamp(max=max(width - 1, 0)))
    x_hi = sorted_x.gather(1, hi.clamp(max=max(width - 1, 0)))
    # numpy's lerp form: exact at frac == 0 even when x_hi is inf
    out = torch.where(frac > 0, x_lo + frac * (x_hi - x_lo), x_lo)
    return torch.where(n[:, None] > 0, out, float("nan"))


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
        dim: ``None`` over all entries, or the dimension to reduce.

    Returns:
        float32; NaN where no entry is valid. A trailing ``[Q]`` axis when ``q`` is a sequence.

    Shapes:
        x, mask: ``[...]`` -> ``[]`` / ``[Q]`` (``dim=None``), else ``x.shape`` without ``dim``
        (plus ``[Q]``).
    """
    check_float_tensor("x", x)
    check_mask(mask, x)
    qt, scalar = _as_q(q, x.device)
    xf = x.float()
    valid = mask & torch.isfinite(xf)
    if dim is None:
        rows, vrows = xf.reshape(1, -1), valid.reshape(1, -1)
        out_shape: tuple[int, ...] = ()
    else:
        d = dim % x.dim()
        rows = xf.movedim(d, -1).reshape(-1, x.shape[d])
        vrows = valid.movedim(d, -1).reshape(-1, x.shape[d])
        out_shape = tuple(s for i, s in enumerate(x.shape) if i != d)
    filled = torch.where(vrows, rows, float("inf"))
    sorted_x = filled.sort(dim=1).values
    res = _interpolate(sorted_x, vrows.sum(1), qt).reshape(*out_shape, qt.numel())
    return res[..., 0] if scalar else res


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
        offset: ``[B]`` integer position of each row's first token (default 0).
        n_bins: number of bins to report (default: up to the last occupied bin; passing it
            avoids one host synchronisation). Tokens beyond the last bin are dropped.

    Returns:
        ``(values, counts)``: values ``[n_bins]`` (``[n_bins, Q]`` for a sequence of levels,
        NaN for empty bins) and token counts ``[n_bins]`` (int64).

    Shapes:
        x, mask: ``[B, T]``; offset: ``[B]``.
    """
    check_float_tensor("x", x, ndim=2)
    check_mask(mask, x)
    if not isinstance(bin_size, int) or bin_size < 1:
        raise ValueError(f"bin_size: expected a positive int, got {bin_size!r}")
    b, t = x.shape
    if offset is None:
        offset = torch.zeros(b, dtype=torch.long, device=x.device)
    if not isinstance(offset, torch.Tensor) or offset.shape != (b,) or offset.is_floating_point():
        got = tuple(offset.shape) if isinstance(offset, torch.Tensor) else type(offset).__name__
        raise ValueError(f"offset: expected an integer tensor of shape ({b},), got {got}")
    qt, scalar = _as_q(q, x.device)
    xf = x.float()
    valid = mask & torch.isfinite(xf)
    bins = (offset.long()[:, None] + torch.arange(t, device=x.device)[None, :]) // bin_size
    if n_bins is None:
        n_bins = int(bins[valid].max()) + 1 if bool(valid.any()) else 0
    valid = valid & (bins < n_bins)
    vals, bin_ids = xf[valid], bins[valid]
    counts = torch.bincount(bin_ids, minlength=n_bins)[:n_bins]
    order = vals.argsort()
    order = order[bin_ids[order].argsort(stable=True)]  # by bin, then by value
    sorted_vals = vals[order]
    starts = torch.cumsum(counts, 0) - counts
    h = qt[None, :] * (counts[:, None].double() - 1).clamp(min=0)
    lo = h.floor().long()
    hi = (lo + 1).clamp(max=(counts[:, None] - 1).clamp(min=0))
    frac = (h - lo.double()).float()
    last = max(sorted_vals.numel() - 1, 0)
    padded = sorted_vals if sorted_vals.numel() else torch.zeros(1, device=x.device)
    x_lo = padded[(starts[:, None] + lo).clamp(max=last)]
    x_hi = padded[(starts[:, None] + hi).clamp(max=last)]
    out = torch.where(frac > 0, x_lo + frac * (x_hi - x_lo), x_lo)
    out = torch.where(counts[:, None] > 0, out, float("nan"))
    return (out[:, 0] if scalar else out), counts
