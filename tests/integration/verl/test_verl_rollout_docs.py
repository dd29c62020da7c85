"""The rollout lines on docs/integrations/verl.md, in the launcher's ``--help`` and in the GRPO
example are options the ``sparsecorr`` rollout backend accepts (no verl or Ray needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from sparsecorr_verl import main_ppo
from sparsecorr_verl.rollout import EngineOptions, engine_options

ROOT = Path(__file__).resolve().parents[3]
PREFIX = "actor_rollout_ref.rollout.engine_kwargs.sparsecorr."
SOURCES = {"docs": ROOT / "docs" / "integrations" / "verl.md",
           "example": ROOT / "integrations" / "verl" / "examples" / "grpo_sparse_rollout.sh"}


def _options(text: str) -> dict:
    found = re.findall(r"\+?" + re.escape(PREFIX) + r"(\w+)=(\S+)", text)
    assert found, "no engine_kwargs.sparsecorr override"
    return {key: yaml.safe_load(value) for key, value in found}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_documented_overrides_build_engine_options(source):
    text = SOURCES[source].read_text()
    assert "actor_rollout_ref.rollout.name=sparsecorr" in text
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=1" in text
    options = engine_options({"engine_kwargs": {"sparsecorr": _options(text)}})
    assert options.policy == "rkv" and options.budget == 2048


def test_launcher_help_shows_the_rollout_lines():
    values = _options(main_ppo.__doc__)
    assert engine_options({"engine_kwargs": {"sparsecorr": values}}) == EngineOptions(
        policy="rkv", budget=2048, backend="auto", max_batch_size=256)


def test_docs_table_lists_every_engine_option():
    page = SOURCES["docs"].read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", page, flags=re.M))
    assert set(EngineOptions.__dataclass_fields__) <= rows


def test_make_test_lowest_installs_the_ray_verl_requires():
    """The Ray ``make test-lowest`` installs beside verl 0.9.1 satisfies verl's own requirement."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    try:
        wanted = [Requirement(r) for r in requires("verl") or [] if Requirement(r).name == "ray"]
    except PackageNotFoundError:
        pytest.skip("verl is not installed")
    line = re.search(r"^RAY_RUNTIME := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert line, "Makefile has no RAY_RUNTIME"
    pins = {Requirement(p).name: Requirement(p) for p in line.group(1).split()}
    version = next(iter(pins["ray"].specifier)).version
    assert wanted and all(req.specifier.contains(version) for req in wanted)
