"""The fused decode step on a CUDA GPU (marker ``gpu``; issue 36): the captured step's forward
compiled by inductor (Triton kernels, no inductor CUDA graphs) and captured in our CUDA graph.

The CPU parity tests (tests/unit/decoding/test_fused.py) run the same compiled forward through
the eager stand-in runner; what only a GPU shows is checked here: the compile happens in the
warm-up on the capture stream and the Triton code captures ("on", not a fallback), the fused
replay gives the unfused replay's log-probs under the same kept sets, one compile serves the
batch buckets above 1, and a fused step launches fewer kernels than the unfused one.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from sparsecorr.decoding import RKV, BlockTopK, Dense, SnapKV, StreamingLLM, generate
from tests.gpu.test_decoding_gpu import _mad, _model, _prompts, _replay_logp

pytestmark = pytest.mark.gpu
POLICIES = [Dense(), StreamingLLM(buffer=16), SnapKV(buffer=16), RKV(buffer=16), BlockTopK(dense_layers=1)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_fused_graph_step_equals_the_unfused_graph_step(policy):
    """bf16, torch backend: replaying the unfused graph run's tokens through the fused graph step
    under its kept sets gives its log-probs (MAD < 1e-2, the graph step's own bound: inductor's
    fused norms round differently in bf16); the fused step captured ("on")."""
    model = _model()
    ids, am = _prompts(seed=2)
    kw = dict(policy=policy, budget=256, max_new_tokens=48, temperature=0, backend="torch", prefill_chunk=256)
    ref = generate(model, ids, am, cuda_graph=True, fused=False, record_keep=policy.evicts, **kw)
    assert (ref.meta["cuda_graph"], ref.meta["fused"]) == ("on", "off")
    replay, status = _replay_logp(model, ids, am, ref.tokens, policy=policy, budget=256, backend="torch",
                                  cuda_graph=True, keep_sets=ref.kept_sets if policy.evicts else None, fused=True)
    assert status == "on"
    assert _mad(ref.rollout_logp, replay, ref.mask) < 1e-2
    got = generate(model, ids, am, cuda_graph=True, fused=True, **kw)
    assert (got.meta["cuda_graph"], got.meta["fused"]) == ("on", "on"), got.meta["fused"]
    same = (ref.tokens == got.tokens) & ref.mask & got.mask
    prefix = same.long().cumprod(1).bool()
    assert bool(prefix[:, 0].all())
    assert _mad(ref.rollout_logp, got.rollout_logp, prefix) < 1e-2


def test_one_compile_for_the_buckets_and_fewer_kernels():
    """Rows leaving the batch (EOS) shrink it through several buckets with at most two compiles
    (buckets above 1, and 1); a fused step launches fewer kernels than an unfused one."""
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    model = _model(layers=2)
    ids, am = _prompts(b=8, p=64, seed=3)
    kw = dict(policy=RKV(buffer=16), budget=32, max_new_tokens=24, temperature=0, cuda_graph=True)
    before = counters["stats"]["unique_graphs"]
    out = generate(model, ids, am, fused=True, eos_token_id=list(range(5, 100)), **kw)
    assert out.meta["fused"] == "on" and out.meta["graph_captures"] >= 2
    assert counters["stats"]["unique_graphs"] - before <= 2

    def kernels(steps, fused):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(model, ids, am, fused=fused, **{**kw, "max_new_tokens": steps})
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)

    per_step = {}
    for fused in (False, True):
        kernels(2, fused)
        per_step[fused] = kernels(4, fused) - kernels(3, fused)
    print(f"[fused gpu] kernels per step: unfused {per_step[False]}, fused {per_step[True]}")
    assert 0 < per_step[True] < per_step[False]
