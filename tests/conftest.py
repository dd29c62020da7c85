"""Shared test configuration: hypothesis profiles, the ``gpu`` marker, seeded RNG."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=60,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_report_header(config: pytest.Config) -> str:
    """The versions that matter at the seams, so a failure log names what it ran against."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    names = ("torch", "transformers", "trl", "peft", "verl", "openrlhf")
    return "versions: " + ", ".join(f"{n}=={version(n)}" for n in names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng() -> torch.Generator:
    """A seeded CPU generator (seed 0) so tests are reproducible."""
    return torch.Generator().manual_seed(0)
