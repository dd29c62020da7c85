"""Per-step work done once per step gives what the per-layer work gave (issue 36, phase 2).

Each test decodes the same batch twice, with today's engine and with the engine patched back to
the per-layer code it replaced, and asserts equal tokens, log-probs and kept-set sizes (bitwise:
the same math runs, only where it runs changes). Eager steps and the static-buffer step (the
CUDA-graph step run by `EagerRunner`), through SDPA and through the paged oracle backend.
"""

import pytest
import torch

import sparsecorr.decoding.policies.block_topk as topk_mod
from sparsecorr.decoding import RKV, BlockTopK, SnapKV
from sparsecorr.decoding.backends import PagedBackend, ReferenceDecodeKernel, TorchBackend
from sparsecorr.decoding.cache import SparseKVCache
from sparsecorr.decoding.policies import RingState, SelectionState
from tests.models import tiny_model
from tests.unit.decoding.drive import decode_steps


def _decode(model, ids, policy, budget, *, backend, graphs: bool, steps=12, events=None):
    lens = torch.full((ids.shape[0],), ids.shape[1])
    lens[0] -= 2  # ragged rows: a mask in every step
    fields, _ = decode_steps(model, ids, policy, budget, graphs=graphs, steps=steps, backend=backend, lens=lens,
                             events=events)
    return fields


def _same(got, ref):
    assert torch.equal(got["tokens"], ref["tokens"]) and torch.equal(got["lengths"], ref["lengths"])
    assert torch.equal(got["rollout_logp"], ref["rollout_logp"])
    assert torch.equal(got["kv_kept"], ref["kv_kept"])


def _backends():
    return [("torch", TorchBackend), ("paged", lambda: PagedBackend(ReferenceDecodeKernel, name="paged-oracle"))]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b[0])
def test_selection_plan_once_per_step_equals_per_layer(monkeypatch, backend, graphs):
    """BlockTopK: the step's `SelectionPlan` (its state's `derive`, in the planner or the captured
    forward) and the paged backend's CSR offsets (begin_step) built once per step, against the
    plan and the scatter's offsets built again in every sparse layer."""
    import sparsecorr.decoding.backends.paged as paged_mod

    model = tiny_model("qwen3", num_layers=3)
    ids = torch.randint(3, 128, (3, 21), generator=torch.Generator().manual_seed(0))
    policy = BlockTopK(page_size=4, dense_layers=1)
    ref_calls = []
    got = _decode(model, ids, policy, 8, backend=backend[1](), graphs=graphs)
    orig_scatter = paged_mod.scatter_selected_pages

    def per_layer_scatter(*args, offsets=None, **kw):
        ref_calls.append(offsets)
        return orig_scatter(*args, **kw)  # offsets rebuilt in the layer, as before

    attend, planned = SelectionState.attend, []

    def per_layer_plan(self, cache, layer, *a):  # the plan made again in every sparse layer
        part = cache.step.part
        if part.select and layer >= self.policy.dense_layers:
            part.plan = None
            self.derive(part)
            planned.append(layer)
        return attend(self, cache, layer, *a)

    monkeypatch.setattr(SelectionState, "attend", per_layer_plan)
    monkeypatch.setattr(paged_mod, "scatter_selected_pages", per_layer_scatter)
    ref = _decode(model, ids, policy, 8, backend=backend[1](), graphs=graphs)
    _same(got, ref)
    assert len(planned) >= 2 * 11  # two sparse layers, every decode step
    if backend[0] == "paged":
        assert ref_calls and all(o is not None for o in ref_calls)  # today's code passed them


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("policy", [SnapKV(window=3, buffer=2, sink=1), RKV(window=4, buffer=3)],
                         ids=lambda p: p.name)
