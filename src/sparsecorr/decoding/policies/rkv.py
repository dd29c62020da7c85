r"""``RKV(window=8, kernel=7, mix=0.1, buffer=128)``: R-KV, Sparse-RL's main compression.

Score = ``mix`` · importance − (1 − ``mix``) · redundancy (Sparse-RL, Luo et al., ACL 2026,
after R-KV): importance is SnapKV's pooled observation-window attention; redundancy of a key is
its mean cosine similarity to the other valid keys of the same head (reasoning traces repeat
themselves; a key like many others carries little). Both terms are min-max normalised per
(sequence, head) before mixing so ``mix`` weighs comparable quantities (our choice: the source
does not say how they are scaled). Compression runs when the cache reaches budget + buffer
(every 128 decode steps in Sparse-RL).

R-KV's state (`RKVState`) is SnapKV's observation ring plus what its redundancy term reads at
every compression without re-reading the keys for it: every written key's norm (float32
accumulation), stored once per step for every layer and compacted with the keys, and the sum of
the unit keys of each row's valid slots, brought up to date at each compression over the slots
written since the last one and the evicted ones only. Not with autograd (per-layer K/V tensors):
then the score computes both from the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import window_votes
from ..pool import take_rows
from .base import EvictionPolicy, matmul_f32, merge_rows, split_rows
from .snapkv import RingState, check_window_policy, pool_scores
from .state import PolicyState

__all__ = ["RKV", "RKVState", "UnitSumUpdate", "key_redundancy", "rkv_parts", "unit_weights", "weighted_key_sum"]


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


def rkv_parts(keys: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor,
              query_valid: torch.Tensor | None = None,
              norms: torch.Tensor | None = None,
              unit_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""R-KV's two raw terms with the keys read three times in all: SnapKV's votes
    (`group_scores`) and
    \((n-1)\) × [`key_redundancy`][sparsecorr.decoding.policies.key_redundancy] (the per-row
    factor cancels in the min-max normalisation). The sum of unit keys \(s\) rides as extra rows
    of the observation-window queries, so one GEMM gives the logits and every \(k_j \cdot s\).
    With the key ``norms`` given (the engine keeps them: `RKVState`), twice; with the ``unit_sum``
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
class UnitSumUpdate:
    """How a compression event brings the unit-key sums up to date (every layer it compacts).

    ``drop``: subtract the evicted keys' unit sum (gathered: about 3 reads and writes of each key)
    when that touches fewer keys than re-summing the kept ones, which runs otherwise.

    Shapes:
        counts ``[B]`` device long: the valid slots per row after the event; low: their host
        minimum; evicted: the most keys a row evicts (host).
    """

    counts: torch.Tensor
    low: int
    evicted: int
    drop: bool


class RKVState(RingState):
    r"""The observation ring, plus (without autograd) ``norms_all`` ``[L, B, H_kv, C + page]``
    float32 key norms and ``unit_sum_all`` ``[L, B, H_kv, D]`` float32, the sum of the unit keys
    \(s = \sum_j k_j / \max(\lVert k_j\rVert, 10^{-12})\) of slots ``[0, unit_upto_b)``
    (``unit_upto`` ``[B]`` device long; ``unit_lo`` a host lower bound of it)."""

    def __init__(self, policy, pool, *, q_heads: int, table: torch.Tensor) -> None:
        super().__init__(policy, pool, q_heads=q_heads, table=table)
        self.norms_all = self.unit_sum_all = self.unit_upto = None
        self.unit_lo = 0
        if pool.k_all is not None:  # with grad (per-layer K/V) the score reads the keys
            n, b, h, _, d = pool.k_all.shape
            dev = pool.k_all.device
            self.norms_all = torch.zeros(pool.k_all.shape[:4], dtype=torch.float32, device=dev)
            self.unit_sum_all = torch.zeros(n, b, h, d, dtype=torch.float32, device=dev)
            self.unit_upto = torch.zeros(b, dtype=torch.long, device=dev)

    def buffers(self) -> list[torch.Tensor]:
        return super().buffers() + ([] if self.norms_all is None else [self.norms_all, self.unit_sum_all])

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        if self.norms_all is not None:  # unit_lo stays a lower bound
            self.norms_all, self.unit_sum_all = take_rows(self.norms_all, rows), take_rows(self.unit_sum_all, rows)
            self.unit_upto = self.unit_upto.index_select(0, rows)

    def all_written(self, step) -> None:
        if self.norms_all is not None:
            self.add_key_norms(step.slots)

    def add_key_norms(self, slots: torch.Tensor) -> None:
        """Store the norms of a forward's keys of every layer (already written at ``slots``):
        a gather, one ``vector_norm`` (float32 accumulation) and one scatter for all layers,
        once per step. Shapes: slots ``[B, Q]`` (device, long)."""
        new, shape = self.pool.new_keys(slots)
        norms = torch.linalg.vector_norm(new, dim=-1, dtype=torch.float32)
        self.norms_all.scatter_(3, slots[None, :, None, :].expand(shape[:4]), norms)

    def _unit_weighted_sum(self, w: torch.Tensor, lo: int) -> torch.Tensor:
        r"""\(\sum_j w_j k_j\) over slots ``lo .. lo + m - 1`` of every layer (`weighted_key_sum`).

        Shapes:
            w ``[L, B, H_kv, m]`` float32 -> ``[L, B, H_kv, D]`` float32.
        """
        return weighted_key_sum(w, self.pool.k_all[:, :, :, lo:lo + w.shape[-1]])[..., 0, :]

    def sync_unit_sums(self, counts: torch.Tensor, *, low: int, high: int) -> None:
        r"""Add the unit keys of the slots written since the sums were last brought up to date,
        \(s \mathrel{+}= \sum_{\mathrm{upto}_b \le j < \mathrm{count}_b} k_j / \max(n_j, 10^{-12})\)
        with the stored norms \(n_j\), for every layer: one GEMV over slots
        ``[unit_lo, high)`` only (in steady state the ``buffer`` tokens decoded since the last
        compression), at the compression that reads them, not in the decode step (so a CUDA
        graph's warm-up step adds nothing twice, and padding, written past ``count_b`` to the
        scratch page, is never summed). ``low`` / ``high``: host min / max of ``counts``.

        Shapes:
            counts ``[B]`` (device long, valid slots per row).
        """
        lo = self.unit_lo
        if high > lo:
            j = torch.arange(lo, high, device=counts.device)
            new = (j >= self.unit_upto[:, None]) & (j < counts[:, None])  # [B, m]
            w = unit_weights(new[None, :, None, :], self.norms_all[:, :, :, lo:high])
            self.unit_sum_all += self._unit_weighted_sum(w, lo)
        self.unit_upto, self.unit_lo = counts, low

    def drop_unit_sums(self, valid: torch.Tensor, index: torch.Tensor, kept: torch.Tensor, *, evicted: int,
                       counts: torch.Tensor, low: int) -> None:
        r"""Before a compaction, take the evicted keys out of the unit sums:
        \(s \mathrel{-}= \sum_{j\ \mathrm{valid},\ j \notin \mathrm{kept}} k_j / \max(n_j, 10^{-12})\),
        gathering only the (at most ``evicted`` per row and head) evicted keys: a decode's
        compression evicts about ``buffer`` keys of ``budget + buffer``, so this touches a few
        percent of the keys (`keep_unit_sums` runs instead where the kept set is the smaller).
        The sums then drift from a recomputation by float rounding only.

        Shapes:
            valid ``[L, B, H_kv, S]`` (valid before); index, kept ``[L, B, H_kv, K]`` (the kept
            set: slots and valid entries); counts ``[B]`` (device long, valid slots per row after
            the compaction); ``low``: their host minimum.
        """
        s = valid.shape[-1]  # the kept slots marked True (dropped entries into a dump column s)
        in_kept = torch.zeros(*valid.shape[:-1], s + 1, dtype=torch.bool, device=valid.device)
        in_kept.scatter_(-1, torch.where(kept, index, s), True)
        gone = valid & ~in_kept[..., :s]  # evicted: valid and not kept
        ev = gone.to(torch.uint8).topk(evicted, dim=-1).indices  # [L, B, H, E]: the evicted slots first
        w = unit_weights(gone.gather(-1, ev), self.norms_all[..., :s].gather(-1, ev))
        k_all = self.pool.k_all
        keys = k_all.gather(3, ev[..., None].expand(*ev.shape, k_all.shape[-1]))
        self.unit_sum_all -= weighted_key_sum(w, keys)[..., 0, :]
        self.unit_upto, self.unit_lo = counts, low

    def keep_unit_sums(self, valid: torch.Tensor, counts: torch.Tensor, *, low: int) -> None:
        r"""After a compaction, the unit sums of the kept keys:
        \(s = \sum_{j < K} \mathrm{valid}_j\, k_j / \max(n_j, 10^{-12})\) over the compacted front
        (one GEMV over the ``K`` kept slots, not the evicted ones nor the rest of the pool).

        Shapes:
            valid ``[L, B, H_kv, K]`` (the kept set's valid entries); counts ``[B]`` (device long,
            valid slots per row after the compaction); ``low``: their host minimum.
        """
        w = unit_weights(valid, self.norms_all[:, :, :, :valid.shape[-1]])
        self.unit_sum_all.copy_(self._unit_weighted_sum(w, 0))
        self.unit_upto, self.unit_lo = counts, low

    def event(self, *, counts, counts_host, budgets_host, most, top, ctx, forced):
        ring = super().event(counts=counts, counts_host=counts_host, budgets_host=budgets_host, most=most, top=top,
                             ctx=ctx, forced=forced)
        if self.norms_all is None:
            return ring, None
        self.sync_unit_sums(counts, low=int(counts_host.min()), high=most)
        left = torch.minimum(counts_host, budgets_host)  # the valid slots per row after the event
        # drop the evicted keys' unit sum (gathered: ~3 reads / writes of each) or sum the kept
        # keys (one read), whichever touches fewer keys
        evicted = int((counts_host - left).max())
        return ring, UnitSumUpdate(counts=left.to(counts.device, non_blocking=True), low=int(left.min()),
                                   evicted=evicted, drop=3 * evicted < top)

    def score_inputs(self, event, keys, first, stop, s) -> dict:
        ring, _ = event
        out = super().score_inputs(ring, keys, first, stop, s)
        if self.norms_all is not None:
            n_b, h = keys.shape[:2]
            out["key_norms"] = self.norms_all[first:stop, ..., :s].reshape(n_b, h, s)
            out["unit_sum"] = self.unit_sum_all[first:stop].reshape(n_b, h, 1, -1)
        return out

    def compacting(self, event, valid, index, kept, first) -> None:
        after = event[1]
        if after is not None and after.drop:
            self.drop_unit_sums(valid, index, kept, evicted=after.evicted, counts=after.counts, low=after.low)

    def compacted(self, event, index, kept, first) -> None:
        after = event[1]
        if self.norms_all is None:
            return
        layers = slice(first, first + index.shape[0])
        self.norms_all[layers, :, :, :index.shape[-1]] = self.norms_all[layers].gather(3, index)
        if after is not None and not after.drop:
            self.keep_unit_sums(kept, after.counts, low=after.low)


@dataclass(frozen=True)
class RKV(EvictionPolicy):
    """Importance minus key redundancy (see the module docstring). Eviction; scoring costs a
    W×S attention plus an O(S·D) key redundancy per head at each compression event."""

    name: ClassVar[str] = "rkv"
    key_norms: ClassVar[bool] = True
    state_type: ClassVar[type[PolicyState]] = RKVState
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
