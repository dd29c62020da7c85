"""benchmarks/bench_trl_step_gpu.py --smoke: the end-to-end GRPO benchmark's tiny CPU
configuration runs in a subprocess, as a user runs it (all three rows, one JSON line each)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
ROOT = Path(__file__).resolve().parents[3]


def test_bench_trl_step_gpu_smoke(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "integrations" / "trl" / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_trl_step_gpu.py"), "--smoke",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"].split(",")[0].split(" (")[0] for r in rows] == \
        ["stock GRPOTrainer", "SparseGRPOTrainer", "SparseGRPOTrainer"]
    assert rows[0]["backend"] == "HF generate"
    assert [(r["backend"], r["cuda_graph"]) for r in rows[1:]] == [("torch", "off")] * 2  # CPU: eager
    for r in rows:
        assert r["step_s"] > 0 and r["rollout_s"] > 0 and r["step_s"] >= r["rollout_s"]
    assert "rkv @ 16 + sparse_rl()" in proc.stdout and "allocated after each step" in proc.stdout


def test_bench_trl_step_gpu_refuses_bad_sizes():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_trl_step_gpu.py"), "--smoke",
                           "--batch", "5"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode != 0 and "--batch: expected a multiple of --generations" in proc.stderr
