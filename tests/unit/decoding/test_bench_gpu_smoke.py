"""benchmarks/bench_decoding_gpu.py imports and runs its tiny CPU configuration (what the GPU
run executes, on a 2-layer model)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_gpu_benchmark_smoke_runs_on_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_decoding_gpu", ROOT / "benchmarks" / "bench_decoding_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cells.jsonl"
    bench.main(["--smoke", "--out", str(out)])
    text = capsys.readouterr().out
    for name in ("HF generate (sdpa)", "Dense", "StreamingLLM", "SnapKV", "RKV", "BlockTopK", "full forward"):
        assert name in text
    cells = [json.loads(line) for line in out.read_text().splitlines()]
    decode = [c for c in cells if "decoder" in c]
    assert len(decode) == 6 and all(isinstance(c["s_per_token"], float) and c["s_per_token"] > 0 for c in decode)
    tf = {c["path"]: c for c in cells if "path" in c}
    assert set(tf) == {"full forward", "Dense", "RKV"}
    assert bench.SHAPES["qwen3-0.6b"]["num_hidden_layers"] == 28
