"""2-process gloo: sparse_grpo + sparse_rl(group=...) with all-reduced counts on two uneven
shards sums (loss and gradient) to the single-process result on the whole batch; also when one
rank's shard is empty (both ranks stay in every collective)."""

import pytest
import torch
import torch.distributed as dist

from sparsecorr._dist import all_reduce_sum
from sparsecorr.correction import sparse_rl
from sparsecorr.mismatch import measure, mismatch_metrics
from tests.distributed import run_gloo
from tests.unit.losses.helpers import grpo

pytestmark = pytest.mark.dist

SHARDS = [slice(0, 3), slice(3, 8)]


def _batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 12, generator=g) * 3
    rollout = old - torch.randn(8, 12, generator=g) * 0.4
    rollout[2, 1] = float("nan")
    logp = old + torch.randn(8, 12, generator=g) * 0.2
    mask = torch.arange(12)[None] < torch.randint(1, 13, (8,), generator=g)[:, None]
    adv = torch.randn(8, generator=g)
    return logp, old, rollout, mask, adv


def _loss(logp, old, rollout, mask, adv, aggregation, group=None):
    corr = sparse_rl(group=group)(measure(old_logp=old, rollout_logp=rollout, mask=mask))
    kept = corr.mask & mask
    n_tok = all_reduce_sum(kept.sum().float(), group)
    n_seq = all_reduce_sum(kept.any(1).sum().float(), group)
    lp = logp.clone().requires_grad_(True)
    out = grpo(lp, old, adv, mask, rollout_logp=rollout, correction=corr, aggregation=aggregation,
                      num_tokens=n_tok, num_sequences=n_seq, metrics="none")
    out.loss.backward()
    return out.loss.detach(), lp.grad


def _worker(rank: int, world: int, shards=SHARDS) -> dict:
    rows = shards[rank]
    res = {}
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        loss, grad = _loss(*(x[rows] for x in _batch()), aggregation, group=dist.group.WORLD)
        res[aggregation] = (float(loss), grad.tolist())
    return res


def test_two_ranks_sum_to_single_process():
    out = run_gloo(_worker, world=2)
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        loss, grad = _loss(*_batch(), aggregation)
        total = out[0][aggregation][0] + out[1][aggregation][0]
        assert total == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
        grads = torch.cat([torch.tensor(out[r][aggregation][1]) for r in (0, 1)])
        torch.testing.assert_close(grads, grad)


EMPTY = [slice(0, 0), slice(0, 8)]


def _empty_worker(rank: int, world: int) -> dict:
    res = _worker(rank, world, EMPTY)
    shard = [x[EMPTY[rank]] for x in _batch()]
    m = mismatch_metrics(shard[1], shard[2], shard[3], group=dist.group.WORLD)
    res["metrics"] = {k: float(v) for k, v in m.items()}
    return res


def test_an_empty_shard_keeps_both_ranks_in_step_with_the_single_process_result():
    out = run_gloo(_empty_worker, world=2)
    _, old, rollout, mask, _ = _batch()
    whole = mismatch_metrics(old, rollout, mask)
    for rank in (0, 1):
        for name, value in whole.items():
            assert out[rank]["metrics"][name] == pytest.approx(float(value), rel=1e-5, abs=1e-6, nan_ok=True), name
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        loss, grad = _loss(*_batch(), aggregation)
        assert out[0][aggregation][0] == 0.0 and out[0][aggregation][1] == []
        assert out[1][aggregation][0] == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
        torch.testing.assert_close(torch.tensor(out[1][aggregation][1]), grad)
