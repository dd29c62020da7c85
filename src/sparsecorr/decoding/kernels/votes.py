r"""SnapKV's votes from the observation window's logits: one op, fused on CUDA.

\[ \mathrm{imp}_j = \sum_r c_r\,\mathrm{softmax}_j\big(s\,\ell_{rj} + b_j\big), \qquad
   b_j = \begin{cases}0 & j\ \text{valid}\\ \text{float32 min} & \text{otherwise}\end{cases} \]

over the ``R = G·W`` window rows of a (sequence, KV head), with the per-row weights \(c_r\)
(\(m_w / G\): ``query_valid`` over the group size). SnapKV (Li et al., 2024) and R-KV (Sparse-RL)
both score with it at every compression event.

Written with stock ops the chain is a bias add, a softmax and a weighted sum (a GEMV): the
float32 ``[B, H, R, S]`` logits are read and written by each, about 1.3× the bf16 keys' bytes
at Qwen3-0.6B's shape (``benchmarks/RESULTS.md``, "Decode kernel counts"). It is therefore the
custom op ``sparsecorr::window_votes``:

- on every device its kernel is the stock chain (`votes_reference`): the CPU, the meta device,
  and any other backend run exactly the ops they ran before;
- on CUDA it is one Triton kernel (`_votes_kernel`), one program per (sequence, KV head): a
  first pass over the row's logits keeps each window row's running max and sum of exponentials
  (the online softmax), a second pass writes \(\sum_r c_r e^{s\ell_{rj}+b_j-m_r}/Z_r\). The
  logits are read twice by the kernel, the second time from L2 (a (sequence, head)'s rows are
  ``R·S·4`` bytes: 139 KB at R = 16, S = 2,177); from memory, once; no ``[B, H, R, S]``
  intermediate is written. Where Triton is missing or the kernel fails, it warns once and runs
  the stock chain.

The kernel's parity with the stock chain (to float rounding: it multiplies by \(c_r/Z_r\) where
the stock chain divides by \(Z_r\) and then multiplies) is tested on the CPU by Triton's
interpreter (``make test-triton``: ``tests/unit/decoding/test_votes.py``) and on CUDA by the same
tests where a GPU is present. The op has no gradient (the votes rank tokens; nothing
differentiates them): `window_votes` detaches its input.
"""

from __future__ import annotations

import functools

import torch

from .fallback import fused_or_stock

__all__ = ["votes_reference", "window_votes"]

_MIN = torch.finfo(torch.float32).min  # the invalid keys' bias (not -inf: a row without a valid key gives no NaN)


