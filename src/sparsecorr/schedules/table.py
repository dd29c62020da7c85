"""``CalibrationTable``: the tail statistic of acceptance per candidate budget × length bin.

Each budget holds a `BinnedQuantileSketch` of per-token acceptance
over bins of total context length, so tables from several runs merge exactly (counts add) and
any quantile can be read back; ``values`` is the ``q`` quantile (Sparrow: 5th percentile) and
``counts`` the tokens per cell.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._io import atomic_write_json
from ..mismatch import BinnedQuantileSketch

__all__ = ["CalibrationTable"]

FORMAT = "sparsecorr.CalibrationTable/1"


@dataclass
class CalibrationTable:
    """Acceptance sketches per budget; ``values``/``counts`` are ``[n_budgets, n_bins]``."""

    budgets: list[int]
    bin_size: int = 2000
    n_bins: int = 20
    q: float = 0.05
    sketches: dict[int, BinnedQuantileSketch] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.budgets or any(not isinstance(b, int) or b < 1 for b in self.budgets):
            raise ValueError(f"budgets: expected positive ints, got {self.budgets!r}")
        self.budgets = sorted(set(self.budgets))
        for b in self.budgets:
            self.sketches.setdefault(b, BinnedQuantileSketch(0.0, 1.0, bin_size=self.bin_size,
                                                             n_bins=self.n_bins, n_buckets=1024))

    def add(self, budget: int, acceptance: torch.Tensor, mask: torch.Tensor,
            offset: torch.Tensor | None = None) -> None:
        """Add per-token acceptance ``[B, T]`` of rollouts decoded at ``budget``."""
        if budget not in self.sketches:
            raise ValueError(f"budget: expected one of {self.budgets}, got {budget!r}")
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
        if (other.bin_size, other.n_bins, other.q) != (self.bin_size, self.n_bins, self.q):
            raise ValueError(f"other: expected bin_size={self.bin_size}, n_bins={self.n_bins}, "
                             f"q={self.q}, got {other.bin_size}, {other.n_bins}, {other.q}")
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
                "n_bins": self.n_bins, "q": self.q, "n_buckets": 1024, "cells": cells, "meta": self.meta}

    @classmethod
    def from_dict(cls, data: Any) -> CalibrationTable:
        if not isinstance(data, dict):
            raise ValueError(f"table: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT!r}, got {data.get('format')!r}")
        for key in ("budgets", "bin_size", "n_bins", "q", "cells"):
            if key not in data:
                raise ValueError(f"{key}: missing from the calibration table")
        table = cls(budgets=list(data["budgets"]), bin_size=int(data["bin_size"]),
                    n_bins=int(data["n_bins"]), q=float(data["q"]), meta=data.get("meta", {}))
        for b, entries in data["cells"].items():
            if int(b) not in table.sketches:
                raise ValueError(f"cells.{b}: budget not listed in budgets")
            sk = table.sketches[int(b)]
            for i, j, c in entries:
                if not (0 <= i < table.n_bins and 0 <= j < sk.n_buckets) or c < 0:
                    raise ValueError(f"cells.{b}: entry {[i, j, c]} out of range")
                sk.counts[i, j] = c
        return table

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> CalibrationTable:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"path: no calibration table at {path}")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"path: {path} is not valid JSON ({exc})") from None
