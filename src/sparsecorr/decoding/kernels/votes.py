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

__all__ = ["near_duplicates", "near_duplicates_reference", "near_duplicates_triton", "votes_reference",
           "window_votes"]

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


# -- R-KV's near-duplicate rule: the last near-duplicate of every key ----------------------------

_ND_BLOCK = 1 << 24  # float32 elements of one block of the stock chain's S×S cosines (64 MB; with the
# block's comparison and index temporaries ~150 MB at the event's peak)


def near_duplicates_reference(unit: torch.Tensor, first: torch.Tensor, threshold: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""For every key \(i\): the last \(j \ne i\) with \(\hat k_i\cdot\hat k_j >\) ``threshold``, or
    ``first`` (the row's first valid slot) where there is none, and that cosine (0 where
    \(j = i\)), with stock ops: the cosines in blocks of rows (at most ``_ND_BLOCK`` float32
    elements), one GEMM each (float32 accumulation), the diagonal zeroed in place, a comparison,
    the last index (int32) and a gather.

    Shapes:
        unit ``[B, H, S, D]`` (unit keys, 0 at invalid slots); first ``[B, H]`` long -> last
        ``[B, H, S]`` long and value ``[B, H, S]`` float32.
    """
    from ..policies.base import matmul_f32  # (the policies import this module)

    b, h, s, _ = unit.shape
    last = torch.empty(b, h, s, dtype=torch.long, device=unit.device)
    val = torch.empty(b, h, s, dtype=torch.float32, device=unit.device)
    cols = torch.arange(s, device=unit.device, dtype=torch.int32)
    first = first.to(torch.int32)[..., None, None]
    step = max(1, min(s, _ND_BLOCK // max(b * h * s, 1)))
    for lo in range(0, s, step):
        hi = min(s, lo + step)
        cos = matmul_f32(unit[:, :, lo:hi], unit.transpose(-1, -2))  # [B, H, m, S]
        cos.diagonal(offset=lo, dim1=-2, dim2=-1).zero_()  # C_ii = 0 (R-KV's fill_diagonal_)
        at = torch.where(cos > threshold, cols, first).amax(-1, keepdim=True).long()  # [B, H, m, 1]
        last[:, :, lo:hi] = at[..., 0]
        val[:, :, lo:hi] = cos.gather(-1, at)[..., 0]
    return last, val


@torch.library.custom_op("sparsecorr::near_duplicates", mutates_args=())
def _near_op(unit: torch.Tensor, first: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    return near_duplicates_reference(unit, first, threshold)


@_near_op.register_fake
def _(unit, first, threshold):
    b, h, s, _ = unit.shape
    return unit.new_empty(b, h, s, dtype=torch.long), unit.new_empty(b, h, s, dtype=torch.float32)


@functools.cache
def _near_kernel():
    """The Triton kernel: one program per (sequence·head, block of 64 keys); the cosine tiles
    are ``tl.dot`` products of the unit keys (float32 accumulation) kept in registers, so no S×S
    tensor is written: each program keeps its rows' last near-duplicate and its cosine."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(u_ptr, f_ptr, last_ptr, val_ptr, S, D, thr, sun, sus, sud,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
        nh = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < S
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        base = u_ptr + nh * sun
        q = tl.load(base + rows[:, None] * sus + dd[None, :] * sud, mask=rmask[:, None] & dmask[None, :], other=0.0)
        last = tl.full([BLOCK_M], -1, tl.int32)
        lval = tl.zeros([BLOCK_M], tl.float32)
        for j0 in range(0, S, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            cmask = cols < S
            kt = tl.load(base + cols[None, :] * sus + dd[:, None] * sud, mask=dmask[:, None] & cmask[None, :],
                         other=0.0)  # [BLOCK_D, BLOCK_N]
            if IEEE:
                c = tl.dot(q, kt, input_precision="ieee")
            else:
                c = tl.dot(q, kt)
            near = (c > thr) & cmask[None, :] & (cols[None, :] != rows[:, None])
            top = tl.max(tl.where(near, cols[None, :], -1), 1)
            tval = tl.sum(tl.where(cols[None, :] == top[:, None], c, 0.0), 1)
            upd = top > last
            last = tl.where(upd, top, last)
            lval = tl.where(upd, tval, lval)
        f = tl.load(f_ptr + nh)
        kf = tl.load(base + f * sus + dd * sud, mask=dmask, other=0.0)
        vf = tl.sum(q.to(tl.float32) * kf.to(tl.float32)[None, :], 1)
        vf = tl.where(rows == f, 0.0, vf)
        none = last < 0
        out = nh * S + rows
        tl.store(last_ptr + out, tl.where(none, f, last).to(tl.int64), mask=rmask)
        tl.store(val_ptr + out, tl.where(none, vf, lval), mask=rmask)

    return kernel


def near_duplicates_triton(unit: torch.Tensor, first: torch.Tensor, threshold: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's launch. Shapes: as `near_duplicates_reference`."""
    b, h, s, d = unit.shape
    u = unit.reshape(b * h, s, d)
    last = torch.empty(b * h, s, dtype=torch.long, device=unit.device)
    val = torch.empty(b * h, s, dtype=torch.float32, device=unit.device)
    f = first.reshape(b * h).to(torch.int32)
    block_d = max(16, 1 << (d - 1).bit_length())
    _near_kernel()[(b * h, -(-s // 64))](u, f, last, val, s, d, float(threshold), *u.stride(), BLOCK_M=64,
                                          BLOCK_N=64, BLOCK_D=block_d, IEEE=unit.dtype == torch.float32)
    return last.reshape(b, h, s), val.reshape(b, h, s)


_near_failed: list[str] = []


@_near_op.register_kernel("cuda")
def _near_cuda(unit, first, threshold):  # pragma: no cover - runs on CUDA
    return fused_or_stock("sparsecorr::near_duplicates", _near_failed, near_duplicates_triton,
                          near_duplicates_reference, unit, first, threshold)


def near_duplicates(unit: torch.Tensor, first: torch.Tensor, *, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """R-KV's last near-duplicate of every key and its cosine: the op ``sparsecorr::near_duplicates``
    (the stock chain `near_duplicates_reference` everywhere, one fused Triton kernel on CUDA, which
    writes no S×S tensor). No gradient. Shapes: as `near_duplicates_reference`."""
    return _near_op(unit.detach(), first, float(threshold))
