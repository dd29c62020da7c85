"""benchmarks/bench_trl_step_gpu.py --smoke: the end-to-end GRPO benchmark's tiny CPU
configuration runs in a subprocess, as a user runs it (all three rows, one JSON line each), and
so do its modes: the long-response shape, the memory mode, gradient checkpointing off."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
ROOT = Path(__file__).resolve().parents[3]


def _bench(tmp_path, *flags):
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "integrations" / "trl" / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_trl_step_gpu.py"), "--smoke",
                           *flags, "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [json.loads(line) for line in out.read_text().splitlines()]


def test_bench_trl_step_gpu_smoke(tmp_path):
    proc, rows = _bench(tmp_path)
    assert [r["row"].split(",")[0].split(" (")[0] for r in rows] == \
        ["stock GRPOTrainer", "SparseGRPOTrainer", "SparseGRPOTrainer"]
    assert rows[0]["backend"] == "HF generate"
    assert [(r["backend"], r["cuda_graph"], r["fused"]) for r in rows] == \
        [("HF generate", "off", "off")] + [("torch", "off", "off")] * 2  # CPU: eager, as it ran
    for r in rows:
        assert r["step_s"] > 0 and r["rollout_s"] > 0 and r["step_s"] >= r["rollout_s"]
        assert r["gradient_checkpointing"] is True and r["steps"] == 2  # TRL's default; --steps 2 (smoke)
    assert "rkv @ 16 + sparse_rl()" in proc.stdout and "allocated after each step" in proc.stdout
    assert "graph / fused / backend" in proc.stdout


def test_bench_trl_step_gpu_long_shape_smoke(tmp_path):
    proc, rows = _bench(tmp_path, "--shape", "long")
    assert [r["row"] for r in rows] == ["SparseGRPOTrainer, our dense engine",
                                        "SparseGRPOTrainer, rkv @ 8 + sparse_rl()"]  # no stock row
    assert "(8 prompt + <= 32 new)" in proc.stdout


def test_bench_trl_step_gpu_memory_mode_smoke(tmp_path):
    proc, rows = _bench(tmp_path, "--memory-steps", "3", "--no-gradient-checkpointing")
    assert [r["row"].split(",")[1].strip().split(" ")[0] for r in rows] == ["our", "rkv"]
    assert all(r["steps"] == 3 and r["gradient_checkpointing"] is False for r in rows)
    assert "no gc.collect()" in proc.stdout and "gradient checkpointing off" in proc.stdout


def test_bench_trl_step_gpu_refuses_bad_sizes():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_trl_step_gpu.py"), "--smoke",
                           "--batch", "5"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode != 0 and "--batch: expected a multiple of --generations" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_trl_step_gpu.py"), "--smoke",
                           "--memory-steps", "3", "--rows", "stock,dense"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode != 0 and "--rows: expected only our rows" in proc.stderr
