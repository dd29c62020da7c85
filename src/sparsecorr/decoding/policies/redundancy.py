r"""R-KV's redundancy term: how much each key repeats the other keys of its (sequence, KV head).

Two definitions live here:

- the mean cosine similarity to the other valid keys (`key_redundancy`), computed in closed
  form from the sum of the unit keys (the keys are read a few times; no S×S matrix), and the
  min-max mix of `RKV(scoring="minmax")` (`mix_minmax`);
- R-KV's own rule (`rkv_redundancy`, the default of `RKV`), as the authors' code computes it
  (github.com/Zefan-Cai/R-KV, ``rkv/utils.py``, ``cal_similarity``, commit
  ``d15c9767e67c2bd9807128fecc35223fa2484a69``; the same function in Sparse-RL's
  ``sglang-kvc/python/sglang/compress/r1kv_utils.py``, commit
  ``182c0b26aeb8f2f6c6f12134c7f57cfe65f95376``, with ``sim_normalization=True``): the pairwise
  cosine matrix \(C\) with a zero diagonal; for each key \(i\) the most recent key
  \(r_i = \max\{j : C_{ij} > 0.5\}\) (its latest near-duplicate; the first key when it has none)
  has \(C_{i r_i}\) zeroed; then the column mean over the \(n\) keys and a softmax over them.
  The column sums come from the closed form; only the near-duplicate rule needs the S×S
  cosines, computed in row blocks (`near_duplicate_drop`).
"""

from __future__ import annotations

import torch

from ..kernels.votes import near_duplicates
from .base import matmul_f32, merge_rows, split_rows

__all__ = ["key_redundancy", "mix_minmax", "near_duplicate_drop", "rkv_redundancy", "unit_weights",
           "weighted_key_sum"]


