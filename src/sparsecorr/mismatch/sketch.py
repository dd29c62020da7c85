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
quantile. Values outside ``[lo, hi]`` (however large, e.g. ``1e30``) are clamped into the end
buckets and counted in ``n_clamped``; masked-in entries that are NaN or ±inf are skipped and
counted in ``n_nonfinite``. The default 2,048 buckets on [0, 1] give
\(w/2 \approx 2.4 \times 10^{-4}\).

**Memory.** The counts are float64, ``n_buckets`` (× ``n_bins``) of them; a sketch is refused
above ``MAX_CELLS`` = 2^27 cells (1 GiB) before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import (
    check_float_tensor,
    check_int,
    check_int_tensor,
    check_levels,
    check_mask,
    check_number,
)
from .._dist import all_reduce_sum

__all__ = ["MAX_CELLS", "BinnedQuantileSketch", "QuantileSketch"]

#: largest number of float64 count cells a sketch may allocate (2^27 cells = 1 GiB)
MAX_CELLS = 2**27


def _check_cells(n_bins: int, n_buckets: int) -> None:
    """Refuse a sketch too large to allocate, before allocating it."""
    if n_bins * n_buckets > MAX_CELLS:
        raise ValueError(
            f"n_bins, n_buckets: expected n_bins * n_buckets <= {MAX_CELLS:,} float64 cells (1 GiB), "
            f"got {n_bins:,} * {n_buckets:,} = {n_bins * n_buckets:,} "
            f"({n_bins * n_buckets * 8 / 2**30:.1f} GiB)"
        )


def _scalar(v: object) -> object:
    """A one-element tensor or numpy value (from a checkpoint) as a Python number."""
    return v.item() if hasattr(v, "item") and getattr(v, "ndim", 0) == 0 else v


