"""bench_decode_kernels.py --schedule-only --smoke: the compression events of one generate call per
eviction policy, in the GPU table's order (StreamingLLM, SnapKV, RKV, then SnapKV and RKV again)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_event_schedule_smoke(tmp_path):
    out = tmp_path / "schedule.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode_kernels.py"), "--smoke",
                          "--schedule-only", "--json", str(out)], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "compression events of one generate call" in run.stdout
    rows = json.loads(out.read_text())["schedule"]
    assert [r["policy"] for r in rows] == ["StreamingLLM", "SnapKV", "RKV", "SnapKV", "RKV"]
    shape = rows[0]["shape"]
    # every eviction policy compresses at the same points: the prefill's event, then each time a
    # row reaches budget + buffer + 1 valid slots
    assert len({tuple(r["events"]) for r in rows}) == 1
    events = rows[0]["events"]
    assert len(events) >= 2 and events[1:] == [shape["budget"] + shape["buffer"] + 1] * (len(events) - 1)
    assert all(len(r["event_s"]) == len(events) and r["ms_per_token"] > 0 for r in rows)
    assert all(r["backend"] == "torch" and r["captures"] == 0 for r in rows)  # CPU: eager, torch backend
