"""The bad-input table's harness (issue #14), shared by ``tests/unit/test_bad_inputs*.py``.

Each row calls one public function with one bad input and states the outcome: either a
``ValueError`` whose message starts with the argument's name (``"chunk_size: expected ..."``),
or a documented well-defined result, checked by a predicate.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

CLASSES = ("shape", "dtype", "nan", "inf", "empty", "all_masked", "range", "file")


@dataclass(frozen=True)
class Row:
    """One bad input: ``call()`` must raise a ``ValueError`` matching ``error`` (a regex
    anchored at the start of the message, so the argument comes first), or return a value
    for which ``check(value)`` holds (a documented well-defined result)."""

    target: str
    kind: str
    call: Callable[[], object]
    error: str | None = None
    check: Callable[[object], bool] | None = None
    note: str = ""

    @property
    def id(self) -> str:
        return f"{self.target}-{self.kind}-{self.note or self.error or 'result'}"


def refused(target: str, kind: str, call: Callable[[], object], arg: str, note: str = "") -> Row:
    """``call`` raises ValueError naming ``arg`` first (``arg`` is a regex)."""
    return Row(target, kind, call, error=arg, note=note)


def result(target: str, kind: str, call: Callable[[], object], check: Callable[[object], bool],
           note: str) -> Row:
    """``call`` returns the documented result ``check`` accepts."""
    return Row(target, kind, call, check=check, note=note)


REGISTRY: dict[str, Callable[[], list[Row]]] = {}


def rows(module: str) -> Callable[[Callable[[], list[Row]]], Callable[[], list[Row]]]:
    def register(fn: Callable[[], list[Row]]) -> Callable[[], list[Row]]:
        REGISTRY[f"{module}:{fn.__name__}"] = fn
        return fn

    return register


def check_row(row: Row) -> None:
    """Run one row: the ValueError names the argument first and says what was expected, or the
    result is the documented one."""
    assert row.kind in CLASSES, row.kind
    if row.error is not None:
        try:
            row.call()
        except ValueError as exc:
            assert re.match(row.error, str(exc)), f"{row.target}: {exc}"
            assert "expected" in str(exc) or "missing" in str(exc), str(exc)
        else:
            raise AssertionError(f"{row.target}: no ValueError for {row.id}")
    else:
        value = row.call()
        assert row.check(value), f"{row.target}: {row.note}: got {value!r}"


def missing_rows(all_rows: list[Row], covered: dict[str, set[str]]) -> dict[str, list[str]]:
    """Public names (by module) without a row."""
    targets = {r.target for r in all_rows}
    return {m: sorted(names - targets) for m, names in covered.items() if names - targets}
