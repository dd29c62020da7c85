"""``sparsecorr::write_kv``: a step's K and V written in one op, one Triton kernel on CUDA.

The op's kernel off CUDA is the stock pair of scatters; these tests pin it against a loop, check
the op's registration (``opcheck``, the meta device, no gradient), that the pool writes through it
and the CUDA kernel's fallback. The Triton kernel itself runs where Triton is importable
(`tests.unit.decoding.triton_marks`: a GPU, or ``make test-triton``'s interpreter).
"""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from sparsecorr.decoding import RKV, BlockTopK, Dense, SnapKV
from sparsecorr.decoding.kernels import kv_write as W
from sparsecorr.decoding.pool import KVPool
from tests.models import tiny_model
from tests.unit.decoding.drive import decode_steps
from tests.unit.decoding.triton_marks import DEVICE, needs_triton


def _loop_write(k_cache, v_cache, key, value, slots):
    """Token by token: K[b, h, slots[b, q]] = key[b, h, q] (and V)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    b, h, q, _ = key.shape
    for i in range(b):
        for j in range(h):
            for t in range(q):
                k_cache[i, j, slots[i, t]] = key[i, j, t]
                v_cache[i, j, slots[i, t]] = value[i, j, t]
    return k_cache, v_cache


def _inputs(seed, b, h, q, d, s, *, dtype=torch.bfloat16, device="cpu"):
    """Caches ``[B, H, S, D]``, a key laid out as HF's projections leave it (``[B, Q, H, D]``
    transposed: strided), a contiguous value and distinct slots per row."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(b, h, s, d, generator=g).to(dtype) for _ in range(2))
    key = torch.randn(b, q, h, d, generator=g).to(dtype).transpose(1, 2)
    value = torch.randn(b, h, q, d, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(s, generator=g)[:q] for _ in range(b)])
    return [x.to(device) for x in (k_cache, v_cache, key, value, slots)]


@pytest.mark.parametrize("shape", [(2, 3, 1, 16, 9), (1, 1, 1, 1, 1), (3, 2, 7, 8, 20)])
def test_write_kv_equals_a_loop(shape):
    k_cache, v_cache, key, value, slots = _inputs(0, *shape)
    want = _loop_write(k_cache, v_cache, key, value, slots)
    W.write_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1])


def test_write_kv_op_registration():
    k_cache, v_cache, key, value, slots = _inputs(1, 2, 2, 3, 8, 6, dtype=torch.float32)
    torch.library.opcheck(W._write_op, (k_cache, v_cache, key, value, slots))
    W.write_kv(*(x.to("meta") for x in (k_cache, v_cache, key, value, slots)))  # the fake kernel: no error
    # no gradient: keys that require one are written as data, and the caches do not require one
    W.write_kv(k_cache, v_cache, key.clone().requires_grad_(), value.clone().requires_grad_(), slots)
    assert not k_cache.requires_grad and not v_cache.requires_grad


def test_write_kv_compiles_without_a_graph_break():
    """Traced by dynamo (``fullgraph=True``) and functionalised by AOTAutograd, the op stays one op
    that writes the caches in place."""
    k_cache, v_cache, key, value, slots = _inputs(4, 2, 2, 3, 8, 7, dtype=torch.float32)
    want = _loop_write(k_cache, v_cache, 2 * key, value, slots)
    torch._dynamo.reset()
    fn = torch.compile(lambda kc, vc, k, v, s: W.write_kv(kc, vc, 2 * k, v, s), fullgraph=True, backend="aot_eager")
    fn(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1])


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad", [False, True])
def test_the_pool_writes_through_the_op_without_grad(grad):
    """In place (no grad) the pool's K/V write is the one op; with grad it stays out of place."""
    pool = KVPool(layers=2, batch=2, kv_heads=2, head_dim=8, capacity=8, page_size=4,
                  dtype=torch.float32, device=torch.device("cpu"), positions=False, grad=grad)
    _, _, key, value, slots = _inputs(2, 2, 2, 3, 8, 12, dtype=torch.float32)
    with _Ops() as ops:
        pool.write(1, key, value, slots)
    assert ("sparsecorr.write_kv" in ops.names) is not grad
    want = _loop_write(torch.zeros_like(pool.k[1]), torch.zeros_like(pool.v[1]), key, value, slots)
    assert torch.equal(pool.k[1], want[0]) and torch.equal(pool.v[1], want[1])


def test_cuda_kernel_falls_back_to_the_stock_pair_once(monkeypatch):
    """A failing Triton kernel (no Triton, a build error) warns once and writes the stock values."""
    k_cache, v_cache, key, value, slots = _inputs(3, 2, 2, 4, 8, 11)
    want = _loop_write(k_cache, v_cache, key, value, slots)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(W, "write_kv_triton", broken)
    monkeypatch.setattr(W, "_failed", [])
    with pytest.warns(RuntimeWarning, match="write_kv: the fused Triton kernel failed .RuntimeError: no kernel here"):
        W._write_cuda(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        W._write_cuda(k_cache, v_cache, key, value, slots)  # no second warning, no second try
    assert len(calls) == 1


@needs_triton
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 3), h=st.integers(1, 3), q=st.integers(1, 40),
       d=st.sampled_from([1, 8, 24, 64, 128]), extra=st.integers(0, 30), broadcast=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_triton_kernel_equals_the_stock_pair(seed, b, h, q, d, extra, broadcast, dtype):
    """Any shape (tokens past a block, head dims off a power of two), a strided key, broadcast
    slots, a cache that is a layer's view of the stacked pool: the fused kernel writes exactly
    what the two scatters write, and nothing else."""
    k_all, v_all = (torch.randn(2, b, h, q + extra, d).to(dtype).to(DEVICE) for _ in range(2))
    _, _, key, value, slots = _inputs(seed, b, h, q, d, q + extra, dtype=dtype, device=DEVICE)
    if broadcast:
        slots = slots[:1].expand(b, q)
    want = (k_all.clone(), v_all.clone())
    W.write_kv_reference(want[0][1], want[1][1], key, value, slots)
    W.write_kv_triton(k_all[1], v_all[1], key, value, slots)
    assert torch.equal(k_all, want[0]) and torch.equal(v_all, want[1])


@needs_triton
@pytest.mark.parametrize("policy", [Dense(), SnapKV(), RKV(), BlockTopK(page_size=4, dense_layers=1)],
                         ids=lambda p: p.name)
def test_decoding_with_the_triton_kernel_gives_the_same_rollouts(monkeypatch, policy):
    """Prefill (many tokens per row, ragged prompts: padding to the scratch page) and decode
    steps with compressions: the same tokens and log-probs with the fused write as with the
    stock pair."""
    model = tiny_model("qwen3", num_layers=2).to(DEVICE)
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    lens = torch.tensor([9, 6, 4])
    ref, _ = decode_steps(model, ids, policy, 8, lens=lens, steps=12)
    monkeypatch.setattr(W, "_write_op", W.write_kv_triton)
    got, _ = decode_steps(model, ids, policy, 8, lens=lens, steps=12)
    assert torch.equal(got["tokens"], ref["tokens"])
    torch.testing.assert_close(got["rollout_logp"], ref["rollout_logp"], atol=0, rtol=0)
