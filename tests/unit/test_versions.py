"""The lock, the ranges and the Makefile's tested range agree with each other.

``requirements.lock`` is what ``make venv`` and CI install; the pyproject files keep ranges for
library users; the Makefile names the ends of the transformers range that CI tests. A refreshed
lock outside a range, or a range edited in one place only, fails here instead of on a user's
machine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECTS = [ROOT / "pyproject.toml", *sorted((ROOT / "integrations").glob("*/pyproject.toml"))]
OURS = {"sparsecorr", "sparsecorr-trl", "sparsecorr-openrlhf", "sparsecorr-verl"}


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"requirements.lock: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[tuple[str, Requirement]]:
    reqs = []
    for path in PYPROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        groups = {"": project.get("dependencies", []), **project.get("optional-dependencies", {})}
        for group, lines in groups.items():
            reqs += [(f"{path.relative_to(ROOT)}[{group}]", Requirement(r)) for r in lines]
    return reqs


def _makefile(name: str) -> str:
    match = re.search(rf"^{name} := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"Makefile has no {name}"
    return match.group(1).strip()


def test_the_lock_pins_everything_once_and_torch_without_a_local_tag():
    pins = _lock()
    assert pins["torch"] == Version(_makefile("TORCH_VERSION"))
    assert not pins["torch"].local, "the lock pins torch without +cpu: make venv installs it first"
    assert not OURS & set(pins), "our own distributions are installed editable, not from the lock"


@pytest.mark.parametrize("where,req", _requirements(), ids=lambda x: str(x))
def test_every_range_admits_the_locked_version(where, req):
    name = canonicalize_name(req.name)
    if name in OURS or name == "flashinfer-python":  # editable / GPU-only: not in the CPU lock
        return
    pins = _lock()
    assert name in pins, f"{where}: {req} is not in requirements.lock (run `make lock`)"
    assert req.specifier.contains(pins[name], prereleases=True), (
        f"{where}: the lock has {name}=={pins[name]}, outside {req.specifier} (run `make lock`)")


def test_each_range_has_a_lower_and_an_upper_end():
    for where, req in _requirements():
        if canonicalize_name(req.name) in {"setuptools"} | OURS:
            continue
        ops = {s.operator for s in req.specifier}
        assert ops & {">=", "=="} and ops & {"<", "=="}, f"{where}: {req} needs both ends"


def test_the_tested_transformers_range_is_the_declared_one():
    declared = next(r.specifier for w, r in _requirements()
                    if w == "pyproject.toml[]" and r.name == "transformers")
    assert declared == SpecifierSet(_makefile("TRANSFORMERS_RANGE"))
    lowest = Version(_makefile("TRANSFORMERS_LOWEST"))
    assert lowest in declared
    assert any(s.operator == ">=" and Version(s.version) <= lowest for s in declared)
    assert _lock()["transformers"] in declared


def test_the_decoding_guard_checks_the_declared_range():
    """The adapter's guard (sparsecorr.decoding.hf.SUPPORTED) is the declared range, and the
    versions it names as tested are the lowest end and the lock's."""
    from sparsecorr.decoding import hf

    declared = next(r.specifier for w, r in _requirements()
                    if w == "pyproject.toml[]" and r.name == "transformers")
    assert hf.SUPPORTED == declared
    assert hf.TESTED == (_makefile("TRANSFORMERS_LOWEST"), str(_lock()["transformers"]))
