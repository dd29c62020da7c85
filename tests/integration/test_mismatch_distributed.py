"""2-process gloo test: metrics and sketches reduced over ranks equal the single-process result."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsecorr.mismatch import QuantileSketch, mismatch_metrics

pytestmark = pytest.mark.dist


def _batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 50, generator=g) * 4
    roll = old - torch.randn(6, 50, generator=g) * 0.3
    roll[1, 3] = float("nan")
    mask = torch.rand(6, 50, generator=g) < 0.8
    acc = torch.rand(6, 50, generator=g)
    return old, roll, mask, acc


def _worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        old, roll, mask, acc = _batch()
        rows = [slice(0, 2), slice(2, 6)][rank]  # uneven shards
        d = mismatch_metrics(old[rows], roll[rows], mask[rows], acceptance=acc[rows],
                             group=dist.group.WORLD)
        sk = QuantileSketch(0.0, 1.0, n_buckets=256).update(acc[rows], mask[rows])
        sk.all_reduce(dist.group.WORLD)
        out[rank] = ({k: float(v) for k, v in d.items()}, sk.counts.tolist())
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_equal_single_process():
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    out = manager.dict()
    mp.start_processes(_worker, args=(2, _free_port(), out), nprocs=2, join=True,
                       start_method="spawn")
    old, roll, mask, acc = _batch()
    ref = mismatch_metrics(old, roll, mask, acceptance=acc)
    ref_sketch = QuantileSketch(0.0, 1.0, n_buckets=256).update(acc, mask)
    for rank in (0, 1):
        metrics, counts = out[rank]
        assert set(metrics) == set(ref)
        for k, v in ref.items():
            assert metrics[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
        assert counts == ref_sketch.counts.tolist()
