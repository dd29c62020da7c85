"""``accelerate launch --num_processes 2`` on CPU (gloo): SparseGRPOTrainer's loss, grad norm,
TRL metrics and parameters equal one process on the same global batch (global token counts)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
import psutil  # accelerate's dependency: finds the launcher's ranks on a timeout
from safetensors.torch import load_file

from tests.distributed import free_port

pytestmark = [pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[3]
WORKER = "tests/integration/trl/dist_worker.py"
TIMEOUT_S = 240  # a run takes ~15 s alone, ~60 s on a loaded 2-core CI machine
COMPARED = ("loss", "grad_norm", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "sparsecorr/correction/kept_token_frac")


def _launch(out: Path, loss_type: str, processes: int) -> tuple[list[dict], dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *(p for p in sys.path if p)]), "OMP_NUM_THREADS": "1"}
    if processes == 1:
        cmd = [sys.executable, WORKER]
    else:
        # torchrun-style launch; use_cpu=True makes accelerate join the processes with gloo
        # a free port of our own: a rank left over from another run cannot join this one
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(processes), "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", str(free_port()), WORKER]
    # its own session, so a timeout kills the launcher's process group, and its ranks, which
    # torch's elastic agent starts in sessions of their own (an orphaned rank holds the pipes
    # open: a whole CI run once hung on one)
    proc = subprocess.Popen([*cmd, str(out), loss_type, "8"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        ranks = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()
        try:  # never wait on the pipes unbounded
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired as late:
            stderr = late.stderr if isinstance(late.stderr, str) else (late.stderr or b"").decode(errors="replace")
        pytest.fail(f"{processes}-process run still alive after {TIMEOUT_S} s (one run takes "
                    f"~15 s); stderr tail:\n{stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    log = json.loads((out / "log.json").read_text())
    assert log["world"] == processes and (processes == 1 or log["backend"] == "gloo"), log
    return log["rows"], load_file(str(out / "params.safetensors"))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
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
