r"""``BlockTopK(page_size=16, keep_first_pages=1, keep_last_pages=2, dense_layers=2)``: Sparrow.

A *selection* policy (Zhou et al., 2026, arXiv 2606.08446): the full KV cache is kept, and each
decode step attends to ``budget // page_size`` pages only. Pages of 16 tokens (by true position)
are scored by the dot product of their mean key with the mean current query over the query heads
of the KV group; the first page and the last 2 pages are always kept; the first 2 layers stay
dense.

The engine keeps a running *page summary* (the float32 sum of every page's keys, added to as
each key is written; a complete page's sum is ``page_size`` times its mean key, so it ranks pages
as the mean does) and scores pages from it, so a decode step reads ``S / page_size`` summaries
instead of rescanning the ``S`` cached keys
([`select_pages`][sparsecorr.decoding.policies.block_topk.select_pages]). Because the page that
holds the current token is always kept (``keep_last_pages >= 1``), every scored page is
complete, and the summaries give exactly the selection of the rescan rule
[`BlockTopK.attend_mask`][sparsecorr.decoding.policies.BlockTopK.attend_mask].

Its state (`SelectionState`) keeps those sums beside the pool (``[L, B, H_kv, P, D]`` float32:
every layer's new keys are added to their pages once per step, after the last layer's write: one
gather, one cast, one ``scatter_add_``), plans each decode step's selection once for every sparse
layer (`Selection`, `selection_plan`), and makes a sparse layer attend over its selected pages:
gathered, or through a paged kernel's selected-page table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..pool import take_rows
from .base import Kind, KVPolicy, check_int, matmul_f32
from .state import PlanInputs, PolicyState

__all__ = ["FORCED", "BlockTopK", "Selection", "SelectionPlan", "SelectionState", "gather_mask", "group_query",
           "keep_counts", "page_means", "pages_to_mask", "rank_pages", "select_pages", "selection_plan"]


def page_means(keys: torch.Tensor, *, page_size: int) -> torch.Tensor:
    """Mean key of each page of a page-aligned slice of the cache (the page summaries).

    Shapes:
        keys ``[B, H_kv, n · page_size, D]`` -> ``[B, H_kv, n, D]`` in the keys' dtype (the sum
        is taken in float32).
    """
    b, h, s, d = keys.shape
    return keys.reshape(b, h, s // page_size, page_size, d).float().mean(3).to(keys.dtype)


def keep_counts(policy: BlockTopK, *, slots: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Pages each query attends to: ``min(max(budget // page_size, first + last), pages so far)``;
    every page so far where the budget is -1 (dense). Same shape as ``slots`` (any device).

    It depends on the step only (not the layer): compute it once per step and pass it on (see
    `selection_plan`)."""
    n_pages = slots // policy.page_size + 1
    want = (budgets // policy.page_size).clamp(min=policy.keep_first_pages + policy.keep_last_pages)
    return torch.where(budgets < 0, n_pages, torch.minimum(want, n_pages))


FORCED = 2.0**100  # a forced page's bias: any page score (|score| < 2**76) added to it rounds to it


@dataclass(frozen=True)
class SelectionPlan:
    r"""What a decode step's page selection shares across its sparse layers (computed once per
    step by `selection_plan`).

    Shapes:
        keep ``[B, Q]`` long: pages each query keeps; ok ``[B, 1, Q, k]`` bool: top-k ranks below
        ``keep`` (the selected entries of each query's page list), drop: its complement; bias
        ``[B, 1, Q, P]`` float32: ``FORCED`` (\(2^{100}\)) on the forced pages, ``2 · FORCED`` on
        the query's own page, ``-inf`` on pages after it, 0 elsewhere (a score plus ``FORCED`` is
        ``FORCED`` exactly, so every forced page outranks every other and the query's own page
        ranks first: `rank_pages` relies on it); ``k`` and ``P`` host ints.
    """

    keep: torch.Tensor
    ok: torch.Tensor
    drop: torch.Tensor
    bias: torch.Tensor
    k: int
    n_pages: int


def selection_plan(policy: BlockTopK, *, slots: torch.Tensor, budgets: torch.Tensor, k: int,
                   n_pages: int, keep: torch.Tensor | None = None) -> SelectionPlan:
    """The per-step part of [`select_pages`][sparsecorr.decoding.policies.block_topk.select_pages]:
    keep counts, the rank mask and the forced / causal page bias. Call it once per decode step
    (every sparse layer of the step shares it) and pass it as ``plan``.

    Args:
        slots, budgets: as in ``select_pages`` (``[B, Q]``, on the summaries' device).
        k: at least the largest keep count (a host int); clipped to ``n_pages``.
        n_pages: pages of the summaries (``summaries.shape[2]``).
        keep: the keep counts if already known (``[B, Q]``), else computed here.
    """
    k = min(k, n_pages)
    if keep is None:
        keep = keep_counts(policy, slots=slots, budgets=budgets)
    dev = slots.device
    drop = torch.arange(k, device=dev) >= keep[:, None, :, None]
    page = torch.arange(n_pages, device=dev)
    current = (slots // policy.page_size)[:, None, :, None]  # [B, 1, Q, 1]
    forced = (page < policy.keep_first_pages) | (page > current - policy.keep_last_pages)
    bias = torch.zeros(forced.shape, device=dev).masked_fill_(forced, FORCED)
    bias = bias.masked_fill_(page == current, 2 * FORCED).masked_fill_(page > current, -torch.inf)
    return SelectionPlan(keep=keep, ok=~drop, drop=drop, bias=bias, k=k, n_pages=n_pages)


def select_pages(policy: BlockTopK, *, summaries: torch.Tensor, query: torch.Tensor,
                 slots: torch.Tensor | None = None, budgets: torch.Tensor | None = None, k: int = 0,
                 plan: SelectionPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The pages each query attends to, scored from the page summaries (Sparrow).

    For a query at slot \(s\) (its position: selection policies never evict) the candidate pages
    are \(0 \dots \lfloor s / p \rfloor\); the first ``keep_first_pages`` and the last
    ``keep_last_pages`` of them are forced; the rest compete by
    \(\bar k_{\text{page}} \cdot \bar q = \frac{1}{G}\sum_g \bar k_{\text{page}} \cdot q_g\) (the
    mean over its KV group's query heads) for the remaining places of
    [`keep_counts`][sparsecorr.decoding.policies.block_topk.keep_counts].

    Per layer this is the group mean of the queries (float32, `group_query`: the score is linear
    in the query, so the mean of the group's scores is the score of the group's mean query), a
    GEMM against the summaries as stored (`matmul_f32`), the plan's bias (forced pages and
    future pages), a top-k, and a sort of the page ids; everything that
    depends on the step only is in ``plan`` (built here from ``slots``, ``budgets`` and ``k`` when
    not given; an engine builds it once per step with
    `selection_plan`).

    Args:
        summaries: mean key of every complete page, or any positive multiple of it such as the
            engine's running page sums (the ranking is the same; entries of incomplete pages are
            ignored). Float32 summaries are read as they are (the queries are upcast).
        query: the step's queries (post-RoPE).
        slots: slot of each query's token (not needed with ``plan``).
        budgets: budget in force for each query (-1 = dense; not needed with ``plan``).
        k: at least the largest keep count (a host int, so no device sync is needed).
        plan: the step's `SelectionPlan`.

    Shapes:
        summaries ``[B, H_kv, P, D]``; query ``[B, H_q, Q, D]``; slots, budgets ``[B, Q]`` ->
        pages ``[B, H_kv, Q, k]`` (ascending; unused entries last, set to P) and ok
        ``[B, H_kv, Q, k]`` bool.
    """
    b, h, n_pages, _ = summaries.shape
    q_len = query.shape[2]
    if plan is None:
        plan = selection_plan(policy, slots=slots, budgets=budgets, k=k, n_pages=n_pages)
    score = matmul_f32(group_query(query, h), summaries.transpose(-1, -2)) + plan.bias  # [B, H, Q, P]
    top = score.topk(plan.k, dim=-1).indices
    pages = top.masked_fill_(plan.drop, n_pages).sort(-1).values
    return pages, plan.ok.expand(b, h, q_len, plan.k)


def group_query(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    r"""The mean query of each KV group, in float32 (one op):
    \(\bar q_{h} = \frac{1}{G}\sum_{g} q_{hG+g}\).

    Shapes:
        query ``[B, H_kv · G, Q, D]`` -> ``[B, H_kv, Q, D]`` float32.
    """
    b, hq, q_len, d = query.shape
    return query.reshape(b, kv_heads, hq // kv_heads, q_len, d).mean(2, dtype=torch.float32)


def rank_pages(*, summaries: torch.Tensor, query: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    r"""A single-token step's top-``k`` pages of one sparse layer, **the query's own page
    first**, then the other kept pages by score: three ops (the group-mean query, one
    ``baddbmm`` of it against the float32 summaries with the step's bias, a top-k).

    The same selection as [`select_pages`][sparsecorr.decoding.policies.block_topk.select_pages]
    (its first ``keep`` entries, as a set) without the fill and the sort: the plan's bias puts
    the query's own page (``2 · FORCED``) first and the other forced pages (``FORCED``) before
    every scored page, so a caller that knows ``keep`` per row (the plan) reads entries
    ``[0, keep)`` and ignores the rest (valid page ids below ``P``, so they can be gathered).
    The engine's single-token steps use it on both paths: the gather path gathers the pages'
    slots; the paged path writes the ranks into the kernel's page table with the own page last
    ([`selection_offsets`][sparsecorr.decoding.backends.paging.selection_offsets]).

    Args:
        summaries: the running float32 page sums ``[B, H_kv, P, D]`` (contiguous).
        query: ``[B, H_q, Q, D]``.
        bias: the plan's bias per (row, KV head): ``[B · H_kv, Q, P]`` float32 (built once per
            step from `SelectionPlan.bias`).
        k: the plan's ``k``.

    Shapes:
        -> ``[B, H_kv, Q, k]`` long.
    """
    b, h, n_pages, d = summaries.shape
    q_bar = group_query(query, h)
    q_len = q_bar.shape[2]
    score = torch.baddbmm(bias, q_bar.reshape(b * h, q_len, d), summaries.reshape(b * h, n_pages, d).transpose(1, 2))
    return score.topk(k, dim=-1).indices.reshape(b, h, q_len, k)


def pages_to_mask(pages: torch.Tensor, ok: torch.Tensor, *, page_size: int, slots: int) -> torch.Tensor:
    """Slot mask of selected pages: ``[B, H_kv, Q, K]`` pages -> ``[B, H_kv, Q, slots]`` bool."""
    n_pages = -(-slots // page_size)
    chosen = torch.zeros(*pages.shape[:-1], n_pages + 1, dtype=torch.bool, device=pages.device)
    chosen.scatter_(-1, torch.where(ok, pages, n_pages).clamp(max=n_pages).long(), True)
    return chosen[..., :n_pages].repeat_interleave(page_size, dim=-1)[..., :slots]


def gather_mask(keep: torch.Tensor, query_slot: torch.Tensor, *, k: int, page_size: int) -> torch.Tensor:
    r"""Which of a single-token step's ``k · page_size`` gathered slots the query reads, the same
    in every sparse layer: entry \(i\) of a row's page list from `rank_pages` holds a kept page
    while \(i < \mathrm{keep}\), and entry 0 is the query's own page (ranked first), so slot \(j\)
    of entry \(i\) is read iff \(0 < i < \mathrm{keep}\), or \(i = 0\) and
    \(j \le s \bmod p\) (the query's slot \(s\)).

    Shapes:
        keep, query_slot ``[B, 1]`` -> ``[B, 1, k · page_size]`` bool.
    """
    n = torch.arange(k * page_size, device=keep.device)
    entry, j = n // page_size, n % page_size
    return (((entry > 0) & (entry < keep)) | ((entry == 0) & (j <= query_slot % page_size)))[:, None, :]


@dataclass
class Selection:
    """BlockTopK's part of a step (planned once per forward on the host).

    Shapes:
        pages ``[B, Q]`` (device): the page of each write slot (the running page sums' index);
        select: the decode phase (sparse layers select); query_slots, budgets ``[B, Q]``
        (device; select only); keep ``[B, Q]`` (device; None in a captured step, which derives
        it); keep_host ``[B, Q]`` CPU; keep_max: entries of each layer's selection (host; a
        captured step's fixed ``static_pages``); plan: the step's `SelectionPlan` (`derive`);
        gather: a single-token selection's bias, k, gather offsets and mask (its first sparse
        layer makes it).
    """

    pages: torch.Tensor
    select: bool = False
    query_slots: torch.Tensor | None = None
    budgets: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    keep_host: torch.Tensor | None = field(default=None, metadata={"host": True})
    keep_max: int = 0
    plan: SelectionPlan | None = None
    gather: tuple | None = None


class SelectionState(PolicyState):
    """BlockTopK's running page sums ``summ_all`` ``[L, B, H_kv, P, D]`` float32 (``summ[i]`` per
    layer; the scratch page's entry collects padding and is never read) and its hooks."""

    def __init__(self, policy, pool, *, q_heads: int, table: torch.Tensor) -> None:
        super().__init__(policy, pool, q_heads=q_heads, table=table)
        b, h, _, d = pool.k[0].shape
        self.summ_all = torch.zeros(len(pool.k), b, h, pool.pages_per_row, d, dtype=torch.float32,
                                    device=pool.k[0].device)
        self.summ = list(self.summ_all.unbind(0))
        self.keep_cap = self._keep_cap(table)

    def _keep_cap(self, table: torch.Tensor) -> int:
        """Most pages a sparse layer keeps in this run (a static size for CUDA graphs)."""
        ppr, pol = self.pool.pages_per_row, self.policy
        if bool((table[1:] < 0).any()):
            return ppr
        return min(ppr, max(int(table[1:].max()) // pol.page_size, pol.keep_first_pages + pol.keep_last_pages))

    @property
    def static_pages(self) -> int:
        return self.keep_cap

    def buffers(self) -> list[torch.Tensor]:
        return [self.summ_all]

    def added_to(self) -> list[torch.Tensor]:
        return [self.summ_all]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.summ_all = take_rows(self.summ_all, rows)
        self.summ = list(self.summ_all.unbind(0))

    def plan(self, inputs: PlanInputs) -> Selection:
        pol, dev = self.policy, inputs.to_dev
        part = Selection(pages=dev(inputs.slots // pol.page_size))
        if inputs.decode:
            i = inputs.offsets
            qslots = inputs.count[:, None] + i
            budgets = inputs.budget_at(inputs.ctx[:, None] + i + 1)
            keep = keep_counts(pol, slots=qslots, budgets=budgets)
            part.select, part.keep_host = True, keep
            part.keep_max = self.keep_cap if inputs.static else int(keep.max())
            part.query_slots, part.budgets = dev(qslots), dev(budgets)
            part.keep = None if inputs.static else dev(keep)
        return part

    def derive(self, part: Selection) -> None:
        part.gather = None  # made by the step's first sparse layer
        if part.select:
            part.plan = selection_plan(self.policy, slots=part.query_slots, budgets=part.budgets, k=part.keep_max,
                                       n_pages=self.pool.pages_per_row, keep=part.keep)

    def page_selection(self, part: Selection) -> tuple[torch.Tensor | None, int]:
        if not part.select:
            return None, 0
        return part.keep_host[:, 0], min(part.keep_max, self.pool.pages_per_row)

    def needs_mask(self, decode: bool) -> bool:
        return decode  # a selecting chunk combines its page mask with the step's mask

    def _per_layer(self, step) -> bool:
        """Whether this forward adds its keys to the page sums layer by layer (with each K write)
        instead of once for every layer after the last layer's write (`add_page_sums`).

        Deferring is exact where no layer reads a page sum its own write changed: a prefill
        forward reads none (it attends densely), and a single-token step's write goes to the
        query's own page, which is always kept (``keep_last_pages >= 1``: its bias outranks
        every score, so its stale sum changes no selection). A multi-token selecting forward (a
        teacher-forced chunk) can complete a page that a later query of the chunk scores, and
        the per-layer K/V tensors of autograd have no stacked view: both per layer."""
        return (step.part.select and step.q_len > 1) or self.pool.k_all is None

    def written(self, layer: int, key: torch.Tensor, step) -> None:
        if self._per_layer(step):
            b, h, q, d = key.shape
            pages = step.part.pages[:, None, :, None].expand(b, h, q, d)
            self.summ[layer].scatter_add_(2, pages, key.detach().float())

    def all_written(self, step) -> None:
        if not self._per_layer(step):
            self.add_page_sums(step.slots, step.part.pages)

    def add_page_sums(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Add a forward's keys of every layer (already written at ``slots``) to the running
        float32 sums of their ``pages``: a gather, a cast and one ``scatter_add_`` for all layers,
        once per step. Shapes: slots, pages ``[B, Q]`` (device, long)."""
        new, shape = self.pool.new_keys(slots)
        self.summ_all.scatter_add_(3, pages[None, :, None, :, None].expand(shape), new.float())

    def attend(self, cache, layer: int, query, key, value, scaling: float) -> torch.Tensor:
        if layer < self.policy.dense_layers or not cache.step.part.select:
            return cache.attend_dense(layer, query, key, value, scaling)
        return self._attend_selected(cache, layer, query, key, value, scaling)

    def _attend_selected(self, cache, layer: int, query, key, value, scaling: float) -> torch.Tensor:
        st, pool, backend = cache.step, self.pool, cache.backend
        part, ps = st.part, pool.page_size
        if st.q_len > 1:  # a teacher-forced chunk: one page mask per query
            pages, ok = select_pages(self.policy, summaries=self.summ[layer], query=query, plan=part.plan)
            sel = pages_to_mask(pages, ok, page_size=ps, slots=st.kv_len)
            return backend.attend(query, key, value, sel & st.mask, scaling=scaling)
        # one token: the top pages in rank order, the query's own page first (`rank_pages`: three
        # ops, no fill, no sort); a row's first keep_b ranks are its selection
        b, h = self.summ_all.shape[1:3]
        if part.gather is None:  # the step's part: the same for every sparse layer
            plan = part.plan
            bias = plan.bias.expand(b, h, 1, plan.n_pages).reshape(b * h, 1, plan.n_pages)
            if st.paged:  # the kernel's table counts keep_b pages per row; the ranks below it
                part.gather = (bias, plan.k, None, plan.ok[:, :, 0].expand(b, h, plan.k))
            else:  # the gathered pages' slot offsets and mask
                allowed = gather_mask(plan.keep[:, :1], part.query_slots[:, :1], k=plan.k, page_size=ps)
                part.gather = (bias, plan.k, torch.arange(ps, device=query.device), allowed[:, :, None, :])
        bias, k, offsets, mask = part.gather
        top = rank_pages(summaries=self.summ[layer], query=query, bias=bias, k=k)  # [B, H, 1, k]
        if st.paged:  # written into the kernel's page table, the own page last (scatter_selected_pages)
            return backend.decode(query, pool.k[layer], pool.v[layer], selected=(top[:, :, 0], mask))
        # gather the selected pages (O(budget) attention instead of O(S)); the own page first, so
        # the slot mask is the step's, not the layer's
        slot = torch.add(offsets, top[..., None], alpha=ps).reshape(b, h, -1)  # in range: pages < P
        idx = slot[..., None].expand(-1, -1, -1, pool.k[layer].shape[-1])
        k_sel, v_sel = pool.k[layer].gather(2, idx), pool.v[layer].gather(2, idx)
        return backend.attend(query, k_sel, v_sel, cache.step_mask(mask, query.dtype), scaling=scaling)

    def attended(self, after, *, ctx, budget_at, layers) -> torch.Tensor:
        """Dense layers read every valid slot; sparse layers their kept pages (the current page
        partly)."""
        q_len, ps = after.shape[1], self.policy.page_size
        slot = after - 1
        budgets = budget_at(ctx[:, None] - q_len + torch.arange(1, q_len + 1))
        keep = keep_counts(self.policy, slots=slot, budgets=budgets)
        sparse = (keep - 1) * ps + (slot - (slot // ps) * ps + 1)
        dense = min(self.policy.dense_layers, layers)
        return (dense * after + (layers - dense) * sparse).float() / layers


@dataclass(frozen=True)
class BlockTopK(KVPolicy):
    """Page selection by mean-key · mean-query score (see the module docstring)."""

    name: ClassVar[str] = "block_topk"
    kind: ClassVar[Kind] = "selection"
    state_type: ClassVar[type[PolicyState]] = SelectionState
    page_size: int = 16
    keep_first_pages: int = 1
    keep_last_pages: int = 2
    dense_layers: int = 2

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, minimum=1)
        check_int("keep_first_pages", self.keep_first_pages, minimum=0)
        # the page holding the current token must be attended (it is the query's own page)
        check_int("keep_last_pages", self.keep_last_pages, minimum=1)
        check_int("dense_layers", self.dense_layers, minimum=0)

    @property
    def pool_page_size(self) -> int:
        return self.page_size

    def attend_mask(self, *, keys: torch.Tensor, query: torch.Tensor, valid: torch.Tensor,
                    positions: torch.Tensor, budget: int, layer_idx: int) -> torch.Tensor:
        """The rule, restated over a whole cache (rescans every key; the engine uses page
        summaries instead). Slots this step attends to: ``[B, H_kv, S]`` bool ⊆ ``valid``.

        Shapes:
            keys ``[B, H_kv, S, D]``; query ``[B, H_q, 1, D]``; valid ``[B, H_kv, S]``.
        """
        if layer_idx < self.dense_layers:
            return valid
        b, h, _, d = keys.shape
        ps = self.page_size
        # pages by true position (not slot index), so padding or batching cannot shift them
        n_pages = int(torch.where(valid, positions, 0).max()) // ps + 1
        page = torch.where(valid, positions // ps, n_pages)  # invalid slots -> a dump page
        kv = keys.float() * valid[..., None]
        sums = kv.new_zeros(b, h, n_pages + 1, d).scatter_add_(2, page[..., None].expand(-1, -1, -1, d), kv)
        counts = kv.new_zeros(b, h, n_pages + 1).scatter_add_(2, page, valid.float())
        sums, counts = sums[:, :, :n_pages], counts[:, :, :n_pages]
        mean_k = sums / counts.clamp(min=1)[..., None]
        mean_q = query.float().reshape(b, h, -1, d).mean(2)  # mean over the group's query heads
        score = torch.einsum("bhpd,bhd->bhp", mean_k, mean_q)
        page_valid = counts > 0
        page_idx = torch.arange(n_pages, device=keys.device)
        last_valid = torch.where(page_valid, page_idx, -1).amax(-1, keepdim=True)
        forced = page_valid & ((page_idx < self.keep_first_pages)
                               | (page_idx > last_valid - self.keep_last_pages))
        score = torch.where(forced, torch.inf, score).masked_fill(~page_valid, -torch.inf)
        n_keep = min(max(budget // ps, self.keep_first_pages + self.keep_last_pages), n_pages)
        chosen = torch.zeros_like(page_valid)
        chosen.scatter_(-1, score.topk(n_keep, dim=-1).indices, True)
        chosen &= page_valid
        return valid & chosen.gather(-1, page.clamp(max=n_pages - 1))
