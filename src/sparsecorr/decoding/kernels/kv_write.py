r"""A step's K and V written into the pool in one op, one kernel on CUDA.

Every layer of every forward writes its new keys and values at per-row slots of the pool
(`sparsecorr.decoding.pool.KVPool.write`):

\[ K[b, h, s_{bq}, :] \leftarrow k[b, h, q, :], \qquad V[b, h, s_{bq}, :] \leftarrow v[b, h, q, :] \]

With stock ops that is two ``scatter_`` kernels per layer (K and V are separate buffers: each
layer's K is one contiguous ``[B, H_kv, C + page, D]`` block, as the paged kernels read it, and
a stacked ``[2, ...]`` source would cost a copy of its own). In a decode step, where every
launch costs about 2.5 µs even inside a CUDA graph and the write moves a few KB, the second
launch is pure overhead. So K and V are written in one op, the custom op
``sparsecorr::write_kv``:

- on every device its kernel is the stock pair of scatters (`write_kv_reference`): the CPU, the
  meta device and any other backend run exactly the ops they ran before;
- on CUDA it is one Triton kernel (`_write_kernel`): one program per (sequence, KV head, block
  of ``BLOCK_Q`` tokens) loads the block's slots once and copies the block's K rows and V rows
  (any input strides: the value states arrive as a transposed view of the projection);
- where Triton is missing or the kernel fails, it warns once and runs the stock pair
  (`sparsecorr.decoding.kernels.fallback.fused_or_stock`).

A slot is written once per forward, except the scratch page's (padding tokens of a ragged chunk
may share a scratch slot, which is never read): there either kernel leaves one of the tokens.
The kernel's parity with the stock pair is tested on the CPU by Triton's interpreter
(``make test-triton``: ``tests/unit/decoding/test_kv_write.py``) and on CUDA by the same tests
and ``tests/gpu/test_kv_write_gpu.py``. The op mutates the pool in place and has no autograd
formula: with ``grad=True`` the pool writes out of place with stock ops instead.
"""

from __future__ import annotations

import functools

import torch

from .fallback import fused_or_stock

__all__ = ["write_kv", "write_kv_reference", "write_kv_triton"]


def write_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """The write with stock ops: one ``scatter_`` for K, one for V.

    Shapes:
        k_cache, v_cache ``[B, H_kv, S, D]`` (written in place); key, value ``[B, H_kv, Q, D]``
        (the caches' dtype); slots ``[B, Q]`` long (device), each in ``[0, S)``.
    """
    b, h, q, d = key.shape
    idx = slots[:, None, :, None].expand(b, h, q, d)  # [B, H_kv, Q, D] (a view)
    k_cache.scatter_(2, idx, key)
    v_cache.scatter_(2, idx, value)


@torch.library.custom_op("sparsecorr::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_op(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
    write_kv_reference(k_cache, v_cache, key, value, slots)


@_write_op.register_fake
def _(k_cache, v_cache, key, value, slots):
    return None


@functools.cache
def _write_kernel():
    """The Triton kernel (built on first use: Triton is imported only where the op runs on CUDA,
    or under its interpreter in the tests)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, s_ptr, H, Q, D, blocks,
               skb, skh, skq, skd, svb, svh, svq, svd, ckb, ckh, cks, ckd, cvb, cvh, cvs, cvd, ssb, ssq,
               BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        bh = pid // blocks
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        q = (pid % blocks).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BLOCK_Q] tokens
        d = tl.arange(0, BLOCK_D)
        qm = q < Q
        m = qm[:, None] & (d < D)[None, :]  # [BLOCK_Q, BLOCK_D]
        slot = tl.load(s_ptr + b * ssb + q * ssq, mask=qm, other=0)  # [BLOCK_Q] long
        x = tl.load(k_ptr + b * skb + h * skh + q[:, None] * skq + d[None, :] * skd, mask=m)
        tl.store(kc_ptr + b * ckb + h * ckh + slot[:, None] * cks + d[None, :] * ckd, x, mask=m)
        y = tl.load(v_ptr + b * svb + h * svh + q[:, None] * svq + d[None, :] * svd, mask=m)
        tl.store(vc_ptr + b * cvb + h * cvh + slot[:, None] * cvs + d[None, :] * cvd, y, mask=m)

    return kernel


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    slots: torch.Tensor) -> None:
    """The fused kernel's launch (any strides; ``slots`` may be a broadcast view).

    Shapes: as `write_kv_reference`.
    """
    b, h, q, d = key.shape
    block_d = max(16, 1 << (d - 1).bit_length())
    block_q = max(1, min(16, 4096 // block_d, 1 << (q - 1).bit_length()))  # a decode step: 1 token
    blocks = -(-q // block_q)
    slots = slots.expand(b, q)
    _write_kernel()[(b * h * blocks,)](key, value, k_cache, v_cache, slots, h, q, d, blocks, *key.stride(),
                                      *value.stride(), *k_cache.stride(), *v_cache.stride(), *slots.stride(),
                                      BLOCK_Q=block_q, BLOCK_D=block_d)


_failed: list[str] = []  # the first failure's message: later calls go straight to the stock pair


@_write_op.register_kernel("cuda")
def _write_cuda(k_cache, v_cache, key, value, slots):  # pragma: no cover - runs on CUDA (tests: interpreter)
    fused_or_stock("sparsecorr::write_kv", _failed, write_kv_triton, write_kv_reference,
                   k_cache, v_cache, key, value, slots)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slots: torch.Tensor) -> None:
    r"""Write a chunk's keys and values at per-row slots, in place: the op ``sparsecorr::write_kv``
    (see the module docstring: two ``scatter_`` everywhere, one fused Triton kernel on CUDA).

    \(K[b, h, s_{bq}] \leftarrow k[b, h, q]\) and \(V[b, h, s_{bq}] \leftarrow v[b, h, q]\).

    Shapes:
        k_cache, v_cache ``[B, H_kv, S, D]``; key, value ``[B, H_kv, Q, D]`` in the caches' dtype;
        slots ``[B, Q]`` long, on the caches' device, each in ``[0, S)``.
    """
    _write_op(k_cache, v_cache, key.detach(), value.detach(), slots)
