"""``sparsecorr::window_votes`` on a CUDA GPU (marker ``gpu``; issue 36): the op dispatches to the
fused Triton kernel (no fallback), which gives the stock chain's votes and kept sets. The CPU
tests (tests/unit/decoding/test_votes.py) check the same kernel under Triton's interpreter."""

import pytest
import torch

from sparsecorr.decoding.kernels import votes as V
from sparsecorr.decoding.policies import RKV, SnapKV, compress

pytestmark = pytest.mark.gpu


def test_the_op_runs_the_fused_kernel_and_equals_the_stock_chain():
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, r, s = 8, 8, 16, 2177  # Qwen3-0.6B's event shape (benchmarks/bench_decode_kernels.py)
    logits = 4 * torch.randn(b, h, r + 2, s, device="cuda", generator=g)[:, :, :r]
    valid = torch.rand(b, 1, s, device="cuda", generator=g).expand(b, h, s) < 0.9
    weights = torch.rand(b, r, device="cuda", generator=g)
    got = V._votes_op(logits, valid, weights, 128**-0.5)
    assert not V._failed, V._failed
    torch.testing.assert_close(got, V.votes_reference(logits, valid, weights, 128**-0.5), rtol=2e-5, atol=1e-7)
    # the time of each, for the record (printed with -s)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for name, fn in (("fused", V._votes_op), ("stock", V.votes_reference)):
        fn(logits, valid, weights, 0.1)
        start.record()
        for _ in range(20):
            fn(logits, valid, weights, 0.1)
        end.record()
        torch.cuda.synchronize()
        print(f"window_votes {name}: {start.elapsed_time(end) / 20 * 1e3:.1f} us at B={b} H={h} R={r} S={s}")


@pytest.mark.parametrize("policy", [SnapKV(), RKV()], ids=lambda p: p.name)
def test_compress_keeps_the_same_tokens_with_the_fused_votes(monkeypatch, policy):
    g = torch.Generator(device="cuda").manual_seed(1)
    b, h, gq, s, d, w = 4, 8, 2, 2177, 128, 8
    keys = torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16)
    queries = torch.randn(b, h * gq, w, d, device="cuda", generator=g).to(torch.bfloat16)
    counts = torch.tensor([2177, 1500, 960, 300], device="cuda")
    valid = (torch.arange(s, device="cuda") < counts[:, None])[:, None, :].expand(b, h, s)
    positions = torch.arange(s, device="cuda").expand(b, h, s)
    kw = dict(keys=keys, queries=queries, valid=valid, positions=positions, budget=960)
    got = compress(policy, **kw)
    assert not V._failed, V._failed
    monkeypatch.setattr(V, "_votes_op", V.votes_reference)
    want = compress(policy, **kw)
    assert torch.equal(got.index, want.index) and torch.equal(got.valid, want.valid)
