"""Sparse rollouts on sharded policies on a CUDA GPU (marker ``gpu``): DeepSpeed ZeRO-3 and FSDP v1
need CUDA (DeepSpeed is not installed in the CPU environments; FSDP v1 refuses a CPU-only
machine), and FSDP v2 runs here with the CUDA graphs and the fused step that the CPU test
(tests/integration/trl/test_fsdp.py) cannot capture.

Each test shards the tiny Qwen3 in one process (world size 1: the gather path runs whole, it
only has one shard to gather), samples through ``sparsecorr_trl.gather.full_parameters`` with
graphs on, and finds the unsharded model's rollouts (same weights, same seed), the graphs and the
fused step on, no all-gather inside ``generate``, and the sharded model still trainable after.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from sparsecorr_trl.gather import full_parameters
from sparsecorr_trl.rollout import sparse_rollouts

from sparsecorr.decoding import StreamingLLM
from tests.distributed import free_port
from tests.models import tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23]]
GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_gather_coalesced")


@pytest.fixture
def one_rank():
    """A world of one process on this GPU (nccl), torn down after the test."""
    import torch.distributed as dist

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _accelerator(unwrap, *, zero_stage: int = 0, fsdp_version: int | None = None):
    """What ``full_parameters`` reads of an ``accelerate.Accelerator``."""
    state = SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage) if zero_stage else None,
        fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version) if fsdp_version else None)
    return SimpleNamespace(state=state, unwrap_model=unwrap)


def _sample(model):
    return sparse_rollouts(model, PROMPTS, policy=StreamingLLM(sink=1, buffer=2), budget=4,
                           max_new_tokens=16, eos_token_id=[2], pad_token_id=0,
                           generator=torch.Generator().manual_seed(0),
                           sampling={"temperature": 1.0, "top_k": None, "top_p": None},
                           cuda_graph=True, backend="torch")


@contextlib.contextmanager
def _counting_gathers(counts: dict):
    import torch.distributed as dist

    saved = {n: getattr(dist, n) for n in GATHERS if hasattr(dist, n)}

    def counted(fn):
        def call(*a, **kw):
            counts["n"] += 1
            return fn(*a, **kw)
        return call

    for name, fn in saved.items():
        setattr(dist, name, counted(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _check(wrapped, accelerator, reference):
    counts = {"n": 0}
    with full_parameters(wrapped, accelerator) as model, _counting_gathers(counts):
        out = _sample(model)
    assert (out.cuda_graph, out.fused) == ("on", "on"), (out.cuda_graph, out.fused)
    assert counts["n"] == 0, f"{counts['n']} all-gathers inside generate"
    assert out.completions == reference.completions
    for a, b in zip(out.logprobs, reference.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def _reference():
    model = tiny_model("qwen3", vocab_size=64).cuda()
    out = _sample(model)
    assert (out.cuda_graph, out.fused) == ("on", "on")
    return out


def test_zero3_rollouts_gather_once_and_equal_the_unsharded_model(one_rank):
    deepspeed = pytest.importorskip("deepspeed")
    reference = _reference()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=tiny_model("qwen3", vocab_size=64), config=config)
    accelerator = _accelerator(lambda m: m.module, zero_stage=3)
    _check(engine, accelerator, reference)
    loss = engine(torch.tensor([[5, 6, 7]], device="cuda")).logits.float().sum()
    engine.backward(loss)  # ZeRO-3's hooks are back: the engine still trains
    engine.step()


def test_fsdp1_rollouts_gather_once_and_equal_the_unsharded_model(one_rank):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    reference = _reference()
    wrapped = FSDP(tiny_model("qwen3", vocab_size=64).cuda(), use_orig_params=True,
                   auto_wrap_policy=ModuleWrapPolicy({Qwen3DecoderLayer}), device_id=0)
    _check(wrapped, _accelerator(lambda m: m.module, fsdp_version=1), reference)
    wrapped(torch.tensor([[5, 6, 7]], device="cuda")).logits.sum().backward()


def test_fsdp2_rollouts_gather_once_and_equal_the_unsharded_model(one_rank):
    from torch.distributed.fsdp import fully_shard
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    reference = _reference()
    model = tiny_model("qwen3", vocab_size=64).cuda()
    for layer in model.modules():
        if isinstance(layer, Qwen3DecoderLayer):
            fully_shard(layer)
    fully_shard(model)
    _check(model, _accelerator(lambda m: m, fsdp_version=2), reference)
    model(torch.tensor([[5, 6, 7]], device="cuda")).logits.sum().backward()
