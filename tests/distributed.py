"""Run a function on several CPU ranks (gloo, loopback) and collect what each rank returns."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "launch", "run_gloo"]


def free_port() -> int:
    """A loopback port nothing listens on now (for a rendezvous of our own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[[int, int], Any], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a collective that a rank never joins (ranks out of step) fails the test instead of hanging it
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        out[rank] = fn(rank, world)
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable[[int, int], Any], world: int = 2) -> dict[int, Any]:
    """``{rank: fn(rank, world)}`` from ``world`` spawned processes sharing a gloo group.

    ``fn`` must be a module-level function (spawned processes import it) returning picklable data.
    """
    out = mp.get_context("spawn").Manager().dict()
    mp.start_processes(_entry, args=(world, free_port(), fn, out), nprocs=world, join=True,
                       start_method="spawn")
    return dict(out)


def launch(script: str, args: Sequence[str], *, processes: int, cwd: Path,
           timeout_s: float) -> tuple[int | None, str]:
    """Run ``script args`` under ``accelerate launch`` with ``processes`` CPU ranks joined by gloo
    (plain ``python`` for 1) and return ``(returncode, stderr)``; ``returncode`` is None when the
    run was still alive after ``timeout_s`` and was killed, launcher and ranks.

    The launcher runs in a session of its own on a free port of its own (a rank left over from
    another run cannot join); torch's elastic agent starts the ranks in sessions of their own,
    so on a timeout they are found and killed one by one (an orphaned rank holds the pipes open),
    and the pipes are never waited on unbounded.
    """
    import psutil  # accelerate's dependency

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), *(p for p in sys.path if p)]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, script]
    if processes > 1:  # torchrun-style launch; use_cpu=True makes accelerate join them with gloo
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
               "no", "--main_process_port", str(free_port()), script]
    proc = subprocess.Popen([*cmd, *args], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stderr
    except subprocess.TimeoutExpired:
        ranks = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired as late:
            stderr = late.stderr if isinstance(late.stderr, str) else (late.stderr or b"").decode(errors="replace")
        return None, stderr
