"""The lock, the ranges, the Makefile's tested ends and the stacks' pins agree with each other.

``requirements.lock`` is what ``make venv`` and CI install; the pyproject files keep ranges for
library users; the Makefile names the ends of the torch and transformers ranges that CI tests;
``tests/constraints/`` holds the pins of the stacks users train in. A refreshed lock outside a
range, a range edited in one place only, or a floor that refuses a stack's pin fails here
(offline) instead of on a user's machine; ``tests/resolve`` runs pip's resolver on the same
files against the index.
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


def _declared(where: str, name: str) -> SpecifierSet:
    return next(r.specifier for w, r in _requirements() if w == where and r.name == name)


def test_the_core_needs_no_transformers():
    """``import sparsecorr`` needs none (tests/integration/test_readme_and_api.py checks the
    import): only the decoding engine does, through the ``decoding`` extra."""
    assert not [r for w, r in _requirements() if w == "pyproject.toml[]" and r.name == "transformers"]


def test_every_transformers_requirement_is_the_tested_range():
    declared = SpecifierSet(_makefile("TRANSFORMERS_RANGE"))
    found = {w: r.specifier for w, r in _requirements() if r.name == "transformers"}
    assert "pyproject.toml[decoding]" in found
    assert all(spec == declared for spec in found.values()), found
    lowest = Version(_makefile("TRANSFORMERS_LOWEST"))
    assert lowest in declared
    assert any(s.operator == ">=" and Version(s.version) <= lowest for s in declared)
    assert _lock()["transformers"] in declared
    assert Version(_makefile("TRANSFORMERS_AT_TORCH_NEWEST")) in declared


def test_the_tested_torch_ends_are_the_declared_range():
    declared = _declared("pyproject.toml[]", "torch")
    lowest, newest = Version(_makefile("TORCH_LOWEST")), Version(_makefile("TORCH_NEWEST"))
    (floor,) = [Version(s.version) for s in declared if s.operator == ">="]
    assert floor.release[:2] == lowest.release[:2], f"the torch floor {floor} is not what CI tests ({lowest})"
    assert lowest in declared and newest in declared and _lock()["torch"] in declared
    assert lowest < _lock()["torch"] < newest


def test_the_decoding_guard_checks_the_declared_range():
    """The adapter's guard (sparsecorr.decoding.hf.SUPPORTED) is the declared range, and the
    versions it names as tested are the lowest end and the lock's."""
    from sparsecorr.decoding import hf

    assert hf.SUPPORTED == _declared("pyproject.toml[decoding]", "transformers")
    assert hf.TESTED == (_makefile("TRANSFORMERS_LOWEST"), str(_lock()["transformers"]))


STACKS = sorted((ROOT / "tests" / "constraints").glob("*.txt"))
DISTS = {"sparsecorr": ROOT / "pyproject.toml",
         **{f"sparsecorr-{p.parent.name}": p for p in PYPROJECTS[1:]}}


def _installs(item: Requirement, seen: set[str] | None = None) -> list[Requirement]:
    """The requirements ``item`` (one of our distributions, with extras) brings, ours expanded."""
    seen = set() if seen is None else seen
    key = f"{item.name}[{','.join(sorted(item.extras))}]"
    if key in seen:
        return []
    seen.add(key)
    project = tomllib.loads(DISTS[canonicalize_name(item.name)].read_text())["project"]
    lines = list(project.get("dependencies", []))
    for extra in item.extras:
        lines += project["optional-dependencies"][extra]
    out = []
    for r in map(Requirement, lines):
        out += _installs(r, seen) if canonicalize_name(r.name) in OURS else [r]
    return out


@pytest.mark.parametrize("stack", STACKS, ids=lambda p: p.stem)
def test_our_ranges_admit_each_stacks_exact_pins(stack):
    """Offline half of tests/resolve: every ``==`` pin of a stack on a package we require lies in
    our range (torch 2.11.0 for verl 0.9.1, transformers 5.9.0, flashinfer-python 0.7.2 ...)."""
    text = stack.read_text().splitlines()
    (install,) = [line.split(":", 1)[1].split() for line in text if line.startswith("# install:")]
    ours = [r for item in install for r in _installs(Requirement(item))]
    pins = [Requirement(line.split("#")[0]) for line in text if line.strip() and not line.startswith("#")]
    checked = 0
    for pin in pins:
        (exact,) = [s.version for s in pin.specifier if s.operator == "=="] or [None]
        for req in ours:
            if exact and canonicalize_name(req.name) == canonicalize_name(pin.name):
                assert req.specifier.contains(exact, prereleases=True), (
                    f"{stack.name} pins {pin}; we require {req}")
                checked += 1
    assert checked, f"{stack.name}: no exact pin on a package we require"
