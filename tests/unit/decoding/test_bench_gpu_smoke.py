"""benchmarks/bench_decoding_gpu.py imports and runs its tiny CPU configuration (what the GPU
run executes, on a 2-layer model)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

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


def _bench():
    spec = importlib.util.spec_from_file_location("bench_decoding_gpu", ROOT / "benchmarks" / "bench_decoding_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_gpu_benchmark_records_what_ran(tmp_path, capsys):
    """Each decode cell records the backend and CUDA-graph mode that actually ran; an eager
    fallback under --cuda-graph is flagged; capture time is kept out of the per-token time."""
    bench = _bench()
    out = tmp_path / "cells.jsonl"
    bench.main(["--smoke", "--out", str(out), "--no-tf"])
    cells = [json.loads(line) for line in out.read_text().splitlines()]
    ours = [c for c in cells if c.get("decoder") not in (None, "HF generate (sdpa)")]
    assert len(ours) == 5 and all(c["backend"] == "torch" and c["cuda_graph"] == "off" for c in ours)
    assert not any(c["graph_fallback"] for c in ours)

    out = SimpleNamespace(peak_kv_bytes=2**20, meta={
        "backend": "flashinfer", "cuda_graph": "failed: RuntimeError", "kv_pool_bytes": 2**20,
        "graph_captures": 0, "capture_s": 0.0, "decode_s": 1.0})

    report = bench.Report("GPU", str(tmp_path / "r.jsonl"), cuda_graph=True)
    report.decode("m", 1, 8, "RKV", 0.01, 0, None, None, out)
    rec = json.loads((tmp_path / "r.jsonl").read_text())
    assert rec["graph_fallback"] and rec["backend"] == "flashinfer" and "EAGER FALLBACK" in report.rows[0][-1]
    meta = {"decode_s": 3.0, "capture_s": 1.0}
    assert bench.decode_seconds_per_token(meta, 5) == 0.5


def test_gpu_benchmark_measures_what_it_claims(tmp_path, capsys, monkeypatch):
    """Issue 34: every cell starts from a clean memory state (one ``clean`` per measured call),
    the teacher-forcing reference computes the response positions' logits only (``logits_to_keep``:
    Dense teacher forcing equals it), and sparse rows give their peak against Dense's."""
    bench = _bench()
    cleans, keeps = [], []
    real_clean = bench.clean
    monkeypatch.setattr(bench, "clean", lambda device: cleans.append(1) or real_clean(device))
    from transformers import Qwen3ForCausalLM

    real_forward = Qwen3ForCausalLM.forward

    def forward(self, *a, logits_to_keep=0, **kw):
        keeps.append(logits_to_keep)
        return real_forward(self, *a, logits_to_keep=logits_to_keep, **kw)

    monkeypatch.setattr(Qwen3ForCausalLM, "forward", forward)
    out = tmp_path / "cells.jsonl"
    bench.main(["--smoke", "--out", str(out)])
    capsys.readouterr()
    cells = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(cleans) >= len(cells) + 1  # each measured call, plus the weights
    tf = {c["path"]: c for c in cells if "path" in c}
    assert tf["Dense"]["mad_vs_full"] < 1e-5  # the response-only reference is the right one
    n = tf["full forward"]["tf_tokens"]
    assert n + 1 in keeps  # the reference's forwards asked for the response positions only
    decode = {c["decoder"]: c for c in cells if "decoder" in c}
    assert decode["Dense"]["peak_vs_dense"] is None and all(c["held_mib"] == 0.0 for c in decode.values())
    report = bench.Report("fake", None)
    report.weights = 1 << 30
    report.decode("m", 8, 4096, "RKV", 0.005, 2 << 30, 0.1, 0.01, None, dense_peak=9 << 30)
    assert report.rows[-1][8] == "0.125"
