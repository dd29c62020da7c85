"""benchmarks/bench_decode_kernels.py --smoke runs (as a subprocess) and its counts are sane."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # ~100 s idle (two fused compiles); make test-slow (CI) runs it
def test_decode_kernel_benchmark_smoke(tmp_path):
    out = tmp_path / "counts.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode_kernels.py"), "--smoke",
                          "--json", str(out)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    for heading in ("eager decode step", "one compression event", "fused step (compile)"):
        assert heading in run.stdout
    res = json.loads(out.read_text())
    step = {r["policy"]: r for r in res["step"]}
    assert all(not r["ragged"] for r in res["step"])
    assert {"Dense", "StreamingLLM", "SnapKV", "RKV", "BlockTopK"} <= set(step)
    hf = {r["per_layer"]["hf"] for r in res["step"]}
    assert len(hf) == 1 and 20 <= hf.pop() <= 80  # HF's eager Qwen3 layer: the same for every policy
    for r in res["step"]:
        per, once = r["per_layer"], r["once_per_step"]
        assert per["ours"] == int(per["ours"]) and per["ours"] >= 2  # K/V write + attention at least
        assert per["other"] == 0 and once["hf"] > 0 and once["ours"] > 0
        assert r["per_layer_where"]  # attributed to functions
        # sparsecorr::write_kv: two scatters here, one kernel on CUDA (a layer's K/V write)
        assert per["ours_on_cuda"] == per["ours"] - 1
    assert step["Dense"]["per_layer"]["ours"] <= step["SnapKV"]["per_layer"]["ours"]
    assert step["BlockTopK"]["per_layer"]["ours"] > step["Dense"]["per_layer"]["ours"]
    # BlockTopK's selection on the paged path: group-mean query, baddbmm, top-k, the table write (2)
    assert res["paged_selection"]["per_layer"] == 5 and "BlockTopK on the paged path" in run.stdout
    fused = {r["policy"]: r for r in res["fused"]}
    assert set(fused) == {"Dense", "RKV"}
    for name, r in fused.items():
        per = r["per_layer"]
        assert per["extern"] == 7 and per["custom"] == 1  # q, k, v, o, gate, up, down; sparsecorr::attend
        assert 1 <= per["inductor"] <= 12 and per["aten"] == 0  # HF's 53 elementwise ops, fused
        assert per["in_custom_op"] == step[name]["per_layer"]["ours"]  # the op runs the eager step's own ops
        assert per["total_on_cuda"] == per["total"] - 1  # its K/V write: one kernel on CUDA
        assert per["total"] < step[name]["per_layer"]["hf"] and r["compile_s"] > 0
    assert fused["Dense"]["per_layer"]["total"] <= 16
    comp = {r["policy"]: r for r in res["compress"]}
    for name in ("StreamingLLM", "SnapKV", "RKV"):
        for device in ("cpu", "meta"):
            c = comp[name][device]
            assert c["ops"] > 5 and c["bytes"] > 0 and c["ratio"] > 0.5
    assert comp["RKV"]["meta"]["ops"] >= comp["SnapKV"]["meta"]["ops"] >= comp["StreamingLLM"]["meta"]["ops"]
    assert comp["RKV"]["meta"]["ratio"] < 20  # the closed form: no float32 copies of the keys on CUDA
    event = next(r for r in res["compress"] if r["policy"].startswith("RKV, event"))
    assert event["meta"]["layers"] == 28 and event["meta"]["ops"] <= 25  # the batched event, per layer
    assert event["cpu"]["ops"] > event["meta"]["ops"] and event["meta"]["ratio"] < comp["RKV"]["meta"]["ratio"] + 1