def test_ring_window_equals_the_shift_window(monkeypatch, policy, graphs):
    """The observation ring (one scatter per layer and step, put in order at compression) hands
    every compression exactly the window the shifted window it replaced (cat + gather + copy per
    layer and step, kept here beside it) holds, with chunks longer than the window (prefill),
    ragged rows and compressions in prefill and decode; so the kept sets, tokens and log-probs
    are today's."""
    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (3, 21), generator=torch.Generator().manual_seed(1))
    shift: dict = {}  # layer -> the window as it was kept before the ring (oldest first)
    checked = []
    attend, in_order = SparseKVCache.attend, RingState.windows_in_order
    import sparsecorr.decoding.engine as engine_mod

    plan, real = engine_mod.Engine.plan, []

    def planned(self, q_len, got_real, **kw):  # each forward's real tokens per row, for the shift
        real[:] = [got_real]
        return plan(self, q_len, got_real, **kw)

    def shifted(self, layer, query, key, value, scaling):
        ring = self.state
        win = shift.get(layer, torch.zeros_like(ring.win[layer][:, :, :ring.window]))
        b, hq, w, d = win.shape
        both = torch.cat([win, query.detach().to(win.dtype)], dim=2)
        idx = real[0][:, None] + torch.arange(w)
        shift[layer] = both.gather(2, idx[:, None, :, None].expand(b, hq, w, d))
        return attend(self, layer, query, key, value, scaling)

    def compared(self, order, first=0, stop=None):  # every layer's window at once (the batched compression)
        ring = in_order(self, order, first, stop)
        for i in range(ring.shape[0]):
            assert torch.equal(ring[i], shift[first + i]), f"layer {first + i}: ring window != shifted window"
            checked.append(first + i)
        return ring

    events = []
    got = _decode(model, ids, policy, 8, backend=TorchBackend(), graphs=graphs, events=events)
    monkeypatch.setattr(engine_mod.Engine, "plan", planned)
    monkeypatch.setattr(SparseKVCache, "attend", shifted)
    monkeypatch.setattr(RingState, "windows_in_order", compared)
    ref = _decode(model, ids, policy, 8, backend=TorchBackend(), graphs=graphs, events=[])
    assert len(checked) >= 6 and len(events) >= 3  # compressions in prefill and in decode, every layer
    _same(got, ref)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b[0])
def test_running_page_sums_select_todays_pages(monkeypatch, backend, graphs):
    """BlockTopK: the running float32 page sums (added to by every K write) select, in every
    sparse layer of every step, the pages that today's page means (recomputed from the cached
    keys) select; float32 model, ragged prefill and decode."""
    import sparsecorr.decoding.cache as cache_mod
    from sparsecorr.decoding.policies import page_means

    model = tiny_model("qwen3", num_layers=3)
    ids = torch.randint(3, 128, (3, 21), generator=torch.Generator().manual_seed(2))
    policy = BlockTopK(page_size=4, dense_layers=1)
    select, compared = topk_mod.select_pages, []

    def both(pol, *, summaries, query, **kw):
        cache = cache_mod._ACTIVE.get()
        layer = next(i for i, s in enumerate(cache.state.summ) if s is summaries)
        keys = cache.pool.k[layer]
        means = page_means(keys, page_size=cache.pool.page_size)  # every page's mean, as stored before
        got = select(pol, summaries=summaries, query=query, **kw)
        want = select(pol, summaries=means, query=query, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {layer}"
        compared.append(layer)
        return got

    rank, ranked = topk_mod.rank_pages, []

    def both_ranked(*, summaries, query, bias, k):  # the gather path: the kept entries, as sets
        cache = cache_mod._ACTIVE.get()
        layer = next(i for i, s in enumerate(cache.state.summ) if s is summaries)
        means = page_means(cache.pool.k[layer], page_size=cache.pool.page_size)
        got = rank(summaries=summaries, query=query, bias=bias, k=k)
        want = rank(summaries=means.contiguous(), query=query, bias=bias, k=k)
        keep = cache.step.part.plan.keep[:, None, :, None]  # [B, 1, 1, 1]
        first = torch.arange(k) < keep
        assert torch.equal(torch.where(first, got, -1).sort(-1).values, torch.where(first, want, -1).sort(-1).values)
        ranked.append(layer)
        return got

    monkeypatch.setattr(topk_mod, "select_pages", both)
    monkeypatch.setattr(topk_mod, "rank_pages", both_ranked)
    _decode(model, ids, policy, 8, backend=backend[1](), graphs=graphs)
    assert len(compared) + len(ranked) >= 2 * 11  # two sparse layers, every decode step


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b[0])
def test_page_sums_once_per_step_select_todays_pages(monkeypatch, backend, graphs):
    """BlockTopK: the page sums added to once per step for every layer (after the last layer's
    write, `SelectionState.add_page_sums`) give the tokens, log-probs and, in every sparse layer of every
    step, the pages that the per-layer update (with each K write, as before) gives: 40 steps of
    4-token pages (crossing many page boundaries), ragged rows, a multi-page prefill."""
    model = tiny_model("qwen3", num_layers=3)
    ids = torch.randint(3, 128, (3, 13), generator=torch.Generator().manual_seed(4))
    policy = BlockTopK(page_size=4, dense_layers=1)
    seen: dict[str, list] = {"got": [], "ref": []}
    select, rank = topk_mod.select_pages, topk_mod.rank_pages

    def recorder(key):
        def sel(*a, **kw):
            out = select(*a, **kw)
            seen[key].append(out[0].clone())
            return out

        def rk(**kw):
            out = rank(**kw)
            seen[key].append(out.clone())
            return out
        return sel, rk

    sel, rk = recorder("got")
    monkeypatch.setattr(topk_mod, "select_pages", sel)
    monkeypatch.setattr(topk_mod, "rank_pages", rk)
    got = _decode(model, ids, policy, 12, backend=backend[1](), graphs=graphs, steps=40)
    sel, rk = recorder("ref")
    monkeypatch.setattr(topk_mod, "select_pages", sel)
    monkeypatch.setattr(topk_mod, "rank_pages", rk)
    monkeypatch.setattr(SelectionState, "_per_layer", lambda self, st: True)
    ref = _decode(model, ids, policy, 12, backend=backend[1](), graphs=graphs, steps=40)
    _same(got, ref)
    assert len(seen["got"]) == len(seen["ref"]) >= 2 * 39
    for a, b in zip(seen["got"], seen["ref"]):
        assert torch.equal(a, b)


