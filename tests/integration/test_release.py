"""The release path a user runs: ``make dist`` builds sdist + wheel of the four distributions;
the wheels install into a fresh virtualenv with ``pip install 'sparsecorr[demo]'`` and
``sparsecorr demo --quick`` runs there from a directory outside the source tree. The verl
plugin's wheel installs beside them (without verl, which needs GPU-only packages): its
``verl.plugins`` entry point is registered and its launcher's ``--help`` runs.

Marked ``slow`` (a fresh venv installs torch and TRL's dependency tree: 95 s to 4.5 min on 2
cores with pip's cache warm); ``.ci/run`` runs it after the default suite. Costs kept down: the
builds run without isolation (the dev venv has setuptools), torch comes from the local wheel
cache first, and pip's download cache is shared with the dev setup.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = {".": "sparsecorr", "integrations/trl": "sparsecorr_trl",
                 "integrations/openrlhf": "sparsecorr_openrlhf", "integrations/verl": "sparsecorr_verl"}
TORCH = "torch==2.13.0"


def _run(cmd: list[str], *, cwd: Path, timeout: float = 900, env: dict | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _build(out: Path) -> dict[str, tuple[Path, Path]]:
    pytest.importorskip("build")
    built = {}
    for src, name in DISTRIBUTIONS.items():
        _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), src], cwd=ROOT)
        wheel = next(out.glob(f"{name}-*-py3-none-any.whl"))
        sdist = next(out.glob(f"{name}-*.tar.gz"))
        built[name] = (wheel, sdist)
    return built


def test_wheels_install_in_a_fresh_venv_and_the_demo_runs_outside_the_tree(tmp_path):
    built = _build(tmp_path / "dist")
    core_wheel = built["sparsecorr"][0]
    import zipfile

    names = zipfile.ZipFile(core_wheel).namelist()
    assert not any("/demo/" in n or "assets/" in n for n in names), "demo shipped in the core"
    assert any(n.endswith("demo/assets/demo_model/model.safetensors")
               for n in zipfile.ZipFile(built["sparsecorr_trl"][0]).namelist())

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, TORCH], cwd=tmp_path, env=env)  # the pinned CPU wheel first, never a CUDA one
    # what a user types, with the local wheels standing in for the index
    _run([*pip, f"{core_wheel}[demo]", str(built["sparsecorr_trl"][0]),
          str(built["sparsecorr_openrlhf"][0]), str(built["sparsecorr_verl"][0])],
         cwd=tmp_path, env=env)

    work = tmp_path / "elsewhere"  # outside the source tree: nothing is read from the checkout
    work.mkdir()
    plugin = _run([py, "-c", "from importlib.metadata import entry_points; "
                   "print([e.value for e in entry_points(group='verl.plugins')])"], cwd=work, env=env)
    assert "sparsecorr_verl.plugin" in plugin
    helped = _run([py, "-m", "sparsecorr_verl.main_ppo", "--help"], cwd=work, env=env)
    assert "loss_mode=sparsecorr" in helped
    out = _run([str(venv / "bin" / "sparsecorr"), "demo", "--quick", "--out", "run"],
               cwd=work, env=env)
    text = (work / "run" / "report.md").read_text()
    assert "## What each arm shows" in text and "schedule/sparse_rl" in text
    for png in ("calibration.png", "curves.png", "memory_speed.png"):
        assert (work / "run" / png).stat().st_size > 1000
    assert str(ROOT) not in out + text, "a message names the checkout"
    where = _run([py, "-c", "import sparsecorr, sparsecorr_trl; print(sparsecorr.__file__, "
                  "sparsecorr_trl.__file__)"], cwd=work, env=env)
    assert str(venv) in where and str(ROOT) not in where
