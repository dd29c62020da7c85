r"""``RKV(window=8, kernel=7, mix=0.1, buffer=128)``: R-KV, Sparse-RL's main compression.

Score = ``mix`` · importance − (1 − ``mix``) · redundancy (Sparse-RL, Luo et al., ACL 2026,
after R-KV): importance is SnapKV's pooled observation-window attention; redundancy of a key is
its mean cosine similarity to the other valid keys of the same head (reasoning traces repeat
themselves; a key like many others carries little). Both terms are min-max normalised per
(sequence, head) before mixing so ``mix`` weighs comparable quantities (our choice: the source
does not say how they are scaled). Compression runs when the cache reaches budget + buffer
(every 128 decode steps in Sparse-RL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import window_votes
from .base import Kind, KVPolicy, matmul_f32, merge_rows, split_rows
from .snapkv import check_window_policy, pool_scores

__all__ = ["RKV", "key_redundancy", "rkv_parts", "unit_weights", "weighted_key_sum"]


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
    `sparsecorr.decoding.pool.KVPool.sync_unit_sums`), not at all.

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


def rkv_parts(keys: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor,
              query_valid: torch.Tensor | None = None,
              norms: torch.Tensor | None = None,
              unit_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""R-KV's two raw terms with the keys read three times in all: SnapKV's votes
    (`group_scores`) and
    \((n-1)\) × [`key_redundancy`][sparsecorr.decoding.policies.key_redundancy] (the per-row
    factor cancels in the min-max normalisation). The sum of unit keys \(s\) rides as extra rows
    of the observation-window queries, so one GEMM gives the logits and every \(k_j \cdot s\).
    With the key ``norms`` given (the engine's pool keeps them), twice; with the ``unit_sum``
    \(s\) given as well (the pool keeps it too), once.

    Shapes:
        keys ``[B, H_kv, S, D]``; queries ``[B, H_q, W, D]``; valid ``[B, H_kv, S]``;
        query_valid ``[B, W]`` or None; norms ``[B, H_kv, S]`` float32 or None; unit_sum
        ``[B, H_kv, 1, D]`` float32 or None (only with norms) -> two
        ``[B, H_kv, S]`` float32.
    """
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    n, wt, s = _unit_sum(keys, valid, norms, unit_sum)
    # (queries of another dtype than the keys promote the rows; matmul_f32 then upcasts both)
    rows = torch.cat([queries.reshape(b, hkv, g * w, d), split_rows(s, keys.dtype)], dim=-2)
    out = matmul_f32(rows, keys.transpose(-1, -2))  # [B, H, G·W + 1 or 2, S]
    votes = window_votes(out[:, :, :g * w], valid, query_valid, group=g, scale=d**-0.5)
    red = _redundancy_from(merge_rows(out[:, :, g * w:], 1)[:, :, 0], n, wt)
    return votes, red


@dataclass(frozen=True)
class RKV(KVPolicy):
    """Importance minus key redundancy (see the module docstring). Eviction; scoring costs a
    W×S attention plus an O(S·D) key redundancy per head at each compression event."""

    name: ClassVar[str] = "rkv"
    kind: ClassVar[Kind] = "eviction"
    key_norms: ClassVar[bool] = True
    window: int = 8
    kernel: int = 7
    mix: float = 0.1
    buffer: int = 128
    sink: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix: expected a number in [0, 1], got {self.mix!r}")
        check_window_policy(self)

    def score(self, *, keys, queries, valid, positions, query_valid=None, key_norms=None,
              unit_sum=None) -> torch.Tensor:
        votes, red = rkv_parts(keys, queries, valid, query_valid, key_norms, unit_sum)
        imp = pool_scores(votes, kernel=self.kernel, pooling="max")
        return mix_minmax(imp, red, valid, mix=self.mix)
