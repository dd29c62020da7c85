r"""Streaming, mergeable quantile sketches for values in a known range.

Per-token acceptance lies in [0, 1] and log-ratios are clamped to ±20, so a fixed-bucket
histogram over the known range is exact in rank and mergeable by addition: sketches from many
steps, micro-batches or ranks combine by summing counts (`QuantileSketch.merge`,
`QuantileSketch.all_reduce`), in constant memory.

**Error bound.** With \(n_b\) buckets of width \(w = (hi - lo) / n_b\), let
\(x_{(k)} \le x_{(k+1)}\) be the two order statistics that the exact (numpy "linear")
\(q\)-quantile interpolates between, \(k = \lfloor q(n - 1) \rfloor\). The sketch answers with
the same interpolation between the *centres* of the buckets holding \(x_{(k)}\) and
\(x_{(k+1)}\), so its answer lies in \([x_{(k)} - w/2,\; x_{(k+1)} + w/2]\); when both order
statistics share a bucket (the common case for large \(n\)), it is within \(w/2\) of the exact
quantile. Values outside ``[lo, hi]`` are clamped into the end buckets (counted in
``n_clamped``). The default 2,048 buckets on [0, 1] give \(w/2 \approx 2.4 \times 10^{-4}\).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import check_float_tensor, check_mask
from .._dist import all_reduce_sum

__all__ = ["BinnedQuantileSketch", "QuantileSketch"]


def _quantiles_from_counts(
    counts: torch.Tensor, lo: float, hi: float, q: torch.Tensor
) -> torch.Tensor:
    """counts ``[R, n_buckets]`` (float64) -> linear-interpolated quantiles ``[R, Q]``."""
    n_b = counts.shape[-1]
    width = (hi - lo) / n_b
    centres = lo + (torch.arange(n_b, dtype=torch.float64, device=counts.device) + 0.5) * width
    n = counts.sum(-1)  # [R]
    cum = counts.cumsum(-1)  # [R, n_b]
    h = q[None, :] * (n[:, None] - 1).clamp(min=0)
    k = h.floor()
    frac = h - k
    # bucket holding the k-th (0-based) smallest value: first bucket with cum > k
    b_lo = torch.searchsorted(cum.contiguous(), k.contiguous(), right=True).clamp(max=n_b - 1)
    b_hi = torch.searchsorted(cum.contiguous(), (k + 1).clamp(max=(n[:, None] - 1).clamp(min=0))
                              .contiguous(), right=True).clamp(max=n_b - 1)
    out = centres[b_lo] + frac * (centres[b_hi] - centres[b_lo])
    return torch.where(n[:, None] > 0, out, float("nan")).float()


class QuantileSketch:
    """Fixed-bucket histogram sketch over ``[lo, hi]`` (error bound in the module docstring).

    Args:
        lo: lower end of the value range (acceptance: 0; clamped log-ratios: -20).
        hi: upper end of the value range (acceptance: 1; clamped log-ratios: 20).
        n_buckets: resolution; the error bound is half a bucket width.
        device: where the counts live.

    Example:
        >>> s = QuantileSketch(0.0, 1.0)
        >>> s.update(acceptance, mask)           # any number of times
        >>> s.all_reduce(group)                  # optional: combine ranks
        >>> s.quantile(0.05)
    """

    def __init__(
        self, lo: float = 0.0, hi: float = 1.0, *, n_buckets: int = 2048,
        device: torch.device | str | None = None,
    ) -> None:
        if not (float(lo) < float(hi)):
            raise ValueError(f"lo, hi: expected lo < hi, got lo={lo!r}, hi={hi!r}")
        if not isinstance(n_buckets, int) or n_buckets < 1:
            raise ValueError(f"n_buckets: expected a positive int, got {n_buckets!r}")
        self.lo, self.hi, self.n_buckets = float(lo), float(hi), n_buckets
        self.counts = torch.zeros(n_buckets, dtype=torch.float64, device=device)
        self.n_clamped = torch.zeros((), dtype=torch.float64, device=device)

    @property
    def width(self) -> float:
        return (self.hi - self.lo) / self.n_buckets

    @property
    def error_bound(self) -> float:
        """Half a bucket width (see the module docstring)."""
        return self.width / 2

    @property
    def count(self) -> torch.Tensor:
        return self.counts.sum()

    def _bucket(self, x: torch.Tensor) -> torch.Tensor:
        idx = ((x.double() - self.lo) / self.width).floor().long()
        return idx.clamp(0, self.n_buckets - 1)

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> QuantileSketch:
        """Add the valid (masked-in, finite) entries of ``x``. Shapes: ``x``, ``mask``: any, equal."""
        check_float_tensor("x", x)
        valid = torch.isfinite(x) if mask is None else check_mask(mask, x) & torch.isfinite(x)
        v = x[valid]
        self.n_clamped += ((v < self.lo) | (v > self.hi)).sum()
        self.counts += torch.bincount(self._bucket(v), minlength=self.n_buckets).to(self.counts)
        return self

    def _check_compatible(self, other: QuantileSketch) -> None:
        if not isinstance(other, QuantileSketch) or (other.lo, other.hi, other.n_buckets) != (
            self.lo, self.hi, self.n_buckets
        ):
            raise ValueError(
                f"other: expected a QuantileSketch with lo={self.lo}, hi={self.hi}, "
                f"n_buckets={self.n_buckets}, got {other!r}"
            )

    def merge(self, other: QuantileSketch) -> QuantileSketch:
        """Add another sketch's counts (same range and buckets) into this one."""
        self._check_compatible(other)
        self.counts += other.counts.to(self.counts)
        self.n_clamped += other.n_clamped.to(self.n_clamped)
        return self

    def all_reduce(self, group: object | None = None) -> QuantileSketch:
        """Sum counts over the ranks of ``group`` (in place; no-op without a process group)."""
        self.counts = all_reduce_sum(self.counts, group)
        self.n_clamped = all_reduce_sum(self.n_clamped, group)
        return self

    def quantile(self, q: float | Sequence[float]) -> torch.Tensor:
        """Quantile(s) of everything added so far (NaN when empty); float32 ``[]`` or ``[Q]``."""
        scalar = isinstance(q, (int, float))
        qt = torch.as_tensor([q] if scalar else q, dtype=torch.float64, device=self.counts.device)
        if not torch.all((qt >= 0) & (qt <= 1)):
            raise ValueError(f"q: expected level(s) in [0, 1], got {q!r}")
        out = _quantiles_from_counts(self.counts[None], self.lo, self.hi, qt)[0]
        return out[0] if scalar else out

    def reset(self) -> None:
        self.counts.zero_()
        self.n_clamped.zero_()

    def state_dict(self) -> dict:
        """Plain tensors and numbers (for checkpoints; safetensors/JSON friendly)."""
        return {"lo": self.lo, "hi": self.hi, "n_buckets": self.n_buckets,
                "counts": self.counts.clone(), "n_clamped": self.n_clamped.clone()}

    @classmethod
    def from_state_dict(cls, state: dict) -> QuantileSketch:
        s = cls(state["lo"], state["hi"], n_buckets=int(state["n_buckets"]))
        counts = torch.as_tensor(state["counts"], dtype=torch.float64)
        if counts.shape != (s.n_buckets,):
            raise ValueError(f"counts: expected shape ({s.n_buckets},), got {tuple(counts.shape)}")
        s.counts, s.n_clamped = counts.clone(), torch.as_tensor(state["n_clamped"], dtype=torch.float64)
        return s

    def __repr__(self) -> str:
        return (f"QuantileSketch(lo={self.lo}, hi={self.hi}, n_buckets={self.n_buckets}, "
                f"count={float(self.count):.0f})")


