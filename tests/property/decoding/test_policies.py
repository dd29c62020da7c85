"""Each policy's kept set equals a literal, loop-based re-statement of its rule; invariants."""

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecorr.decoding.policies import RKV, BlockTopK, SnapKV, StreamingLLM, compress


@st.composite
def kv(draw, max_s=24):
    b, hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    s, d, w = draw(st.integers(2, max_s)), 4, draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    keys = torch.randn(b, hkv, s, d, generator=gen)
    queries = torch.randn(b, hkv * g, w, d, generator=gen)
    n_valid = torch.randint(1, s + 1, (b,), generator=gen)
    valid = (torch.arange(s)[None] >= (s - n_valid)[:, None])[:, None].expand(b, hkv, s).clone()
    positions = (torch.arange(s)[None] - (s - n_valid)[:, None]).clamp(min=0)[:, None].expand(b, hkv, s).clone()
    budget = draw(st.integers(1, s))
    return keys, queries, valid, positions, budget


def _loop_snapkv_scores(keys, queries, valid, kernel, *, causal=False):
    """Pooled window votes. ``causal`` (SnapKV since issue 51, as ``SnapKVCluster``): window query
    ``t`` (oldest first) is the token of the ``t``-th of the last ``W`` valid keys and sees the keys
    up to its own (all of them if its own is gone); only the keys before the window are voted for
    and pooled. Otherwise (R-KV's ``scoring="minmax"``): every query sees every valid key."""
    b, h, s, d = keys.shape
    g = queries.shape[1] // h
    w = queries.shape[2]
    out = torch.zeros(b, h, s, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            idx = [j for j in range(s) if valid[bi, hi, j]]
            votes = [0.0] * s
            for gi in range(g):
                for wi in range(w):
                    q = queries[bi, hi * g + gi, wi].double()
                    own = len(idx) - w + 1 + wi  # keys of rank <= own are visible
                    seen = idx[:own] if causal and own >= 1 else idx
                    logits = [float(q @ keys[bi, hi, j].double()) / math.sqrt(d) for j in seen]
                    m = max(logits)
                    z = sum(math.exp(x - m) for x in logits)
                    for j, x in zip(seen, logits):
                        votes[j] += math.exp(x - m) / z / g
            if causal:  # votes for the keys before the window only
                votes = [v if j in idx[:max(len(idx) - w, 0)] else 0.0 for j, v in enumerate(votes)]
            pad = kernel // 2
            for j in range(s):
                window = [votes[t] for t in range(j - pad, j + pad + 1) if 0 <= t < s]
                out[bi, hi, j] = max(window)
    return out


def _loop_keep(scores, valid, positions, budget, sink, recent):
    """The rule, literally: the budget is a hard cap; protected tokens (first ``sink`` and last
    ``recent`` by position) come first, most recent first; then the others by score, ties to
    the more recent; the kept positions, sorted."""
    b, h, s = valid.shape
    kept = []
    for bi in range(b):
        for hi in range(h):
            idx = [j for j in range(s) if valid[bi, hi, j]]
            by_pos = sorted(idx, key=lambda j: int(positions[bi, hi, j]))
            protected = set(by_pos[:sink]) | (set(by_pos[len(by_pos) - recent:]) if recent else set())
            order = sorted(protected, key=lambda j: -int(positions[bi, hi, j]))
            order += sorted((j for j in idx if j not in protected),
                            key=lambda j: (-float(scores[bi, hi, j]), -int(positions[bi, hi, j])))
            kept.append(sorted(int(positions[bi, hi, j]) for j in order[:budget]))
    return kept


def _kept_positions(keep, positions):
    b, h, _ = keep.index.shape
    return [sorted(int(positions[bi, hi, int(j)]) for j, v in zip(keep.index[bi, hi], keep.valid[bi, hi]) if v)
            for bi in range(b) for hi in range(h)]


@given(kv(), st.integers(0, 3))
@settings(max_examples=40)
def test_streaming_llm_keeps_sinks_and_most_recent(data, sink):
    keys, queries, valid, positions, budget = data
    keep = compress(StreamingLLM(sink=sink), keys=keys, queries=queries, valid=valid,
                    positions=positions, budget=budget)
    scores = positions.double()  # StreamingLLM's score: recency
    assert _kept_positions(keep, positions) == _loop_keep(scores, valid, positions, budget, sink, 0)
    for got, n in zip(_kept_positions(keep, positions), valid.sum(-1).reshape(-1).tolist()):
        if budget >= sink:  # the usual regime: every sink plus the most recent tokens
            k = min(budget, n)
            assert got == sorted(set(range(min(sink, k))) | set(range(n - (k - min(sink, k)), n)))


@given(kv(max_s=14), st.sampled_from([1, 3]))
@settings(max_examples=25)
def test_snapkv_equals_loop_reference(data, kernel):
    keys, queries, valid, positions, budget = data
    pol = SnapKV(window=queries.shape[2], kernel=kernel, sink=0)
    scores = pol.score(keys=keys, queries=queries, valid=valid, positions=positions)
    ref = _loop_snapkv_scores(keys, queries, valid, kernel, causal=True)
    torch.testing.assert_close(torch.where(valid, scores.double(), 0.0), torch.where(valid, ref, 0.0),
                               atol=1e-5, rtol=1e-5)
    keep = compress(pol, keys=keys, queries=queries, valid=valid, positions=positions, budget=budget)
    expect = _loop_keep(ref, valid, positions, budget, 0, queries.shape[2])
    assert _kept_positions(keep, positions) == expect


@given(kv(max_s=14))
@settings(max_examples=25)
def test_rkv_redundancy_equals_loop_and_invariants(data):
    keys, queries, valid, positions, budget = data
    from sparsecorr.decoding.policies import key_redundancy

    red = key_redundancy(keys, valid)
    b, h, s, _ = keys.shape
    for bi in range(b):
        for hi in range(h):
            idx = [j for j in range(s) if valid[bi, hi, j]]
            for j in idx:
                others = [t for t in idx if t != j]
                if not others:
                    continue
                cos = [float(torch.nn.functional.cosine_similarity(keys[bi, hi, j], keys[bi, hi, t], dim=0))
                       for t in others]
                assert abs(float(red[bi, hi, j]) - sum(cos) / len(cos)) < 1e-5
    pol = RKV(window=queries.shape[2], buffer=0)
    keep = compress(pol, keys=keys, queries=queries, valid=valid, positions=positions, budget=budget)
    for got, n in zip(_kept_positions(keep, positions), valid.sum(-1).reshape(-1).tolist()):
        assert len(got) == min(budget, n)  # the budget is a hard cap
        assert got == sorted(got) and len(set(got)) == len(got)
        recent = set(range(max(0, n - min(pol.window, budget)), n))
        assert recent <= set(got)  # the observation window is kept (most recent first)


@given(kv(max_s=40), st.sampled_from([2, 4]))
@settings(max_examples=30)
def test_block_topk_selection_rule(data, page):
    keys, queries, valid, positions, budget = data
    pol = BlockTopK(page_size=page, keep_first_pages=1, keep_last_pages=1, dense_layers=1)
    query = queries[:, :, -1:]
    assert torch.equal(pol.attend_mask(keys=keys, query=query, valid=valid, positions=positions,
                                       budget=budget, layer_idx=0), valid)  # dense layer
    mask = pol.attend_mask(keys=keys, query=query, valid=valid, positions=positions,
                           budget=budget, layer_idx=1)
    b, h, s, _ = keys.shape
    g = query.shape[1] // h
    for bi in range(b):
        for hi in range(h):
            pages = {}
            for j in range(s):
                if valid[bi, hi, j]:
                    pages.setdefault(int(positions[bi, hi, j]) // page, []).append(j)
            mq = query[bi, hi * g:(hi + 1) * g, 0].double().mean(0)
            score = {p: float(keys[bi, hi, js].double().mean(0) @ mq) for p, js in pages.items()}
            first, last = min(pages), max(pages)
            n_keep = min(max(budget // page, 2), len(pages))
            forced = {first, last}
            rest = sorted((p for p in pages if p not in forced), key=lambda p: -score[p])
            chosen = forced | set(rest[: max(0, n_keep - len(forced))])
            expect = {j for p in chosen for j in pages[p]}
            got = {j for j in range(s) if mask[bi, hi, j]}
            assert got == expect


def _loop_rkv_keep(keys, queries, valid, positions, budget, pol):
    """``RKV(scoring="minmax")``'s kept set, restated with loops: pooled window votes and mean pairwise cosine
    similarity, each min-max normalised per (row, head), mixed, then the keep rule."""
    imp = _loop_snapkv_scores(keys, queries, valid, pol.kernel)
    b, h, s, _ = keys.shape
    red = torch.zeros(b, h, s, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            idx = [j for j in range(s) if valid[bi, hi, j]]
            for j in idx:
                cos = [float(torch.nn.functional.cosine_similarity(keys[bi, hi, j].double(),
                                                                   keys[bi, hi, t].double(), dim=0))
                       for t in idx if t != j]
                red[bi, hi, j] = sum(cos) / max(len(cos), 1)

    def minmax(x, bi, hi, idx):
        lo, hi_ = min(float(x[bi, hi, j]) for j in idx), max(float(x[bi, hi, j]) for j in idx)
        return {j: (float(x[bi, hi, j]) - lo) / max(hi_ - lo, 1e-12) for j in idx}

    score = torch.full((b, h, s), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            idx = [j for j in range(s) if valid[bi, hi, j]]
            mi, mr = minmax(imp, bi, hi, idx), minmax(red, bi, hi, idx)
            for j in idx:
                score[bi, hi, j] = pol.mix * mi[j] - (1 - pol.mix) * mr[j]
    return score, _loop_keep(score, valid, positions, budget, pol.sink, pol.window)


@given(kv(max_s=14))
@settings(max_examples=25)
def test_rkv_redundancy_and_kept_set_equal_loop(data):
    from hypothesis import assume

    from sparsecorr.decoding.policies import key_redundancy

    keys, queries, valid, positions, budget = data
    red = key_redundancy(keys, valid)
    assert torch.isfinite(red).all() and (red[~valid] == 0).all()
    pol = RKV(window=queries.shape[2], kernel=3, buffer=0, scoring="minmax")
    score, expect = _loop_rkv_keep(keys, queries, valid, positions, budget, pol)
    for bi in range(score.shape[0]):  # tie-free inputs only (a near-tie may flip at 1e-7)
        for hi in range(score.shape[1]):
            v = sorted(float(x) for x in score[bi, hi] if x > float("-inf"))
            assume(all(b - a > 1e-5 for a, b in itertools.pairwise(v)))
    got = pol.score(keys=keys, queries=queries, valid=valid, positions=positions)
    torch.testing.assert_close(torch.where(valid, got.double(), 0.0), torch.where(valid, score, 0.0),
                               atol=1e-5, rtol=0)
    keep = compress(pol, keys=keys, queries=queries, valid=valid, positions=positions, budget=budget)
    assert _kept_positions(keep, positions) == expect


@given(kv(max_s=40), st.sampled_from([2, 4]), st.integers(1, 2), st.data())
@settings(max_examples=30)
def test_block_topk_page_summaries_select_what_the_rescan_selects(data, page, keep_last, draw):
    """Scoring pages from running summaries (mean key of each complete page) gives the rescan
    rule's selection, for every query of a chunk (per-query budgets and current pages)."""
    from sparsecorr.decoding.policies.block_topk import page_means, pages_to_mask, select_pages

    keys, queries, _, _, _ = data
    b, h, s, _ = keys.shape
    pol = BlockTopK(page_size=page, keep_first_pages=1, keep_last_pages=keep_last, dense_layers=0)
    n_pages = -(-s // page)
    padded = torch.nn.functional.pad(keys, (0, 0, 0, n_pages * page - s))
    summ = page_means(padded, page_size=page)
    q_len = queries.shape[2]
    slots = torch.tensor([[s - q_len + i for i in range(q_len)]] * b).clamp(min=0)
    budgets = torch.tensor([[draw.draw(st.integers(1, s)) for _ in range(q_len)] for _ in range(b)])
    pages, ok = select_pages(pol, summaries=summ, query=queries, slots=slots, budgets=budgets, k=n_pages)
    mask = pages_to_mask(pages, ok, page_size=page, slots=s)
    pos = torch.arange(s).expand(b, h, s)
    for i in range(q_len):
        for bi in range(b):
            sl = int(slots[bi, i])
            valid = (pos[bi:bi + 1] <= sl)
            want = pol.attend_mask(keys=keys[bi:bi + 1], query=queries[bi:bi + 1, :, i:i + 1], valid=valid,
                                   positions=pos[bi:bi + 1], budget=int(budgets[bi, i]), layer_idx=0)
            assert torch.equal(mask[bi, :, i] & valid[0], want[0]), (bi, i)  # engine: & causal
