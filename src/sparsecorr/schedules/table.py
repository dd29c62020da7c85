"""``CalibrationTable``: the tail statistic of acceptance per candidate budget × length bin.

Each budget holds a `sparsecorr.mismatch.BinnedQuantileSketch` of per-token acceptance
over bins of total context length, so tables from several runs merge exactly (counts add) and
any quantile can be read back; ``values`` is the ``q`` quantile (Sparrow: 5th percentile) and
``counts`` the tokens per cell.

**Size.** Each (budget, bin) cell is a float64 histogram of ``N_BUCKETS`` = 1,024 buckets
(8 KiB), so a table holds ``len(budgets) × n_bins × 8 KiB``. Sparrow's grid (18 budgets ×
20 bins) is 2.9 MiB; a table above ``MAX_TABLE_BYTES`` (1 GiB, e.g. ``n_bins = 10**7`` would be
80 GB per budget) is refused before anything is allocated.

**Files.** `CalibrationTable.load` checks every field of a (possibly hand-edited) JSON file
and names the field and the file in a ``ValueError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._checks import check_int, check_int_list, check_probability
from .._checks import field as json_field
from .._io import atomic_write_json
from ..mismatch import BinnedQuantileSketch

__all__ = ["MAX_TABLE_BYTES", "N_BUCKETS", "CalibrationTable", "check_table_size"]

FORMAT = "sparsecorr.CalibrationTable/1"

#: buckets of each cell's acceptance histogram on [0, 1] (quantile error <= 1/2048)
N_BUCKETS = 1024

#: largest table accepted (all its histograms together)
MAX_TABLE_BYTES = 2**30


def check_table_size(n_budgets: int, n_bins: int) -> None:
    size = n_budgets * n_bins * N_BUCKETS * 8
    if size > MAX_TABLE_BYTES:
        raise ValueError(
            f"n_bins: expected len(budgets) * n_bins <= {MAX_TABLE_BYTES // (N_BUCKETS * 8):,} "
            f"cells (each holds a {N_BUCKETS}-bucket float64 histogram, 8 KiB; 1 GiB in all), "
            f"got {n_budgets} budgets x {n_bins:,} bins = {size / 2**30:,.1f} GiB"
        )


@dataclass
class CalibrationTable:
    """Acceptance sketches per budget; ``values``/``counts`` are ``[n_budgets, n_bins]``.

    Args:
        budgets: candidate KV budgets (positive ints; stored sorted, without duplicates).
        bin_size: tokens of total context per bin (positive int; Sparrow: 2,000).
        n_bins: number of bins (positive int; the table's size is bounded, see the module).
        q: the tail level read by ``values``, in [0, 1] (Sparrow: 0.05).
        sketches: per-budget sketches (filled by ``add``; created when missing).
        meta: free-form provenance (the calibration settings, the budgets done).
    """

    budgets: list[int]
    bin_size: int = 2000
    n_bins: int = 20
    q: float = 0.05
    sketches: dict[int, BinnedQuantileSketch] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_int_list("budgets", self.budgets)
        check_int("bin_size", self.bin_size, low=1)
        check_int("n_bins", self.n_bins, low=1)
        check_probability("q", self.q)
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta: expected a dict, got {type(self.meta).__name__}")
        self.budgets = sorted({int(b) for b in self.budgets})
        check_table_size(len(self.budgets), self.n_bins)  # before any histogram is allocated
        for b in self.budgets:
            self.sketches.setdefault(b, BinnedQuantileSketch(0.0, 1.0, bin_size=self.bin_size,
                                                             n_bins=self.n_bins, n_buckets=N_BUCKETS))

    def add(self, budget: int, acceptance: torch.Tensor, mask: torch.Tensor,
            offset: torch.Tensor | None = None) -> None:
        """Add per-token acceptance ``[B, T]`` of rollouts decoded at ``budget``.

        ``offset`` (``[B]`` prompt lengths, integers >= 0) places token ``t`` at total context
        ``offset + t``. Non-finite acceptances are skipped and counted by the sketch.
        """
        if budget not in self.sketches:
            raise ValueError(f"budget: expected one of {self.budgets}, got {budget!r}")
        if not isinstance(acceptance, torch.Tensor) or not acceptance.is_floating_point():
            raise ValueError(f"acceptance: expected a floating-point tensor, got "
                             f"{getattr(acceptance, 'dtype', type(acceptance).__name__)}")
        self.sketches[budget].update(acceptance.float(), mask, offset)

    @property
    def values(self) -> torch.Tensor:
        """The ``q`` quantile per (budget, bin), NaN where no token fell: ``[n_budgets, n_bins]``."""
        return torch.stack([self.sketches[b].quantile(self.q) for b in self.budgets])

    @property
    def counts(self) -> torch.Tensor:
        return torch.stack([self.sketches[b].bin_counts for b in self.budgets]).long()

    def merge(self, other: CalibrationTable) -> CalibrationTable:
        """Add another run's table (same bins and q); new budgets are added."""
        if not isinstance(other, CalibrationTable):
            raise ValueError(f"other: expected a CalibrationTable, got {type(other).__name__}")
        if (other.bin_size, other.n_bins, other.q) != (self.bin_size, self.n_bins, self.q):
            raise ValueError(f"other: expected bin_size={self.bin_size}, n_bins={self.n_bins}, "
                             f"q={self.q}, got {other.bin_size}, {other.n_bins}, {other.q}")
        check_table_size(len(set(self.budgets) | set(other.budgets)), self.n_bins)
        for b, sk in other.sketches.items():
            if b in self.sketches:
                self.sketches[b].merge(sk)
            else:
                self.sketches[b] = sk
                self.budgets = sorted({*self.budgets, b})
        return self

    def to_dict(self) -> dict[str, Any]:
        cells = {}
        for b, sk in self.sketches.items():
            nz = sk.counts.nonzero()
            cells[str(b)] = [[int(i), int(j), float(sk.counts[i, j])] for i, j in nz.tolist()]
        return {"format": FORMAT, "budgets": self.budgets, "bin_size": self.bin_size,
                "n_bins": self.n_bins, "q": self.q, "n_buckets": N_BUCKETS, "cells": cells,
                "meta": self.meta}

    @classmethod
    def from_dict(cls, data: Any) -> CalibrationTable:
        """From `to_dict`'s output; every field is checked (errors name it)."""
        if not isinstance(data, dict):
            raise ValueError(f"table: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT!r}, got {data.get('format')!r}")
        budgets = json_field(data, "budgets", where="", kind="list")
        n_buckets = json_field(data, "n_buckets", where="", kind="int", default=N_BUCKETS)
        if n_buckets != N_BUCKETS:
            raise ValueError(f"n_buckets: expected {N_BUCKETS}, got {n_buckets!r}")
        table = cls(budgets=list(budgets), bin_size=json_field(data, "bin_size", where="", kind="int"),
                    n_bins=json_field(data, "n_bins", where="", kind="int"),
                    q=json_field(data, "q", where="", kind="number"),
                    meta=json_field(data, "meta", where="", kind="dict", default={}))
        cells = json_field(data, "cells", where="", kind="dict")
        for b, entries in cells.items():
            if not (isinstance(b, str) and b.isdigit() and int(b) in table.sketches):
                raise ValueError(f"cells.{b}: expected a budget listed in budgets {table.budgets}, got {b!r}")
            if not isinstance(entries, list):
                raise ValueError(f"cells.{b}: expected a list of [bin, bucket, count], got {entries!r}")
            table.sketches[int(b)].counts.copy_(_cell_counts(b, entries, table.n_bins))
        return table

    def save(self, path: str | Path) -> Path:
        """Write the table as JSON, atomically (mode as a plain ``open`` would give)."""
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> CalibrationTable:
        """Read a table written by `save`; a bad file is a ``ValueError`` naming field and file."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"path: no calibration table at {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"path: {path} is not valid JSON ({exc})") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{exc} (in the calibration table {path})") from None


def _cell_counts(budget: str, entries: list, n_bins: int) -> torch.Tensor:
    """``[n_bins, N_BUCKETS]`` counts from ``[[bin, bucket, count], ...]``, every entry checked."""
    counts = torch.zeros(n_bins, N_BUCKETS, dtype=torch.float64)
    for k, e in enumerate(entries):
        ok = (isinstance(e, list) and len(e) == 3 and all(isinstance(v, int) and not isinstance(v, bool)
                                                          for v in e[:2])
              and isinstance(e[2], (int, float)) and not isinstance(e[2], bool)
              and 0 <= e[0] < n_bins and 0 <= e[1] < N_BUCKETS and 0 <= e[2] < float("inf"))
        if not ok:
            raise ValueError(f"cells.{budget}[{k}]: expected [bin in [0, {n_bins}), bucket in "
                             f"[0, {N_BUCKETS}), count >= 0], got {e!r}")
        counts[e[0], e[1]] = e[2]
    return counts
