"""The metric sums of every stage have the same keys, in the same order, whatever the data: ranks
all-reduce them as one vector (``reduce_metrics(sums, group)``), so a rank whose batch has NaNs, an
empty veto or non-finite advantages must not change the layout."""

import pytest
import torch

from sparsecorr.correction import chain, icepop, sparse_rl, tis, veto
from sparsecorr.losses import sparse_grpo
from sparsecorr.mismatch import measure, mismatch_sums


@pytest.fixture
def layouts():
    return []


def _batches():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 9, generator=g)
    roll = old + 0.1 * torch.randn(4, 9, generator=g)
    logp = old + 0.01 * torch.randn(4, 9, generator=g)
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, 6:] = False
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    clean = (old, roll, logp, adv, mask)
    o2, r2, l2, a2 = old.clone(), roll.clone(), logp.clone(), adv.clone()
    r2[0, 2] = float("nan")  # a dropped rollout token
    r2[2, 3] = old[2, 3] + 30.0  # a vetoed row, a log-ratio beyond the clamp
    l2[3, 4] = float("inf")  # a dropped learner token
    a2[1] = float("nan")  # a non-finite advantage
    return clean, (o2, r2, l2, a2, mask)


CORRECTIONS = {"none": None, "sparse_rl": sparse_rl, "tis": tis,
               "chain": lambda: chain(tis(cap=2.0), icepop(0.5, 2.0), veto(1e-4))}


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
@pytest.mark.parametrize("metrics", ["default", "full"])
def test_the_loss_plan_layout_does_not_depend_on_the_data(layouts, name, metrics):
    for old, roll, logp, adv, mask in _batches():
        make = CORRECTIONS[name]
        out = sparse_grpo(logp.clone().requires_grad_(True), old, adv, mask, rollout_logp=roll,
                          correction=None if make is None else make(), metrics=metrics)
        layouts.append(tuple(out.sums))
    assert len(layouts) == 2 and layouts[0] == layouts[1]


@pytest.mark.parametrize("name", ["sparse_rl", "tis", "chain"])
def test_the_correction_and_record_plan_layouts_do_not_depend_on_the_data(layouts, name):
    for old, roll, _, _, mask in _batches():
        mm = measure(old, roll, mask)
        layouts.append(tuple(CORRECTIONS[name]()(mm).metric_sums(full=True)))
        layouts.append(tuple(mismatch_sums(mm, full=True)))
    assert len(layouts) == 4 and layouts[0] == layouts[2] and layouts[1] == layouts[3]