def _valid_range(x: torch.Tensor, valid: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``x`` over the valid slots of each row (``first``: a valid slot's index, or
    any slot in a row without one): the invalid entries are replaced by a valid one (which
    changes neither) and one ``aminmax`` reads the row, so no ``±inf`` fill per bound.

    Shapes:
        x, valid ``[B, H, S]``; first ``[B, H, 1]`` long -> two ``[B, H, 1]``.
    """
    lo, hi = torch.where(valid, x, x.gather(-1, first)).aminmax(dim=-1, keepdim=True)
    return lo, hi


def mix_minmax(imp: torch.Tensor, red: torch.Tensor, valid: torch.Tensor, *, mix: float) -> torch.Tensor:
    r"""\(\mathrm{mix}\cdot\hat{\mathrm{imp}} - (1-\mathrm{mix})\cdot\hat{\mathrm{red}}\), each term
    min-max normalised over the valid slots of its (sequence, head): \(\hat x = (x - \min x) /
    \max(\max x - \min x, 10^{-12})\); 0 at invalid slots. Computed as
    \((i - \min i)\,a_i + (r - \min r)\,a_r\) with the per-row factors
    \(a_i = \mathrm{mix} / \mathrm{range}_i\), \(a_r = -(1 - \mathrm{mix}) / \mathrm{range}_r\):
    four ``[B, H, S]`` ops after the two masked ranges (`_valid_range`), the same values to
    float rounding.

    Shapes:
        imp, red, valid ``[B, H, S]`` -> ``[B, H, S]`` float32.
    """
    first = valid.to(torch.uint8).argmax(-1, keepdim=True)  # a valid slot of each row (0 if none)
    lo_i, hi_i = _valid_range(imp, valid, first)
    lo_r, hi_r = _valid_range(red, valid, first)
    a_i = mix / (hi_i - lo_i).clamp(min=1e-12)
    a_r = -(1.0 - mix) / (hi_r - lo_r).clamp(min=1e-12)
    score = torch.addcmul((imp - lo_i) * a_i, red - lo_r, a_r)
    return score.masked_fill_(~valid, 0.0)


_UNIT_BLOCK = 1 << 25  # unit-key elements made at once by `near_duplicate_drop` (64 MB in bf16)
_EPS = 1e-12  # F.normalize's floor on a key's norm (a zero key has unit key 0)


def unit_weights(mask: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    r"""\(w_j = \mathrm{mask}_j / \max(n_j, 10^{-12})\): the weights that turn keys into unit keys
    (``F.normalize``'s floor) and drop the slots outside ``mask``, float32. Shapes: ``[..., S]``."""
    return mask / norms.clamp(min=_EPS)


def weighted_key_sum(w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    r"""\(\sum_j w_j k_j\) with float32 accumulation, reading the keys as stored (one GEMV; the
    float32 weights split into two rows for a bf16 cache, `split_rows`).

    Shapes:
        w ``[..., S]`` float32; keys ``[..., S, D]`` -> ``[..., 1, D]`` float32.
    """
    return merge_rows(matmul_f32(split_rows(w[..., None, :], keys.dtype), keys), 1)


def _unit_sum(keys: torch.Tensor, valid: torch.Tensor, norms: torch.Tensor | None = None,
              unit_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Norms, per-slot weights and the sum of the unit keys, from the keys as stored.

    \(n_j = \lVert k_j\rVert\) (float32 accumulation), \(w_j = \mathrm{valid}_j / \max(n_j, \epsilon)\)
    and \(s = \sum_j w_j k_j = \sum_{j\ \mathrm{valid}} \hat k_j\): one norm pass and one GEMV over
    the keys (the float32 weights split into two bf16 rows for a bf16 cache, see
    `split_rows`). Given ``norms`` (kept by the pool as the keys are written), the norm pass is
    skipped and the keys are read once here; given ``unit_sum`` too (the pool keeps \(s\) as well,
    `RKVState.sync_unit_sums`), not at all.

    Shapes:
        keys ``[B, H, S, D]``; valid ``[B, H, S]``; norms ``[B, H, S]`` float32 or None -> n, w
        ``[B, H, S]`` and s ``[B, H, 1, D]`` float32.
    """
    n = torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32) if norms is None else norms
    w = unit_weights(valid, n)
    if unit_sum is not None:
        return n, w, unit_sum
    return n, w, weighted_key_sum(w, keys)


def _redundancy_from(dots: torch.Tensor, n: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    r"""\((n - 1)\,\mathrm{red}_j = w_j (k_j \cdot s) - (w_j n_j)^2\) (0 at invalid slots, where \(w_j = 0\))."""
    u = w * n
    return torch.addcmul(w * dots, u, u, value=-1.0)


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    r"""Mean cosine similarity of each valid key to the other valid keys: ``[B, H_kv, S]``.

    With unit keys \(\hat k_j = k_j / \max(\lVert k_j\rVert, \epsilon)\) (``F.normalize``'s
    definition, \(\epsilon = 10^{-12}\)) and \(n\) valid keys,

    \[ \mathrm{red}_j = \frac{1}{n-1}\sum_{t \ne j} \hat k_j \cdot \hat k_t
       = \frac{\hat k_j \cdot s - \lVert \hat k_j\rVert^2}{n - 1},
       \qquad s = \sum_t \hat k_t . \]

    In closed form from the stored keys: with \(n_j = \lVert k_j\rVert\) and
    \(w_j = 1/\max(n_j, \epsilon)\), \(\hat k_j \cdot s = w_j\,(k_j \cdot s)\) and
    \(\lVert \hat k_j\rVert^2 = (w_j n_j)^2\) (1 unless the key is (near) zero), and
    \(s = \sum_t w_t k_t\). So the keys are read three times (norms, \(s\), the dot products), in
    their own dtype with float32 accumulation, and no unit-key (or float32) copy of them is made;
    the S×S similarity matrix is never formed. A zero key has similarity 0 to everything; invalid
    slots and rows with a single valid key score 0.

    Shapes:
        keys ``[B, H_kv, S, D]``; valid ``[B, H_kv, S]`` bool -> ``[B, H_kv, S]`` float32.
    """
    n, w, s = _unit_sum(keys, valid)
    dots = matmul_f32(split_rows(s, keys.dtype), keys.transpose(-1, -2))  # [B, H, 1 or 2, S]
    red = _redundancy_from(merge_rows(dots, 1)[:, :, 0], n, w)
    others = valid.sum(-1, keepdim=True) - 1
    return (red / others.clamp(min=1)).masked_fill_(others < 1, 0.0)  # one valid key: 0, not rounding


def near_duplicate_drop(keys: torch.Tensor, valid: torch.Tensor, w: torch.Tensor, *,
                        threshold: float) -> torch.Tensor:
    r"""What R-KV's most-recent-near-duplicate rule takes out of each key's column sum:
    \(\mathrm{drop}_j = \sum_{i\,:\,r_i = j} C_{ij}\), with \(C_{ij} = \hat k_i \cdot \hat k_j\) the
    cosine of two valid keys (unit keys \(\hat k = w\,k\), `unit_weights`; 0 at invalid slots),
    \(r_i\) the last \(j \ne i\) with \(C_{ij} >\) ``threshold`` (\(\ge 0\)), or the row's first valid
    slot where there is none (R-KV's ``max`` over an index row of zeros; \(C_{ii}\) counts 0 then).

    The unit keys are made once in the keys' dtype (as R-KV's ``k / (|k| + 1e-8)``: the weights
    rounded to that dtype, then one product, so the event holds no float32 copy of the keys; in
    blocks of sequences of at most ``_UNIT_BLOCK`` elements, so not one of all the keys either); each key's
    last near-duplicate and its cosine are the op ``sparsecorr::near_duplicates``
    (`sparsecorr.decoding.kernels.votes`: on the CPU the cosines in blocks of rows, one GEMM
    each; on CUDA one Triton kernel that keeps the cosine tiles in registers and writes no S×S
    tensor); one scatter-add then sums them per key. This is the O(S²·D) work the thresholded
    rule needs beyond the closed form; invalid rows and columns contribute nothing.

    Shapes:
        keys ``[B, H, S, D]``; valid ``[B, H, S]``; w ``[B, H, S]`` float32 (0 at invalid slots)
        -> ``[B, H, S]`` float32.
    """
    first = valid.to(torch.uint8).argmax(-1)  # [B, H]: the row's first valid slot
    drop = torch.empty(valid.shape, dtype=torch.float32, device=keys.device)
    b, h, s, d = keys.shape
    step = max(1, _UNIT_BLOCK // max(h * s * d, 1))  # sequences per block (shapes only: no host read)
    for lo in range(0, b, step):
        hi = min(b, lo + step)
        unit = keys[lo:hi] * w[lo:hi, ..., None].to(keys.dtype)  # 0 at invalid slots: their cosines are 0
        last, val = near_duplicates(unit, first[lo:hi], threshold=threshold)
        drop[lo:hi] = torch.zeros_like(val).scatter_add_(-1, last, val)
    return drop


def rkv_redundancy(keys: torch.Tensor, valid: torch.Tensor, dots: torch.Tensor, n: torch.Tensor,
                   w: torch.Tensor, *, threshold: float) -> torch.Tensor:
    r"""R-KV's redundancy (see the module docstring):
    \(\mathrm{softmax}_j\big(\tfrac{1}{n}\,[\sum_{i \ne j} C_{ij} - \mathrm{drop}_j]\big)\) over the
    valid keys, from the closed-form column sums (``dots`` \(= k_j \cdot s\), ``n`` the key norms,
    ``w`` the unit weights: `_redundancy_from`) and `near_duplicate_drop`. Rows without a
    valid key give a uniform row (no NaN).

    Shapes:
        keys ``[B, H, S, D]``; valid ``[B, H, S]``; dots, n, w ``[B, H, S]`` float32 -> ``[B, H, S]`` float32.
    """
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    mean = (_redundancy_from(dots, n, w) - near_duplicate_drop(keys, valid, w, threshold=threshold)) / count
    return torch.where(valid, mean, torch.finfo(torch.float32).min).softmax(-1)
