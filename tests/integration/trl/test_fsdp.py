"""Sparse rollouts under FSDP2 (``fully_shard``) on 2 CPU processes (gloo): SparseGRPOTrainer's
rollouts, losses and trained parameters equal one unsharded process on the same global batch,
and the shards are gathered once per rollout, never inside the sampler's ``generate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("psutil")
from safetensors.torch import load_file

from tests.distributed import launch

pytestmark = [pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[3]
WORKER = "tests/integration/trl/fsdp_worker.py"
TIMEOUT_S = 240  # a run takes ~20 s alone


def _run(out: Path, processes: int, fsdp: int) -> dict:
    code, stderr = launch(WORKER, [str(out), "8", str(fsdp)], processes=processes, cwd=ROOT,
                          timeout_s=TIMEOUT_S)
    assert code is not None, f"{processes}-process run alive after {TIMEOUT_S} s:\n{stderr[-4000:]}"
    assert code == 0, stderr[-4000:]
    log = json.loads((out / "log.json").read_text())
    log["params"] = load_file(str(out / "params.safetensors"))
    return log


def test_fsdp2_sparse_rollouts_equal_one_process(tmp_path):
    one = _run(tmp_path / "one", 1, 0)
    two = _run(tmp_path / "two", 2, 2)
    assert (one["world"], one["fsdp"]) == (1, None)
    assert (two["world"], two["fsdp"], two["backend"]) == (2, 2, "gloo"), two
    assert two["wrapped"].startswith("FSDP") and two["distributed_type"].endswith("FSDP")
    # the same global batch of rollouts, token for token, with the sampler's log-probs
    a = {(r["step"], r["index"]): r for r in one["rollouts"]}
    b = {(r["step"], r["index"]): r for r in two["rollouts"]}
    assert sorted(a) == sorted(b) and len(a) == 16
    for key, row in a.items():
        assert b[key]["completion"] == row["completion"], key
        torch.testing.assert_close(torch.tensor(b[key]["logprobs"]), torch.tensor(row["logprobs"]),
                                   atol=1e-5, rtol=0)
    # gathered once per rollout (one all-gather per FSDP parameter group), none while decoding
    gathers = {r["gathers"] for r in two["rollouts"]}
    assert len(gathers) == 1 and gathers.pop() > 0, gathers
    assert all(r["gathers_in_generate"] == 0 for r in two["rollouts"])
    assert all(r["gathers"] == 0 for r in one["rollouts"])
    assert len(one["rows"]) == len(two["rows"]) == 2
    for step, (x, y) in enumerate(zip(one["rows"], two["rows"], strict=True), start=1):
        for key in ("loss", "grad_norm", "entropy"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (step, key)
    assert sorted(one["params"]) == sorted(two["params"])
    for name, p in one["params"].items():
        torch.testing.assert_close(two["params"][name], p, atol=1e-6, rtol=0)