class BinnedQuantileSketch(QuantileSketch):
    """One `QuantileSketch` per bin of absolute position (Sparrow's position profile).

    Token ``t`` of sequence ``b`` falls in bin ``(offset[b] + t) // bin_size``; tokens beyond
    ``n_bins`` go to the last bin.

    Shapes:
        update(x ``[B, T]``, mask ``[B, T]``, offset ``[B]``); quantile -> ``[n_bins]`` / ``[n_bins, Q]``.
    """

    def __init__(
        self, lo: float = 0.0, hi: float = 1.0, *, bin_size: int = 2000, n_bins: int = 32,
        n_buckets: int = 1024, device: torch.device | str | None = None,
    ) -> None:
        super().__init__(lo, hi, n_buckets=n_buckets, device=device)
        if not isinstance(bin_size, int) or bin_size < 1 or not isinstance(n_bins, int) or n_bins < 1:
            raise ValueError(f"bin_size, n_bins: expected positive ints, got {bin_size!r}, {n_bins!r}")
        self.bin_size, self.n_bins = bin_size, n_bins
        self.counts = torch.zeros(n_bins, n_buckets, dtype=torch.float64, device=device)

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None,
               offset: torch.Tensor | None = None) -> BinnedQuantileSketch:
        check_float_tensor("x", x, ndim=2)
        valid = torch.isfinite(x) if mask is None else check_mask(mask, x) & torch.isfinite(x)
        b, t = x.shape
        off = torch.zeros(b, dtype=torch.long, device=x.device) if offset is None else offset.long()
        if off.shape != (b,):
            raise ValueError(f"offset: expected shape ({b},), got {tuple(off.shape)}")
        bins = ((off[:, None] + torch.arange(t, device=x.device)) // self.bin_size).clamp(
            max=self.n_bins - 1)
        v = x[valid]
        self.n_clamped += ((v < self.lo) | (v > self.hi)).sum()
        flat = bins[valid] * self.n_buckets + self._bucket(v)
        self.counts += torch.bincount(flat, minlength=self.n_bins * self.n_buckets).reshape(
            self.n_bins, self.n_buckets).to(self.counts)
        return self

    def _check_compatible(self, other: QuantileSketch) -> None:
        super()._check_compatible(other)
        if not isinstance(other, BinnedQuantileSketch) or (other.bin_size, other.n_bins) != (
            self.bin_size, self.n_bins
        ):
            raise ValueError(f"other: expected bin_size={self.bin_size}, n_bins={self.n_bins}")

    @property
    def bin_counts(self) -> torch.Tensor:
        """Tokens per position bin ``[n_bins]``."""
        return self.counts.sum(-1)

    def quantile(self, q: float | Sequence[float]) -> torch.Tensor:
        scalar = isinstance(q, (int, float))
        qt = torch.as_tensor([q] if scalar else q, dtype=torch.float64, device=self.counts.device)
        if not torch.all((qt >= 0) & (qt <= 1)):
            raise ValueError(f"q: expected level(s) in [0, 1], got {q!r}")
        out = _quantiles_from_counts(self.counts, self.lo, self.hi, qt)
        return out[:, 0] if scalar else out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "bin_size": self.bin_size, "n_bins": self.n_bins}

    @classmethod
    def from_state_dict(cls, state: dict) -> BinnedQuantileSketch:
        s = cls(state["lo"], state["hi"], bin_size=int(state["bin_size"]),
                n_bins=int(state["n_bins"]), n_buckets=int(state["n_buckets"]))
        counts = torch.as_tensor(state["counts"], dtype=torch.float64)
        if counts.shape != s.counts.shape:
            raise ValueError(f"counts: expected shape {tuple(s.counts.shape)}, got {tuple(counts.shape)}")
        s.counts, s.n_clamped = counts.clone(), torch.as_tensor(state["n_clamped"], dtype=torch.float64)
        return s
