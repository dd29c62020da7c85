"""``python -m sparsecorr_verl.main_ppo``: ``--help`` works without Ray (or verl) starting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_launcher_help_starts_no_ray(tmp_path):
    """Ray and verl are poisoned on the path: importing either fails the command."""
    for name in ("ray", "verl"):
        pkg = tmp_path / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text(f"raise ImportError('--help must not import {name}')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp_path), str(ROOT / "integrations" / "verl" / "src"), str(ROOT / "src"),
         env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "sparsecorr_verl.main_ppo", "--help"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=sparsecorr" in out.stdout
    assert "+algorithm.rollout_correction.sparsecorr.preset=sparse_rl" in out.stdout
    assert "ImportError" not in out.stderr


def test_launcher_exports_the_plugin_to_ray_workers(monkeypatch):
    from sparsecorr_verl import main_ppo

    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "other_pkg")
    main_ppo._export_to_workers()
    main_ppo._export_to_workers()
    assert os.environ["VERL_USE_EXTERNAL_MODULES"] == "other_pkg,sparsecorr_verl.plugin"
