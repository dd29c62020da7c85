"""sparsecorr installs where users train: pip resolves it beside each stack's pins (issue 35).

Each file in ``tests/constraints/`` holds the pins of one stack users train in (verl 0.9.1,
vLLM 0.33.0, SGLang 0.5.23, OpenRLHF 0.11.2, TRL 1.16), copied from the peers' metadata on the
index. Two checks per stack, both against the index and both metadata only (``pip install
--dry-run``: pip reads each wheel's metadata file, never a multi-GB wheel):

- the pins are the peers' own: every pin is a requirement of a peer named in the file (with the
  extras named there), or a peer's own version, as its metadata on the index gives it;
- ``pip install --dry-run --ignore-installed -c <stack> <our distributions by path>`` resolves,
  the pinned packages it installs keep their pinned versions, torch (and transformers where we
  install the decoding engine) is among them, and the resolved versions are printed.

Marked ``resolve`` (network): CI runs them as their own step, ``make test-resolve``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
STACKS = sorted((ROOT / "tests" / "constraints").glob("*.txt"))
#: our distributions, by path (nothing of ours comes from the index)
OURS = {"sparsecorr": ROOT, "sparsecorr-verl": ROOT / "integrations" / "verl",
        "sparsecorr-openrlhf": ROOT / "integrations" / "openrlhf",
        "sparsecorr-trl": ROOT / "integrations" / "trl"}
SHOWN = ("torch", "transformers", "flashinfer-python", "huggingface-hub", "numpy", "trl",
         *OURS)

pytestmark = pytest.mark.resolve


def _header(path: Path, key: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in path.read_text().splitlines()
            if line.startswith(f"# {key}:")]


def _pins(path: Path) -> list[Requirement]:
    return [Requirement(line.split("#")[0]) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def _pip(*args: str, report: Path) -> dict:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"pip could not resolve: {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return json.loads(report.read_text())


def _peer_requires(peer: str, tmp: Path) -> tuple[str, list[Requirement]]:
    """``(version, requirements with the peer's extras active)`` from the index's metadata."""
    req = Requirement(peer)
    report = _pip("--no-deps", peer, report=tmp / f"{canonicalize_name(req.name)}.json")
    meta = report["install"][0]["metadata"]
    active = []
    for line in meta.get("requires_dist", []):
        r = Requirement(line)
        envs = [dict(default_environment(), extra=e) for e in (req.extras or {""})]
        if r.marker is None or any(r.marker.evaluate(env) for env in envs):
            active.append(r)
    return meta["version"], active


def _spec(r: Requirement) -> tuple[str, frozenset[str]]:
    return canonicalize_name(r.name), frozenset(str(s) for s in r.specifier)


@pytest.mark.parametrize("stack", STACKS, ids=lambda p: p.stem)
def test_the_pins_are_the_peers_own(stack, tmp_path):
    peers = _header(stack, "peer")
    assert peers, f"{stack.name}: names no '# peer:' line"
    given = set()
    for peer in peers:
        version, requires = _peer_requires(peer, tmp_path)
        name = canonicalize_name(Requirement(peer).name)
        given |= {_spec(r) for r in requires} | {(name, frozenset({f"=={version}"}))}
    for pin in _pins(stack):
        assert _spec(pin) in given, (
            f"{stack.name}: {pin} is not a requirement of {', '.join(peers)} on the index "
            f"(refresh the file from the peers' metadata)")


@pytest.mark.parametrize("stack", STACKS, ids=lambda p: p.stem)
def test_sparsecorr_resolves_beside_the_stack_without_changing_a_pin(stack, tmp_path):
    (wanted,) = _header(stack, "install")
    targets = []
    for item in wanted.split():
        r = Requirement(item)
        extras = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
        targets.append(f"{r.name}{extras} @ {OURS[canonicalize_name(r.name)].as_uri()}")
    if not any(t.startswith("sparsecorr[") or t.startswith("sparsecorr @") for t in targets):
        targets.append(f"sparsecorr @ {ROOT.as_uri()}")  # the glue's dependency, by path too
    report = _pip("--no-build-isolation", "-c", str(stack), *targets, report=tmp_path / "r.json")
    got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
           for i in report["install"]}
    print(f"\n{stack.stem}: " + " ".join(f"{n}=={got[n]}" for n in SHOWN if n in got))
    for pin in _pins(stack):
        name = canonicalize_name(pin.name)
        if name in got:
            assert pin.specifier.contains(got[name], prereleases=True), (
                f"{stack.name}: resolved {name}=={got[name]}, the stack pins {pin}")
    assert "torch" in got
    if "decoding" in wanted or "flashinfer" in wanted or "sparsecorr-trl" in wanted:
        assert "transformers" in got, "the decoding engine's transformers was not resolved"
    if "flashinfer" in wanted:
        assert "flashinfer-python" in got
