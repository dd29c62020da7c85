"""The CPU's host-decided fast paths (every log-ratio finite and within ±20, no veto possible,
every learner token finite) give what the general path gives: the same batch with a NaN or
±inf placed *outside* the mask (which forces the general path and must change nothing)."""

import pytest
import torch

from sparsecorr.correction import sparse_rl, tis
from sparsecorr.losses import sparse_grpo


def _batch(seed: int = 0, b: int = 6, t: int = 40):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    roll = old - 0.3 * torch.randn(b, t, generator=g)
    logp = old + 0.05 * torch.randn(b, t, generator=g)
    lengths = torch.randint(t // 2, t, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    return old, roll, logp, torch.randn(b, generator=g), mask


def _run(old, roll, logp, adv, mask, correction, metrics):
    lp = logp.clone().requires_grad_(True)
    out = sparse_grpo(lp, old, adv, mask, rollout_logp=roll, correction=correction, metrics=metrics)
    out.loss.backward()
    return out, lp.grad


@pytest.mark.parametrize("correction", [None, "sparse_rl", "tis"])
@pytest.mark.parametrize("metrics", ["default", "full"])
@pytest.mark.parametrize("poison", ["old", "rollout", "logp"])
def test_nonfinite_outside_the_mask_changes_nothing(correction, metrics, poison):
    make = {None: lambda: None, "sparse_rl": sparse_rl, "tis": tis}[correction]
    old, roll, logp, adv, mask = _batch()
    fast, g_fast = _run(old, roll, logp, adv, mask, make(), metrics)
    pad = (~mask).nonzero()[0].tolist()
    tensors = {"old": old.clone(), "rollout": roll.clone(), "logp": logp.clone()}
    tensors[poison][pad[0], pad[1]] = float("nan")
    tensors[poison][pad[0], -1] = -float("inf")
    slow, g_slow = _run(tensors["old"], tensors["rollout"], tensors["logp"], adv, mask, make(), metrics)
    torch.testing.assert_close(slow.loss, fast.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_slow, g_fast, rtol=1e-6, atol=1e-9)
    assert torch.equal(slow.mask, fast.mask)
    assert slow.metrics.keys() == fast.metrics.keys()
    for k in fast.metrics:
        torch.testing.assert_close(slow.metrics[k], fast.metrics[k], rtol=1e-5, atol=1e-6, equal_nan=True,
                                   msg=lambda m, k=k: f"{k}: {m}")


def test_log_ratios_beyond_the_clamp_and_a_vetoed_row_match_the_general_path():
    old, roll, logp, adv, mask = _batch(seed=3)
    roll[0, 0] = old[0, 0] + 30.0  # ratio e^-30: below the clamp, and it vetoes row 0
    roll[1, 1] = old[1, 1] - 25.0  # above the clamp
    mask[0, 0] = mask[1, 1] = True
    fast, g_fast = _run(old, roll, logp, adv, mask, sparse_rl(), "default")
    roll2 = roll.clone()
    roll2[2, -1] = float("nan")  # outside the mask (rows are shorter than t)
    assert not mask[2, -1]
    slow, g_slow = _run(old, roll2, logp, adv, mask, sparse_rl(), "default")
    assert float(fast.metrics["correction/vetoed_seqs"]) == 1.0
    assert not fast.mask[0].any()
    torch.testing.assert_close(slow.loss, fast.loss)
    torch.testing.assert_close(g_slow, g_fast)
    for k in fast.metrics:
        torch.testing.assert_close(slow.metrics[k], fast.metrics[k], equal_nan=True)
