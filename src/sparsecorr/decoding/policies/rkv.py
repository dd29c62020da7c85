r"""``RKV(window=8, kernel=7, mix=0.1, buffer=128)``: R-KV (Cai et al., 2025), Sparse-RL's compression.

**Default scoring, ``scoring="r_kv"``: R-KV's, as its authors' code computes it** (reference:
github.com/Zefan-Cai/R-KV, ``rkv/compression/r1_kv.py`` ``R1KV.update_kv`` and ``rkv/utils.py``
``compute_attention_scores`` / ``cal_similarity``, commit ``d15c9767e67c2bd9807128fecc35223fa2484a69``).
Of a row's valid keys the last ``window`` are kept outright and the others are *scored*:

1. importance: the observation window's logits, for GQA the **maximum over the query heads
   of a group of the logits** (``compute_attention_scores(pooling="max")``), scaled by
   \(1/\sqrt D\); one softmax per window query **over the scored keys only**; the **mean** over
   the window's queries; max-pooled along the sequence with width ``kernel`` (the pooling stops
   at the scored keys' end: the window's keys are not pooled in);
2. redundancy: R-KV's thresholded cosine rule, softmax-normalised over all the row's keys
   (`sparsecorr.decoding.policies.redundancy.rkv_redundancy`: mean cosine to the other keys,
   less each key's share as the most recent near-duplicate (cosine > ``threshold``) of another);
3. score = ``mix`` · importance − (1 − ``mix``) · redundancy, on the scored keys.

``mix`` is λ: 0.1 as in R-KV's README table and Sparse-RL (``mix_alpha=0.1`` in
``srt/managers/tp_worker.py``); R-KV's code defaults to ``mix_lambda=0.07``.

Deliberate differences from the reference code: float32 throughout (R-KV rounds the importance
to the model's dtype before pooling and forms the cosines in it: ties in bf16, nothing else);
unit keys divide by \(\max(\lVert k\rVert, 10^{-12})\) where R-KV adds \(10^{-8}\) to the norm (the
same to float rounding); ties go to the more recent token (R-KV's ``topk`` picks any); a batch of
rows (R-KV reads ``key_states[0]``: batch 1) with padding left out of every sum, mean and
softmax; ``sink`` (0 by default, as R-KV has none) protects the first tokens.

**``variant="sparse_rl"``**: Sparse-RL's fork (github.com/lsjia/Sparse-RL,
``sglang-kvc/python/sglang/compress/r1kv_utils.py`` ``KVCluster.get_compress_indices``, configured
in ``sglang-kvc/python/sglang/srt/managers/tp_worker.py`` with ``attn_pooling="max"``,
``pooling="maxpool"``, ``mix_alpha=0.1``; commit ``182c0b26aeb8f2f6c6f12134c7f57cfe65f95376``):
the same per-head score, summed over the KV heads, so **one kept set per layer** is shared by
its heads. Like Sparse-RL it keeps the prompt whole until the first decode-time compression
(``sglang-kvc/python/sglang/srt/layers/radix_attention.py`` ``RadixAttention.compress``: an extend
batch keeps every token; in decode ``need_compress`` fires when ``seq_len > compress_max_prompt``
and ``steps % compress_divide_length == 0``): `RKV.compress_in_prefill` is False, so the engine
skips compression between prefill chunks and the first compression is the first decode step
whose row holds more than ``budget + buffer`` slots; then every ``buffer + 1`` steps (the fork's
``compress_divide_length = buffer + 1``; its phase follows the batch's step counter, here the
first decode step past the trigger). The pool holds the whole prompt:
``min(context, max(longest prompt + 1, budget + buffer + chunk))`` slots per row
(`sparsecorr.decoding.policies.base.row_capacity`).

**``scoring="minmax"``**: the scoring this project used before (commit ``d7f0ddf``): SnapKV's
votes (per-head softmax averaged over the group, over every valid key) and the plain mean
cosine (`key_redundancy`), each min-max normalised per (row, head). At ``mix=0`` it keeps what
kvpress's ``KeyDiffPress`` keeps. Use it to reproduce runs made before the change, or for a
redundancy-driven policy whose compression event stays O(S·D) per head; it is not R-KV.

**Budget**: a compression keeps ``budget`` slots, so the step that triggers it (``budget +
buffer + 1`` slots: compression runs once a row holds more than ``budget + buffer``) attends
``budget + buffer + 1`` tokens, the steps after it between ``budget + 1`` and that.

R-KV's state (`RKVState`) is SnapKV's observation ring plus what its redundancy term reads at
every compression without re-reading the keys for it: every written key's norm (float32
accumulation), stored once per step for every layer and compacted with the keys, and the sum of
the unit keys of each row's valid slots, brought up to date at each compression over the slots
written since the last one and the evicted ones only. Not with autograd (per-layer K/V tensors):
then the score computes both from the keys. The near-duplicate rule needs the S×S cosines on
top (`near_duplicate_drop`): an O(S²·D) GEMM per head at each compression event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import window_votes
from ..pool import take_rows
from .base import EvictionPolicy, matmul_f32, merge_rows, split_rows
from .redundancy import (
    _redundancy_from,
    _unit_sum,
    key_redundancy,
    mix_minmax,
    rkv_redundancy,
    unit_weights,
    weighted_key_sum,
)
from .snapkv import RingState, before_window, check_window_policy, pool_scores
from .state import PolicyState

__all__ = ["RKV", "RKVState", "UnitSumUpdate", "key_redundancy", "mix_minmax", "rkv_parts", "rkv_terms",
           "unit_weights", "weighted_key_sum"]


def _window_rows(queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, norms, unit_sum):
    r"""One GEMM of the keys against the window's queries and the unit-key sum \(s\) (two bf16 rows
    for a bf16 cache): the logits ``[B, H, G·W, S]`` and every \(k_j\cdot s\), plus the norms and
    unit weights (`_unit_sum`)."""
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    n, wt, s = _unit_sum(keys, valid, norms, unit_sum)
    # (queries of another dtype than the keys promote the rows; matmul_f32 then upcasts both)
    rows = torch.cat([queries.reshape(b, hkv, hq // hkv * w, d), split_rows(s, keys.dtype)], dim=-2)
    out = matmul_f32(rows, keys.transpose(-1, -2))  # [B, H, G·W + 1 or 2, S]
    gw = hq // hkv * w
    return out[:, :, :gw], merge_rows(out[:, :, gw:], 1)[:, :, 0], n, wt


def rkv_terms(keys: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor,
              query_valid: torch.Tensor | None = None, norms: torch.Tensor | None = None,
              unit_sum: torch.Tensor | None = None, *, window: int,
              threshold: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    r"""R-KV's two terms as its code computes them (module docstring), before pooling and mixing.

    \(\mathrm{imp}_j = \frac{1}{|W|}\sum_{w} \mathrm{softmax}_{j \in \mathcal S}\big(\max_g
    q_{gw}\cdot k_j / \sqrt D\big)\) over the scored keys \(\mathcal S\) (valid, not among the row's
    last ``window``; exactly 0 elsewhere) and the valid window queries \(w\) (``query_valid``); and
    `rkv_redundancy` over all valid keys. One GEMM gives the logits and the closed-form
    column sums (the unit-key sum rides as extra rows, as in `rkv_parts`); the max over the
    group is one ``amax``; the softmax and mean are the op ``sparsecorr::window_votes`` (fused on
    CUDA) with weights \(m_w / |W|\).

    Shapes:
        keys ``[B, H_kv, S, D]``; queries ``[B, H_q, W, D]``; valid ``[B, H_kv, S]``; query_valid
        ``[B, W]`` or None; norms ``[B, H_kv, S]`` float32 or None; unit_sum ``[B, H_kv, 1, D]``
        float32 or None -> two ``[B, H_kv, S]`` float32.
    """
    _, hq, w, d = queries.shape
    g = hq // keys.shape[1]
    logits, dots, n, wt = _window_rows(queries, keys, valid, norms, unit_sum)
    if g > 1:  # R-KV's GQA: the group's largest logit, then one softmax
        logits = logits.unflatten(2, (g, w)).amax(2)
    scored = before_window(valid, window)
    if query_valid is None:
        imp = window_votes(logits, scored, None, group=w, scale=d**-0.5)
    else:  # the mean over the real window queries
        share = query_valid / query_valid.sum(-1, keepdim=True).clamp(min=1)
        imp = window_votes(logits, scored, share, group=1, scale=d**-0.5)
    return imp, rkv_redundancy(keys, valid, dots, n, wt, threshold=threshold)


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
    d = queries.shape[-1]
    logits, dots, n, wt = _window_rows(queries, keys, valid, norms, unit_sum)
    votes = window_votes(logits, valid, query_valid, group=queries.shape[1] // keys.shape[1], scale=d**-0.5)
    red = _redundancy_from(dots, n, wt)
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


_SCORINGS = ("r_kv", "minmax")
_VARIANTS = ("r_kv", "sparse_rl")


@dataclass(frozen=True)
class RKV(EvictionPolicy):
    """R-KV (see the module docstring): ``mix`` · importance − (1 − ``mix``) · redundancy.
    Eviction; each compression event costs a W×S attention per head plus, for the default
    scoring, the S×S key cosines per head (``scoring="minmax"``: an O(S·D) closed form).

    ``scoring``: ``"r_kv"`` (R-KV's code, the default) or ``"minmax"`` (this project's earlier
    scoring); ``variant``: ``"r_kv"`` (one kept set per KV head) or ``"sparse_rl"`` (Sparse-RL's
    fork: the heads' scores summed, one kept set per layer); ``threshold``: the cosine above which
    two keys are near-duplicates (R-KV's 0.5; ``scoring="r_kv"`` only)."""

    name: ClassVar[str] = "rkv"
    key_norms: ClassVar[bool] = True
    state_type: ClassVar[type[PolicyState]] = RKVState
    window: int = 8
    kernel: int = 7
    mix: float = 0.1
    buffer: int = 128
    sink: int = 0
    scoring: str = "r_kv"
    variant: str = "r_kv"
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix: expected a number in [0, 1], got {self.mix!r}")
        if self.scoring not in _SCORINGS:
            raise ValueError(f"scoring: expected one of {_SCORINGS}, got {self.scoring!r}")
        if self.variant not in _VARIANTS:
            raise ValueError(f"variant: expected one of {_VARIANTS}, got {self.variant!r}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < 1.0:
            raise ValueError(f"threshold: expected a number in [0, 1), got {t!r}")
        check_window_policy(self)

    @property
    def compress_in_prefill(self) -> bool:
        """False for ``variant="sparse_rl"``: Sparse-RL keeps the prompt whole until the first
        decode-time compression (``RadixAttention.compress``; module docstring)."""
        return self.variant != "sparse_rl"

    def score(self, *, keys, queries, valid, positions, query_valid=None, key_norms=None,
              unit_sum=None) -> torch.Tensor:
        if self.scoring == "minmax":
            votes, red = rkv_parts(keys, queries, valid, query_valid, key_norms, unit_sum)
            score = mix_minmax(pool_scores(votes, kernel=self.kernel, pooling="max"), red, valid, mix=self.mix)
        else:
            imp, red = rkv_terms(keys, queries, valid, query_valid, key_norms, unit_sum, window=self.window,
                                 threshold=self.threshold)
            # imp >= 0 and exactly 0 off the scored keys: the max pooling stops at their end
            score = torch.sub(pool_scores(imp, kernel=self.kernel, pooling="max") * self.mix, red,
                              alpha=1.0 - self.mix)
        if self.variant == "sparse_rl":  # Sparse-RL: final_score.sum(dim=1), one set for the layer
            score = score.sum(1, keepdim=True).expand_as(score)
        return score