def _levels(q: float | Sequence[float], device: torch.device) -> tuple[torch.Tensor, bool]:
    levels = check_levels("q", q)
    scalar = not isinstance(q, (Sequence, torch.Tensor))
    return torch.tensor(levels, dtype=torch.float64, device=device), scalar


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
        >>> import torch
        >>> s = QuantileSketch(0.0, 1.0)
        >>> acceptance = torch.linspace(0.0, 1.0, 101)[None]
        >>> _ = s.update(acceptance, acceptance > 0.5)   # any number of times
        >>> _ = s.all_reduce(None)                       # a process group combines ranks
        >>> round(float(s.quantile(0.5)), 3)  # the values 0.51 ... 1.0: median 0.755
        0.755
    """

    def __init__(
        self, lo: float = 0.0, hi: float = 1.0, *, n_buckets: int = 2048,
        device: torch.device | str | None = None,
    ) -> None:
        check_number("lo", lo)
        check_number("hi", hi)
        if not (float(lo) < float(hi)):
            raise ValueError(f"lo, hi: expected lo < hi, got lo={lo!r}, hi={hi!r}")
        check_int("n_buckets", n_buckets, low=1)
        _check_cells(1, n_buckets)
        self.lo, self.hi, self.n_buckets = float(lo), float(hi), n_buckets
        self.counts = torch.zeros(n_buckets, dtype=torch.float64, device=device)
        self.n_clamped = torch.zeros((), dtype=torch.float64, device=device)
        self.n_nonfinite = torch.zeros((), dtype=torch.float64, device=device)

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
        # clamp in float64 *before* the integer cast: 1e30 would overflow int64 (to the bottom)
        idx = ((x.double() - self.lo) / self.width).floor().clamp(0, self.n_buckets - 1)
        return idx.long()

    def _valid(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Masked-in finite entries; masked-in non-finite ones are counted in ``n_nonfinite``."""
        fin = torch.isfinite(x)
        inside = torch.ones_like(fin) if mask is None else check_mask(mask, x)
        self.n_nonfinite += (inside & ~fin).sum().to(self.n_nonfinite)
        return inside & fin

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> QuantileSketch:
        """Add the valid (masked-in, finite) entries of ``x``; values outside ``[lo, hi]`` go to
        the end buckets (``n_clamped``), non-finite ones are skipped (``n_nonfinite``).

        Shapes: ``x``, ``mask``: any, equal (empty is fine: nothing is added).
        """
        check_float_tensor("x", x)
        v = x[self._valid(x, mask)]
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
        self.n_nonfinite += other.n_nonfinite.to(self.n_nonfinite)
        return self

    def all_reduce(self, group: object | None = None) -> QuantileSketch:
        """Sum counts over the ranks of ``group`` (in place; no-op without a process group)."""
        self.counts = all_reduce_sum(self.counts, group)
        self.n_clamped = all_reduce_sum(self.n_clamped, group)
        self.n_nonfinite = all_reduce_sum(self.n_nonfinite, group)
        return self

    def quantile(self, q: float | Sequence[float]) -> torch.Tensor:
        """Quantile(s) of everything added so far (NaN when empty); float32 ``[]`` or ``[Q]``."""
        qt, scalar = _levels(q, self.counts.device)
        out = _quantiles_from_counts(self.counts[None], self.lo, self.hi, qt)[0]
        return out[0] if scalar else out

    def reset(self) -> None:
        self.counts.zero_()
        self.n_clamped.zero_()
        self.n_nonfinite.zero_()

    def state_dict(self) -> dict:
        """Plain tensors and numbers (for checkpoints; safetensors/JSON friendly)."""
        return {"lo": self.lo, "hi": self.hi, "n_buckets": self.n_buckets,
                "counts": self.counts.clone(), "n_clamped": self.n_clamped.clone(),
                "n_nonfinite": self.n_nonfinite.clone()}

    def _load_counts(self, state: dict) -> None:
        """Counts from a state dict, checked (shape, finite, >= 0); errors name the field."""
        try:
            counts = torch.as_tensor(state["counts"], dtype=torch.float64)
            n_clamped = torch.as_tensor(state.get("n_clamped", 0.0), dtype=torch.float64)
            n_nonfinite = torch.as_tensor(state.get("n_nonfinite", 0.0), dtype=torch.float64)
        except KeyError as exc:
            raise ValueError(f"{exc.args[0]}: missing from the sketch state") from None
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"counts: expected numbers ({exc})") from None
        if counts.shape != self.counts.shape:
            raise ValueError(f"counts: expected shape {tuple(self.counts.shape)}, got {tuple(counts.shape)}")
        for name, t in (("counts", counts), ("n_clamped", n_clamped), ("n_nonfinite", n_nonfinite)):
            if t.numel() and (not bool(torch.isfinite(t).all()) or bool((t < 0).any())):
                raise ValueError(f"{name}: expected finite counts >= 0")
        self.counts = counts.clone().to(self.counts.device)
        self.n_clamped = n_clamped.reshape(()).clone()
        self.n_nonfinite = n_nonfinite.reshape(()).clone()

    @classmethod
    def from_state_dict(cls, state: dict) -> QuantileSketch:
        if not isinstance(state, dict):
            raise ValueError(f"state: expected a dict, got {type(state).__name__}")
        try:
            s = cls(_scalar(state["lo"]), _scalar(state["hi"]), n_buckets=_scalar(state["n_buckets"]))
        except KeyError as exc:
            raise ValueError(f"{exc.args[0]}: missing from the sketch state") from None
        s._load_counts(state)
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
        check_int("bin_size", bin_size, low=1)
        check_int("n_bins", n_bins, low=1)
        check_int("n_buckets", n_buckets, low=1)
        _check_cells(n_bins, n_buckets)  # before any allocation
        super().__init__(lo, hi, n_buckets=n_buckets, device=device)
        self.bin_size, self.n_bins = bin_size, n_bins
        self.counts = torch.zeros(n_bins, n_buckets, dtype=torch.float64, device=device)

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None,
               offset: torch.Tensor | None = None) -> BinnedQuantileSketch:
        """Add per-token values ``[B, T]`` at positions ``offset[b] + t``.

        ``offset`` is an integer tensor ``[B]`` of values >= 0 (a negative position is refused
        with a ``ValueError``, checked before anything is added). Empty inputs add nothing.
        """
        check_float_tensor("x", x, ndim=2)
        b, t = x.shape
        if offset is not None:
            check_int_tensor("offset", offset, shape=(b,), nonnegative=True)
        if mask is not None:
            check_mask(mask, x)
        valid = self._valid(x, mask)
        off = torch.zeros(b, dtype=torch.long, device=x.device) if offset is None else offset.long()
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
        """Quantile(s) per bin (NaN for an empty bin): ``[n_bins]`` or ``[n_bins, Q]``."""
        qt, scalar = _levels(q, self.counts.device)
        out = _quantiles_from_counts(self.counts, self.lo, self.hi, qt)
        return out[:, 0] if scalar else out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "bin_size": self.bin_size, "n_bins": self.n_bins}

    @classmethod
    def from_state_dict(cls, state: dict) -> BinnedQuantileSketch:
        if not isinstance(state, dict):
            raise ValueError(f"state: expected a dict, got {type(state).__name__}")
        try:
            s = cls(_scalar(state["lo"]), _scalar(state["hi"]), bin_size=_scalar(state["bin_size"]),
                    n_bins=_scalar(state["n_bins"]), n_buckets=_scalar(state["n_buckets"]))
        except KeyError as exc:
            raise ValueError(f"{exc.args[0]}: missing from the sketch state") from None
        s._load_counts(state)
        return s
