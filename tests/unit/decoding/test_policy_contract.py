"""The KV policy contract is checked where it is used (`KVPolicy.score`, `KVPolicy.capacity`):
a policy written outside ``src/`` that breaks it gets a ``ValueError`` naming the policy and
the hook, not a torch error deep in ``compress``. What ``score`` receives (the layers stacked
along the batch, layer-major, no layer id) is what its docstring says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from sparsecorr.decoding import generate, teacher_forced_logprobs
from sparsecorr.decoding.policies import compress
from sparsecorr.decoding.policies.base import check_scores
from tests.models import tiny_model
from tests.unit.decoding.toy_policy import EveryOther

LAYERS = 2


@dataclass(frozen=True)
class WrongShape(EveryOther):
    name: ClassVar[str] = "wrong_shape"

    def score(self, *, keys, queries, valid, positions, query_valid=None):
        return (positions % 2 == 0).float()[..., :-1]  # one slot short


@dataclass(frozen=True)
class NumpyScore(EveryOther):
    name: ClassVar[str] = "numpy_score"

    def score(self, *, keys, queries, valid, positions, query_valid=None):
        return (positions % 2 == 0).float().numpy()


@dataclass(frozen=True)
class IntScore(EveryOther):
    name: ClassVar[str] = "int_score"

    def score(self, *, keys, queries, valid, positions, query_valid=None):
        return (positions % 2 == 0).long()


@dataclass(frozen=True)
class TooSmall(EveryOther):
    name: ClassVar[str] = "too_small"

    def capacity(self, table, *, longest, chunk):
        return 3  # one page of 16 slots: less than budget 16 + buffer 4 + a chunk


@dataclass(frozen=True)
class Recorder(EveryOther):
    """Records the shapes ``score`` receives (a test-only side effect)."""

    name: ClassVar[str] = "recorder"
    seen: list = None

    def score(self, *, keys, queries, valid, positions, query_valid=None):
        self.seen.append((tuple(keys.shape), tuple(valid.shape), tuple(positions.shape)))
        return super().score(keys=keys, queries=queries, valid=valid, positions=positions)


def _generate(policy, *, budget=6):
    model = tiny_model("qwen3", num_layers=LAYERS)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (3, 12), generator=g)
    return generate(model, ids, torch.ones_like(ids), policy=policy, budget=budget, max_new_tokens=10,
                    temperature=0, backend="torch", logprobs_topk=0, prefill_chunk=4)


@pytest.mark.parametrize("cls,what", [(WrongShape, r"shape \(6, 2, 11\)"),
                                      (NumpyScore, "numpy.ndarray"),
                                      (IntScore, "torch.int64")])
def test_a_bad_score_names_the_policy_and_the_hook(cls, what):
    """Wrong shape, a numpy array, an integer dtype: a ValueError naming ``Class(name=...).score``
    with what was expected (the stacked ``[L·B, H_kv, S]`` shape) and what came back."""
    with pytest.raises(ValueError, match=rf"{cls.__name__}\(name='{cls.name}'\)\.score: expected a "
                                         rf"floating-point torch\.Tensor of shape \(6, 2, 12\)") as err:
        _generate(cls())
    assert "L·B, H_kv, S" in str(err.value)
    assert pytest.importorskip("re").search(what, str(err.value)), str(err.value)


def test_a_too_small_capacity_names_the_policy_and_the_hook():
    with pytest.raises(ValueError, match=r"TooSmall\(name='too_small'\)\.capacity: expected at least 17 "
                                         r"slots per row \(a forward needs them\), got a pool of 16"):
        _generate(TooSmall(), budget=16)


def test_a_too_small_capacity_is_refused_in_a_graph_steps_plan_too():
    """A CUDA-graph step plans at the pool's fixed size (``static=True``, kv_len = capacity), so
    the forward's own slot count is checked in `Engine.plan`, on every path."""
    from sparsecorr.decoding.backends import select_backend
    from sparsecorr.decoding.engine import Engine

    model = tiny_model("qwen3", num_layers=LAYERS)
    policy = TooSmall()
    table = torch.full((64,), 16, dtype=torch.long)
    back, _ = select_backend("torch", device=torch.device("cpu"), dtype=torch.float32, head_dim=16, group_size=1)
    engine = Engine(model, policy=policy, backend=back, table=table, batch=2, capacity=3, grad=False)
    engine.count = torch.tensor([16, 3])  # the pool's 16 slots are full in row 0
    with pytest.raises(ValueError, match=r"TooSmall\(name='too_small'\)\.capacity: expected at least 17"):
        engine.plan(1, torch.tensor([1, 1]), decode=True, static=True)
    engine.close()


def test_a_small_capacity_that_fits_runs():
    """The pool is whole pages: capacity 3 is 16 slots, enough at budget 6 + buffer 4 + chunk 4."""
    ref, out = _generate(EveryOther()), _generate(TooSmall())
    assert torch.equal(ref.tokens, out.tokens)


@pytest.mark.parametrize("grad", [False, True])
def test_score_receives_the_layers_stacked(grad):
    """One compression event scores every layer in one call (``[L·B, H_kv, S]``), or one layer
    at a time with autograd on (``[B, H_kv, S]``), as `KVPolicy.score` says."""
    seen: list = []
    policy = Recorder(seen=seen)
    out = _generate(policy)
    if grad:  # the per-layer path: teacher forcing with autograd
        seen.clear()
        model = tiny_model("qwen3", num_layers=LAYERS)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 128, (3, 12), generator=g)
        teacher_forced_logprobs(model, ids, out.tokens, policy=policy, budget=6, response_mask=out.mask,
                                temperature=0, backend="torch", logprobs_topk=0, prefill_chunk=4, grad=True)
    n = 1 if grad else LAYERS
    assert seen and all(k[0] == n * 3 and v == p == k[:3] for k, v, p in seen), seen


def test_check_scores_directly():
    valid = torch.ones(2, 1, 5, dtype=torch.bool)
    policy = EveryOther()
    check_scores(policy, torch.zeros(2, 1, 5, dtype=torch.bfloat16), valid)
    for bad in (torch.zeros(2, 1, 4), torch.zeros(2, 1, 5, dtype=torch.bool), [0.0] * 10, None):
        with pytest.raises(ValueError, match=r"EveryOther\(name='every_other'\)\.score"):
            check_scores(policy, bad, valid)
    keys = torch.randn(2, 1, 5, 4)
    with pytest.raises(ValueError, match=r"WrongShape\(name='wrong_shape'\)\.score"):
        compress(WrongShape(), keys=keys, queries=keys[:, :, :0], valid=valid,
                 positions=torch.arange(5).expand(2, 1, 5), budget=3)
