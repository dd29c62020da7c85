"""benchmarks/bench_openrlhf_actor_gpu.py runs its tiny CPU configuration end to end: the
scheduler row and the OpenRLHF actor row decode every request to its forced length (the benchmark
raises otherwise) and report tokens/s side by side."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_actor_benchmark_smoke_runs_on_cpu(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_openrlhf_actor_gpu",
                                                  ROOT / "benchmarks" / "bench_openrlhf_actor_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.jsonl"
    summary = bench.main(["--smoke", "--out", str(out), "--policy=streaming_llm"])
    text = capsys.readouterr().out
    assert "streaming_llm scheduler" in text and "streaming_llm OpenRLHF actor" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    timed = [r for r in rows if r["row"] != "summary"]
    assert len(timed) == 2 and all(r["tokens_per_s"] > 0 and 1 <= r["resident"] <= r["plan_rows"] for r in timed)
    assert timed[0]["tokens"] == timed[1]["tokens"] and summary["actor_over_scheduler"] > 0