def votes_reference(logits: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    r"""The votes with stock ops: \(\sum_r c_r\,\mathrm{softmax}_j(s\,\ell_{rj} + b_j)\).

    Invalid keys get the float32 minimum as their bias and so receive exactly 0 probability in
    any row with a valid key; a row without one spreads its mass evenly.

    Shapes:
        logits ``[B, H, R, S]`` float32; valid ``[B, H, S]`` bool; weights ``[B or 1, R]``
        float32 -> ``[B, H, S]`` float32.
    """
    b, h, _, s = logits.shape
    bias = torch.where(valid, 0.0, _MIN)[:, :, None, :]  # [B, H, 1, S] float32 (one op)
    probs = torch.add(bias, logits, alpha=scale).softmax(dim=-1)  # [B, H, R, S]
    return (weights[:, None, None, :] @ probs).reshape(b, h, s)  # [B or 1, 1, 1, R] @ -> [B, H, 1, S]


@torch.library.custom_op("sparsecorr::window_votes", mutates_args=())
def _votes_op(logits: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    return votes_reference(logits, valid, weights, scale)


@_votes_op.register_fake
def _(logits, valid, weights, scale):
    b, h, _, s = logits.shape
    return logits.new_empty(b, h, s)


@functools.cache
def _votes_kernel():
    """The Triton kernel (built on first use: Triton is imported only where the op runs on CUDA,
    or under its interpreter in the tests)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, v_ptr, w_ptr, o_ptr, H, R, S, scale, sxb, sxh, sxr, sxs, svb, svh, svs, swb, swr,
               BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
        pid = tl.program_id(0)
        b = (pid // H).to(tl.int64)
        h = (pid % H).to(tl.int64)
        rows = tl.arange(0, BLOCK_R)
        rmask = rows < R
        x_row = x_ptr + b * sxb + h * sxh + rows[:, None] * sxr  # [BLOCK_R, 1] pointers
        v_row = v_ptr + b * svb + h * svh
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)  # running max of each window row
        z = tl.zeros([BLOCK_R], tl.float32)  # running sum of exp(y - m)
        for s0 in range(0, S, BLOCK_S):
            cols = s0 + tl.arange(0, BLOCK_S)
            cmask = cols < S
            ok = tl.load(v_row + cols * svs, mask=cmask, other=0) != 0
            x = tl.load(x_row + cols[None, :] * sxs, mask=rmask[:, None] & cmask[None, :], other=0.0)
            y = tl.where(ok[None, :], x * scale, -3.4028234663852886e38)  # bias: min + s·x rounds to min
            y = tl.where(cmask[None, :], y, float("-inf"))  # past the row's end: no mass
            m_new = tl.maximum(m, tl.max(y, 1))
            z = z * tl.exp(m - m_new) + tl.sum(tl.exp(y - m_new[:, None]), 1)
            m = m_new
        coef = tl.load(w_ptr + b * swb + rows * swr, mask=rmask, other=0.0) / z  # c_r / Z_r
        o_row = o_ptr + (b * H + h) * S
        for s0 in range(0, S, BLOCK_S):
            cols = s0 + tl.arange(0, BLOCK_S)
            cmask = cols < S
            ok = tl.load(v_row + cols * svs, mask=cmask, other=0) != 0
            x = tl.load(x_row + cols[None, :] * sxs, mask=rmask[:, None] & cmask[None, :], other=0.0)
            y = tl.where(ok[None, :], x * scale, -3.4028234663852886e38)
            p = tl.exp(y - m[:, None]) * coef[:, None]  # rows past R have coef 0
            tl.store(o_row + cols, tl.sum(p, 0), mask=cmask)

    return kernel


def votes_triton(logits: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """The fused kernel's launch (any strides; ``valid`` and ``weights`` may be broadcast views).

    Shapes: as `votes_reference`.
    """
    b, h, r, s = logits.shape
    out = torch.empty(b, h, s, dtype=torch.float32, device=logits.device)
    valid = valid.expand(b, h, s)
    weights = weights.expand(b, r)
    block_r = max(16, 1 << (r - 1).bit_length())
    block_s = max(16, min(1024, 8192 // block_r))
    _votes_kernel()[(b * h,)](logits, valid, weights, out, h, r, s, float(scale), *logits.stride(),
                              *valid.stride(), *weights.stride(), BLOCK_R=block_r, BLOCK_S=block_s)
    return out


_failed: list[str] = []  # the first failure's message: later calls go straight to the stock chain


@_votes_op.register_kernel("cuda")
def _votes_cuda(logits, valid, weights, scale):  # pragma: no cover - runs on CUDA (tests: interpreter)
    return fused_or_stock("sparsecorr::window_votes", _failed, votes_triton, votes_reference,
                          logits, valid, weights, scale)


def window_votes(logits: torch.Tensor, valid: torch.Tensor, query_valid: torch.Tensor | None, *,
                 group: int, scale: float) -> torch.Tensor:
    r"""SnapKV's votes from the raw logits of the observation-window queries.

    \(\mathrm{imp}_j = \frac{1}{G}\sum_{g}\sum_{w} m_w\,\mathrm{softmax}_j(s\,q_{gw}\cdot k_j)\) over
    the valid keys (\(m_w\): ``query_valid``): the op ``sparsecorr::window_votes`` (see the module
    docstring: the stock chain everywhere, one fused Triton kernel on CUDA) with the weights
    \(c_r = m_w / G\). Invalid keys get the float32 minimum as their bias (instead of
    \(-\infty\): a row without a valid key gives no NaN) and receive exactly 0 probability in any
    row with a valid key. No gradient flows through the votes.

    Shapes:
        logits ``[B, H_kv, G·W, S]`` float32 (group-major rows); valid ``[B, H_kv, S]``;
        query_valid ``[B, W]`` or None -> ``[B, H_kv, S]`` float32.
    """
    gw = logits.shape[2]
    if query_valid is None:
        weights = torch.full((1, gw), 1.0 / group, device=logits.device)
    else:
        weights = (query_valid / group).repeat(1, group)  # [B, G·W]
    return _votes_op(logits.detach(), valid, weights, scale)
