"""``accelerate launch --num_processes 2`` on CPU (gloo): SparseGRPOTrainer's loss, grad norm,
TRL metrics and parameters equal one process on the same global batch (global token counts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("psutil")  # accelerate's dependency: finds the launcher's ranks on a timeout
from safetensors.torch import load_file

from tests.distributed import launch

pytestmark = [pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[3]
WORKER = "tests/integration/trl/dist_worker.py"
TIMEOUT_S = 240  # a run takes ~15 s alone, ~60 s on a loaded 2-core CI machine
COMPARED = ("loss", "grad_norm", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "sparsecorr/correction/kept_token_frac")


def _launch(out: Path, loss_type: str, processes: int) -> tuple[list[dict], dict]:
    # its own port and session; on a timeout the launcher and its ranks are killed and the
    # pipes never waited on unbounded (an orphaned rank once hung a whole CI run)
    code, stderr = launch(WORKER, [str(out), loss_type, "8"], processes=processes, cwd=ROOT,
                          timeout_s=TIMEOUT_S)
    if code is None:
        pytest.fail(f"{processes}-process run still alive after {TIMEOUT_S} s (one run takes "
                    f"~15 s); stderr tail:\n{stderr[-4000:]}")
    assert code == 0, stderr[-4000:]
    log = json.loads((out / "log.json").read_text())
    assert log["world"] == processes and (processes == 1 or log["backend"] == "gloo"), log
    return log["rows"], load_file(str(out / "params.safetensors"))


# dapo (a second loss type over the same two-process path, ~17 s idle) runs with -m slow
@pytest.mark.parametrize("loss_type", [pytest.param("dapo", marks=pytest.mark.slow), "grpo"])
def test_two_processes_equal_one_on_the_same_global_batch(tmp_path, loss_type):
    one_rows, one_params = _launch(tmp_path / "one", loss_type, 1)
    two_rows, two_params = _launch(tmp_path / "two", loss_type, 2)
    assert len(one_rows) == len(two_rows) == 2
    kept = [r["sparsecorr/correction/kept_token_frac"] for r in one_rows]
    assert all(k < 1.0 for k in kept), "the correction must reject tokens for the test to bite"
    for step, (a, b) in enumerate(zip(one_rows, two_rows, strict=True), start=1):
        for key in COMPARED:
            if key.startswith("sparsecorr/"):
                continue  # sparsecorr's own metrics are per process (logged means of ranks)
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (step, key)
    for name, p in one_params.items():
        torch.testing.assert_close(two_params[name], p, atol=1e-6, rtol=0)
