"""Run a function on several CPU ranks (gloo, loopback) and collect what each rank returns."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_gloo"]


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
