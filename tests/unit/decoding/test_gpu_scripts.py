"""The prepared GPU-run scripts (issue 34): they parse, refuse an unknown step, and the wheel
list pins every package at the lock's version. (A full CPU rehearsal: GPU_CHECK_CPU=1 bash
scripts/gpu_check.sh, about a minute: it builds a venv and installs the wheels.)"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)]).returncode == 0


@needs_bash
def test_gpu_check_refuses_an_unknown_step(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "nope"], capture_output=True, text=True,
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 2 and "unknown step nope" in proc.stderr


def test_wheels_are_pinned_by_the_lock():
    text = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    packages = re.search(r"PACKAGES=\(([^)]*)\)", text).group(1).split()
    lock = {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower() for line in
            (ROOT / "requirements.lock").read_text().splitlines() if "==" in line}
    assert "trl" in packages and not [p for p in packages if p.lower() not in lock]