def test_running_page_sums_are_the_page_sums_of_the_pool():
    """BlockTopK's state adds each written key to its page's float32 sum (padding to the scratch
    page), layer by layer (with grad) or once per step for every layer."""
    from types import SimpleNamespace

    from sparsecorr.decoding.policies.block_topk import Selection
    from sparsecorr.decoding.pool import KVPool

    g = torch.Generator().manual_seed(0)
    pool = KVPool(layers=1, batch=2, kv_heads=2, head_dim=3, capacity=12, page_size=4,
                  dtype=torch.bfloat16, device=torch.device("cpu"), positions=False, grad=False)
    state = BlockTopK(page_size=4).new_state(pool, q_heads=4, table=torch.full((32,), 8))
    count = torch.zeros(2, dtype=torch.long)
    for q_len in (5, 1, 3, 1, 1):
        real = torch.randint(0, q_len + 1, (2,), generator=g)
        i = torch.arange(q_len)
        slots = torch.where(i < real[:, None], count[:, None] + i, pool.scratch)
        key = torch.randn(2, 2, q_len, 3, generator=g).to(torch.bfloat16)
        step = SimpleNamespace(slots=slots, q_len=q_len, part=Selection(pages=slots // pool.page_size))
        pool.write(0, key, key, slots)
        state.written(0, key, step)
        state.all_written(step)
        count += real
    for b in range(2):
        n = int(count[b]) // 4  # complete pages
        want = pool.k[0][b, :, :n * 4].float().reshape(2, n, 4, 3).sum(2)
        torch.testing.assert_close(state.summ[0][b, :, :n], want, atol=1e-6, rtol=1e-6)


def test_ranked_pages_and_step_mask_read_the_selected_slots():
    """The single-token gather path (`rank_pages`: own page first, no fill, no sort; the step's
    `gather_mask`) reads exactly the slots that `select_pages` (ascending page list, its ``ok``
    entries) selects, causally: random summaries, slots and budgets (dense rows too)."""
    from sparsecorr.decoding.policies import gather_mask, rank_pages, select_pages, selection_plan

    g = torch.Generator().manual_seed(3)
    ps, n_pages, b, h = 4, 9, 5, 2
    for first, last in ((1, 2), (0, 1), (2, 3)):
        policy = BlockTopK(page_size=ps, keep_first_pages=first, keep_last_pages=last)
        for _ in range(20):
            slots = torch.randint(0, (n_pages - 1) * ps, (b, 1), generator=g)
            budgets = torch.randint(-1, 5 * ps, (b, 1), generator=g)
            query = torch.randn(b, h * 2, 1, 8, generator=g)
            summ = torch.randn(b, h, n_pages, 8, generator=g)
            plan = selection_plan(policy, slots=slots, budgets=budgets, k=n_pages, n_pages=n_pages)
            pages, ok = select_pages(policy, summaries=summ, query=query, plan=plan)
            want = torch.zeros(b, h, n_pages * ps + ps, dtype=torch.bool)
            slot = (pages[:, :, 0, :, None] * ps + torch.arange(ps)).reshape(b, h, -1)
            read = ok[:, :, 0, :, None].expand(-1, -1, -1, ps).reshape(b, h, -1) & (slot <= slots[:, :1, None])
            want.scatter_(2, torch.where(read, slot, n_pages * ps), True)
            bias = plan.bias.expand(b, h, 1, n_pages).reshape(b * h, 1, n_pages)
            top = rank_pages(summaries=summ, query=query, bias=bias, k=plan.k)
            assert (top < n_pages).all()  # every entry can be gathered
            slot = (top[:, :, 0, :, None] * ps + torch.arange(ps)).reshape(b, h, -1)
            mask = gather_mask(plan.keep[:, :1], slots, k=plan.k, page_size=ps).expand(b, h, -1)
            got = torch.zeros_like(want).scatter_(2, torch.where(mask, slot, n_pages * ps), True)
            assert torch.equal(got[..., :-ps], want[..., :-ps])
