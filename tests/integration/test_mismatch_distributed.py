"""2-process gloo test: metrics and sketches reduced over ranks equal the single-process result."""

import pytest
import torch
import torch.distributed as dist

from sparsecorr.mismatch import QuantileSketch, mismatch_metrics
from tests.distributed import run_gloo

pytestmark = pytest.mark.dist


def _batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 50, generator=g) * 4
    roll = old - torch.randn(6, 50, generator=g) * 0.3
    roll[1, 3] = float("nan")
    mask = torch.rand(6, 50, generator=g) < 0.8
    acc = torch.rand(6, 50, generator=g)
    return old, roll, mask, acc


def _worker(rank: int, world: int) -> tuple[dict, list]:
    old, roll, mask, acc = _batch()
    rows = [slice(0, 2), slice(2, 6)][rank]  # uneven shards
    d = mismatch_metrics(old[rows], roll[rows], mask[rows], acceptance=acc[rows],
                         group=dist.group.WORLD)
    sk = QuantileSketch(0.0, 1.0, n_buckets=256).update(acc[rows], mask[rows])
    sk.all_reduce(dist.group.WORLD)
    return {k: float(v) for k, v in d.items()}, sk.counts.tolist()


def test_two_ranks_equal_single_process():
    out = run_gloo(_worker, world=2)
    old, roll, mask, acc = _batch()
    ref = mismatch_metrics(old, roll, mask, acceptance=acc)
    ref_sketch = QuantileSketch(0.0, 1.0, n_buckets=256).update(acc, mask)
    for rank in (0, 1):
        metrics, counts = out[rank]
        assert set(metrics) == set(ref)
        for k, v in ref.items():
            assert metrics[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
        assert counts == ref_sketch.counts.tolist()
