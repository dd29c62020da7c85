"""benchmarks/bench_rollout_gpu.py runs its tiny CPU configuration end to end: every row decodes
every request to its forced length (the benchmark raises otherwise), the floors are positive, and
the length distribution has the stated shape."""

import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_rollout_gpu", ROOT / "benchmarks" / "bench_rollout_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_rollout_benchmark_smoke_runs_on_cpu(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "rows.jsonl"
    summary = bench.main(["--smoke", "--out", str(out)])
    text = capsys.readouterr().out
    for name in ("HF generate", "Dense continuous", "Dense static", "rkv continuous", "streaming_llm continuous",
                 "head-of-line"):
        assert name in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    timed = [r for r in rows if r["row"] != "summary"]
    assert len(timed) == 5 and all(r["floor_s"] > 0 and r["tokens_per_s"] > 0 for r in timed)
    cont = [r for r in timed if "continuous" in r["row"]]
    assert all(1 <= r["resident"] <= r["plan_rows"] for r in cont)
    assert summary["head_of_line"]["alone_s"] > 0 and "rkv" in summary


def test_lengths_are_lognormal_with_std_equal_to_mean():
    bench = _bench()
    lens = bench.lengths(20000, mean=1000, cap=10**9, seed=0)
    mean = sum(lens) / len(lens)
    std = math.sqrt(sum((n - mean) ** 2 for n in lens) / len(lens))
    assert abs(mean / 1000 - 1) < 0.05 and abs(std / mean - 1) < 0.1
    assert min(bench.lengths(100, mean=10, cap=50, seed=1)) >= 16 and max(bench.lengths(100, mean=10, cap=50, seed=1)) <= 50


def test_kv_read_counts_held_slots():
    bench = _bench()
    assert bench.kv_read(4, 3, math.inf) == 4 + 5 + 6
    assert bench.kv_read(4, 3, 5) == 4 + 5 + 5
