"""``sparsecorr::write_kv`` on a CUDA GPU (marker ``gpu``; issue 36): the op dispatches to the
fused Triton kernel (no fallback), writes what the two scatters write, and inside a CUDA graph
costs one launch per layer instead of two. The CPU tests (tests/unit/decoding/test_kv_write.py)
check the same kernel under Triton's interpreter."""

import pytest
import torch

from sparsecorr.decoding.kernels import kv_write as W

pytestmark = pytest.mark.gpu

LAYERS = 28  # Qwen3-0.6B: one decode step writes every layer once


def _decode_shape(seed):
    """A decode step at Qwen3-0.6B's shape, 8 rows of 32k slots: one token per row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, h, s, d = 8, 8, 32 * 1024 + 16, 128
    k_cache = torch.zeros(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(b, 1, h, d, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    value = torch.randn(b, 1, h, d, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    slots = torch.randint(0, s, (b, 1), device="cuda", generator=g)
    return k_cache, v_cache, key, value, slots


def test_the_op_runs_the_fused_kernel_and_equals_the_stock_pair():
    k_cache, v_cache, key, value, slots = _decode_shape(0)
    W.write_kv(k_cache, v_cache, key, value, slots)
    assert not W._failed, W._failed
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    W.write_kv_reference(want_k, want_v, key, value, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # a prefill chunk: many tokens per row, distinct slots
    g = torch.Generator(device="cuda").manual_seed(1)
    key, value = (torch.randn(8, 8, 4096, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    slots = torch.stack([torch.randperm(k_cache.shape[2], device="cuda", generator=g)[:4096] for _ in range(8)])
    W.write_kv(k_cache, v_cache, key, value, slots)
    W.write_kv_reference(want_k, want_v, key, value, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_a_captured_step_of_writes_costs_one_launch_per_layer():
    """A step's 28 writes captured in a CUDA graph, fused and stock: the same caches; the time of
    each replay is printed (``-s``), per layer."""
    k_cache, v_cache, key, value, slots = _decode_shape(2)
    caches = {}
    for name, fn in (("fused", W.write_kv), ("stock", W.write_kv_reference)):
        k, v = k_cache.clone(), v_cache.clone()
        fn(k, v, key, value, slots)  # warm-up (Triton's compile) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(LAYERS):
                fn(k, v, key, value, slots)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        caches[name] = (k, v)
        print(f"write_kv {name}: {start.elapsed_time(end) / 20 / LAYERS * 1e3:.2f} us per layer "
              f"(B=8, H_kv=8, D=128, one token per row, in a CUDA graph of {LAYERS} writes)")
    assert not W._failed, W._failed
    assert torch.equal(caches["fused"][0], caches["stock"][0]) and torch.equal(caches["fused"][1], caches["stock"][1])
