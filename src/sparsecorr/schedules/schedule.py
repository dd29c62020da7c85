"""``BudgetSchedule``: a step function of total context length -> KV budget (None = dense).

The interface ``sparsecorr.decoding.generate`` accepts (``budget_at(context_len)``), with JSON
round-trip and schema validation, Sparrow-style page tables, and presets shipped as data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._checks import check_int
from .._checks import field as json_field
from .._io import atomic_write_json

__all__ = ["SPARROW_PRESETS", "BudgetSchedule"]

FORMAT = "sparsecorr.BudgetSchedule/1"
_PRESET_DIR = Path(__file__).with_name("presets")


def _load_presets() -> dict[str, dict[str, Any]]:
    """The shipped Sparrow presets (``presets/*.json``, each with its citation)."""
    out = {}
    for f in sorted(_PRESET_DIR.glob("*.json")):
        data = json.loads(f.read_text())
        out[data["name"]] = data
    return out


_PRESET_DATA = _load_presets()

#: pages per 2,000-token bin of Sparrow's released schedules (data: ``presets/*.json``)
SPARROW_PRESETS: dict[str, list[int]] = {k: list(v["pages"]) for k, v in _PRESET_DATA.items()}


@dataclass(frozen=True)
class BudgetSchedule:
    """Budget per bin of ``bin_size`` tokens of total context; the last bin extends to infinity.

    Attributes:
        bin_size: tokens per bin (Sparrow: 2,000).
        budgets: one budget per bin (tokens), None for dense.
        meta: free-form provenance (source, tau, predicted speedup ...).
    """

    bin_size: int
    budgets: tuple[int | None, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        check_int("bin_size", self.bin_size, low=1)
        if isinstance(self.budgets, (str, bytes)) or not hasattr(self.budgets, "__iter__"):
            raise ValueError(f"budgets: expected a sequence of positive ints or None, got {self.budgets!r}")
        object.__setattr__(self, "budgets", tuple(self.budgets))
        if not self.budgets:
            raise ValueError("budgets: expected at least one bin, got none")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta: expected a dict, got {type(self.meta).__name__}")
        for i, b in enumerate(self.budgets):
            if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
                raise ValueError(f"budgets[{i}]: expected a positive int or null, got {b!r}")

    def budget_at(self, context_len: int) -> int | None:
        """The budget in force at ``context_len`` total tokens (None = dense; negative lengths
        read as 0)."""
        return self.budgets[min(max(int(context_len), 0) // self.bin_size, len(self.budgets) - 1)]

    # -- pages (Sparrow tables) ---------------------------------------------------------------
    def to_pages(self, page_size: int = 16, extra_pages: int = 3) -> list[int | None]:
        """Pages per bin, inverting ``budget = (pages + extra_pages) * page_size``."""
        check_int("page_size", page_size, low=1)
        check_int("extra_pages", extra_pages, low=0)
        return [None if b is None else b // page_size - extra_pages for b in self.budgets]

    @classmethod
    def from_pages(cls, pages: list[int | None], *, bin_size: int = 2000, page_size: int = 16,
                   extra_pages: int = 3, meta: dict | None = None) -> BudgetSchedule:
        """From Sparrow's page counts: ``budget = (pages + extra_pages) * page_size``."""
        check_int("page_size", page_size, low=1)
        check_int("extra_pages", extra_pages, low=0)
        for i, p in enumerate(pages):
            check_int(f"pages[{i}]", p, low=0, allow_none=True)
        budgets = [None if p is None else (int(p) + extra_pages) * page_size for p in pages]
        return cls(bin_size=bin_size, budgets=tuple(budgets), meta=dict(meta or {}))

    @classmethod
    def preset(cls, name: str) -> BudgetSchedule:
        """A shipped schedule: ``sparrow-qwen3-1.7b-0.86``, ``...-4b-0.86``, ``...-8b-0.86``."""
        if name not in SPARROW_PRESETS:
            raise ValueError(f"name: expected one of {sorted(SPARROW_PRESETS)}, got {name!r}")
        d = _PRESET_DATA[name]
        meta = {"name": name, "model": d["model"], "tau": d["tau"], "q": d["q"],
                "citation": dict(d["citation"])}
        return cls.from_pages(d["pages"], bin_size=d["bin_size"], page_size=d["page_size"],
                              extra_pages=d["extra_pages"], meta=meta)

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "bin_size": self.bin_size, "budgets": list(self.budgets), "meta": self.meta}

    @classmethod
    def from_dict(cls, data: Any) -> BudgetSchedule:
        if not isinstance(data, dict):
            raise ValueError(f"schedule: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT!r}, got {data.get('format')!r}")
        bin_size = json_field(data, "bin_size", where="", kind="int")
        budgets = json_field(data, "budgets", where="", kind="list")
        meta = json_field(data, "meta", where="", kind="dict", default={})
        return cls(bin_size=bin_size, budgets=tuple(budgets), meta=meta)

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> BudgetSchedule:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"path: no schedule file at {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"path: {path} is not valid JSON ({exc})") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{exc} (in the schedule file {path})") from None

    def table(self) -> str:
        """A printable table: context range -> budget."""
        lines = ["| context tokens | budget |", "|---|---:|"]
        for i, b in enumerate(self.budgets):
            hi = "∞" if i == len(self.budgets) - 1 else f"{(i + 1) * self.bin_size:,}"
            lines.append(f"| {i * self.bin_size:,} – {hi} | {'dense' if b is None else b} |")
        return "\n".join(lines)
