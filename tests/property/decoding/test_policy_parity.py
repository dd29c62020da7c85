"""Issue 36: the closed-form R-KV, the argsort-free ``compress``, the op-lean ``group_scores`` and
BlockTopK's planned ``select_pages`` / ranked, offset ``scatter_selected_pages`` give what the code of
commit 1ac3959 gave (``reference_policies``, kept verbatim): scores to float rounding, identical
kept sets and pages on inputs without near-ties, in float32 and bf16."""

import itertools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sparsecorr.decoding.backends.paging import scatter_selected_pages, selection_offsets
from sparsecorr.decoding.policies import (
    RKV,
    BlockTopK,
    SnapKV,
    StreamingLLM,
    compress,
    key_redundancy,
)
from sparsecorr.decoding.policies.base import matmul_f32, merge_rows, split_rows
from sparsecorr.decoding.policies.block_topk import rank_pages, select_pages, selection_plan
from tests.property.decoding import reference_policies as ref

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@st.composite
def cache(draw, max_s=24, d=8):
    """Keys/queries of a pool whose valid slots hold increasing positions (the engine's layout:
    a valid prefix, or a left-padded suffix), and a per-row budget."""
    b, hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    s, w = draw(st.integers(2, max_s)), draw(st.integers(1, 4))
    dtype = draw(DTYPES)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    keys = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    queries = torch.randn(b, hkv * g, w, d, generator=gen).to(dtype)
    n_valid = torch.randint(1, s + 1, (b,), generator=gen)
    if draw(st.booleans()):  # valid prefix [0, n) (the pool), positions with gaps (after eviction)
        valid = torch.arange(s)[None] < n_valid[:, None]
        positions = torch.randint(1, 4, (b, s), generator=gen).cumsum(-1)
    else:  # left padding
        valid = torch.arange(s)[None] >= (s - n_valid)[:, None]
        positions = (torch.arange(s)[None] - (s - n_valid)[:, None]).clamp(min=0)
    valid = valid[:, None].expand(b, hkv, s)
    positions = positions[:, None].expand(b, hkv, s).clone()
    budget = torch.tensor([draw(st.integers(1, s)) for _ in range(b)])
    qv = None
    if draw(st.booleans()):
        qv = torch.arange(w)[None] >= torch.randint(0, w, (b,), generator=gen)[:, None]
    return keys, queries, valid, positions, budget, qv


def _tie_free(x, valid, gap):
    """Distinct valid values of each row are more than ``gap`` apart (exact ties allowed)."""
    for row, v in zip(x.reshape(-1, x.shape[-1]), valid.reshape(-1, x.shape[-1])):
        vals = sorted(set(float(t) for t in row[v]))
        if any(b - a <= gap for a, b in itertools.pairwise(vals)):
            return False
    return True


def _ranges_ok(x, valid, gap):
    """Every row with two or more valid slots spans more than ``gap`` (min-max is well posed)."""
    lo = torch.where(valid, x, torch.inf).amin(-1)
    hi = torch.where(valid, x, -torch.inf).amax(-1)
    return bool(((hi - lo > gap) | (valid.sum(-1) < 2)).all())


def _kept(index, valid):
    return [sorted(int(j) for j, v in zip(ir, vr) if v) for ir, vr in
            zip(index.reshape(-1, index.shape[-1]), valid.reshape(-1, valid.shape[-1]))]


@given(cache(), st.sampled_from([1, 64]))
@settings(max_examples=40)
def test_key_redundancy_closed_form_equals_todays(data, chunk):
    keys, _, valid, _, _, _ = data
    got = key_redundancy(keys, valid)
    want = ref.key_redundancy(keys, valid, chunk=chunk)
    tol = 1e-6 if keys.dtype == torch.float32 else 2e-5  # bf16: the weights ride as two bf16 rows
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    assert got.dtype == torch.float32 and (got[~valid] == 0).all()


def test_key_redundancy_zero_key_and_single_key():
    keys = torch.randn(1, 1, 4, 8)
    keys[0, 0, 1] = 0.0
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    torch.testing.assert_close(key_redundancy(keys, valid), ref.key_redundancy(keys, valid), atol=1e-6, rtol=0)
    one = torch.tensor([[[True, False, False, False]]])
    assert (key_redundancy(keys, one) == 0).all()


@given(cache())
@settings(max_examples=40)
def test_snapkv_and_rkv_scores_equal_todays(data):
    keys, queries, valid, positions, _, qv = data
    w = queries.shape[2]
    tol = 1e-5 if keys.dtype == torch.float32 else 1e-4
    snap = SnapKV(window=w, kernel=3)
    got = snap.score(keys=keys, queries=queries, valid=valid, positions=positions, query_valid=qv)
    want = ref.snapkv_score(snap, keys, queries, valid, qv)
    torch.testing.assert_close(torch.where(valid, got, 0.0), torch.where(valid, want, 0.0), atol=tol, rtol=0)
    rkv = RKV(window=w, kernel=3, scoring="minmax")
    imp = ref.pool_scores(ref.group_scores(queries, keys, valid, qv).masked_fill(~valid, 0), kernel=3, pooling="max")
    # min-max of a near-constant term amplifies rounding: such rows are near-ties by definition
    assume(_ranges_ok(imp, valid, 1e-3) and _ranges_ok(ref.key_redundancy(keys, valid), valid, 1e-3))
    got = rkv.score(keys=keys, queries=queries, valid=valid, positions=positions, query_valid=qv)
    want = ref.rkv_score(rkv, keys, queries, valid, qv)
    torch.testing.assert_close(torch.where(valid, got, 0.0), torch.where(valid, want, 0.0), atol=50 * tol, rtol=0)


@pytest.mark.parametrize("make", [lambda w: StreamingLLM(sink=2, window=1), lambda w: SnapKV(window=w, kernel=3),
                                  lambda w: SnapKV(window=w, kernel=1, sink=1, pooling="avg"),
                                  lambda w: RKV(window=w, kernel=3, scoring="minmax"),
                                  lambda w: RKV(window=w, kernel=1, sink=2, scoring="minmax")],
                         ids=["streaming", "snapkv", "snapkv-avg-sink", "rkv", "rkv-sink"])
@given(data=cache())
@settings(max_examples=30)
def test_compress_keeps_todays_sets(make, data):
    keys, queries, valid, positions, budget, qv = data
    pol = make(queries.shape[2])
    want_scores = ref.score(pol, keys, queries, valid, positions, qv)
    if pol.name == "rkv":
        imp = ref.pool_scores(ref.group_scores(queries, keys, valid, qv).masked_fill(~valid, 0), kernel=pol.kernel,
                              pooling="max")
        assume(_ranges_ok(imp, valid, 1e-3) and _ranges_ok(ref.key_redundancy(keys, valid), valid, 1e-3))
    assume(_tie_free(want_scores, valid, 1e-3 if keys.dtype == torch.bfloat16 else 1e-4))
    want_index, want_valid = ref.compress_from_scores(pol, want_scores, valid=valid, positions=positions,
                                                      budget=budget)
    keep = compress(pol, keys=keys, queries=queries, valid=valid, positions=positions, budget=budget,
                    query_valid=qv, max_budget=int(budget.max()))
    assert _kept(keep.index, keep.valid) == _kept(want_index, want_valid)
    assert torch.equal(keep.valid, want_valid)  # kept entries first, then the dropped ones
    assert torch.equal(torch.where(keep.valid, keep.index, -1), torch.where(want_valid, want_index, -1))


@given(st.integers(1, 6), st.integers(1, 40), DTYPES, st.integers(0, 2**31 - 1))
@settings(max_examples=30)
def test_matmul_f32_and_split_rows(m, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(2, m, 16, generator=gen).to(dtype)
    b = torch.randn(2, 16, n, generator=gen).to(dtype)
    got = matmul_f32(a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, a.float() @ b.float(), atol=1e-5, rtol=1e-6)
    x = torch.randn(2, m, 16, generator=gen)  # float32 rows against low-precision columns
    y = merge_rows(matmul_f32(split_rows(x, dtype), b), m)
    torch.testing.assert_close(y, x @ b.float(), atol=1e-4, rtol=1e-4)


@st.composite
def selection(draw):
    b, h, g = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    page, n_pages, q_len = draw(st.sampled_from([2, 4])), draw(st.integers(2, 24)), draw(st.sampled_from([1, 1, 3]))
    d, dtype = 8, draw(DTYPES)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    summaries = torch.randn(b, h, n_pages, d, generator=gen).to(dtype)
    query = torch.randn(b, h * g, q_len, d, generator=gen).to(dtype)
    top = n_pages * page - q_len
    slots = torch.randint(0, max(top, 1), (b, 1), generator=gen) + torch.arange(q_len)
    budgets = torch.tensor([[draw(st.sampled_from([-1, 1, 2 * page, 3 * page, 5 * page, 100]))] * q_len
                            for _ in range(b)])
    pol = BlockTopK(page_size=page, keep_first_pages=draw(st.integers(0, 2)),
                    keep_last_pages=draw(st.integers(1, 2)), dense_layers=0)
    return pol, summaries, query, slots.clamp(max=n_pages * page - 1), budgets


@given(selection())
@settings(max_examples=60)
def test_select_pages_equals_todays(data):
    pol, summaries, query, slots, budgets = data
    n_pages = summaries.shape[2]
    want_pages, want_ok, score = ref.select_pages(pol, summaries=summaries, query=query, slots=slots,
                                                  budgets=budgets, k=n_pages)
    assume(_tie_free(score, torch.isfinite(score), 1e-4))
    got_pages, got_ok = select_pages(pol, summaries=summaries, query=query, slots=slots, budgets=budgets, k=n_pages)
    assert torch.equal(got_pages, want_pages) and torch.equal(got_ok, want_ok)
    plan = selection_plan(pol, slots=slots, budgets=budgets, k=n_pages, n_pages=n_pages)
    planned = select_pages(pol, summaries=summaries, query=query, plan=plan)
    assert torch.equal(planned[0], want_pages) and torch.equal(planned[1], want_ok)


@given(selection(), st.integers(3, 6))
@settings(max_examples=40)
def test_ranked_scatter_with_step_offsets_writes_todays_pages_own_page_last(data, pages_per_row):
    """The paged decode's selection in rank order (`rank_pages`: the query's own page first, no
    fill, no sort), written with or without the step's offsets: each request's entries are the
    pages today's code wrote (ascending `select_pages` through the old scatter), as a set, with
    the own page last (the page a paged kernel reads as partial); one set of offsets serves
    every layer of the step."""
    pol, summaries, query, slots, budgets = data
    slots, budgets, query = slots[:, :1], budgets[:, :1], query[:, :, :1]
    b, h, n_pages, _ = summaries.shape
    pages, ok, score = ref.select_pages(pol, summaries=summaries, query=query, slots=slots, budgets=budgets,
                                        k=n_pages)
    assume(_tie_free(score, torch.isfinite(score), 1e-4))
    pages, ok = pages[:, :, 0], ok[:, :, 0]
    counts = ok.reshape(-1, ok.shape[-1]).sum(-1)
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    indptr[1:] = counts.cumsum(0)
    nnz = int(indptr[-1])
    want = torch.full((nnz + 1,), -7, dtype=torch.int32)
    ref.scatter_selected_pages(want, indptr, pages, ok, pages_per_row=pages_per_row)
    plan = selection_plan(pol, slots=slots, budgets=budgets, k=n_pages, n_pages=n_pages)
    bias = plan.bias.expand(b, h, 1, n_pages).reshape(b * h, 1, n_pages)
    ranked = rank_pages(summaries=summaries.float(), query=query, bias=bias, k=plan.k)[:, :, 0]
    ranked_ok = plan.ok[:, :, 0].expand(b, h, plan.k)
    plain = torch.full((nnz + 1,), -7, dtype=torch.int32)
    scatter_selected_pages(plain, indptr, ranked, ranked_ok, pages_per_row=pages_per_row)
    offsets = selection_offsets(indptr, k=plan.k, pages_per_row=pages_per_row, dump=nnz)
    once = torch.full((nnz + 1,), -7, dtype=torch.int32)
    for _ in range(2):  # the same offsets serve every layer of the step
        scatter_selected_pages(once, indptr, ranked, ranked_ok, pages_per_row=pages_per_row, offsets=offsets)
    own = slots[:, 0] // pol.page_size  # [B] the query's page
    for r in range(b * h):
        lo, hi = int(indptr[r]), int(indptr[r + 1])
        for got in (plain, once):
            assert sorted(got[lo:hi].tolist()) == sorted(want[lo:hi].tolist())
            assert int(got[hi - 1]) == r * pages_per_row + int(own[r // h])


@pytest.mark.gpu
def test_mixed_precision_gemm_path_on_cuda_equals_cpu():
    """On CUDA, ``matmul_f32`` reads bf16 operands through ``bmm(out_dtype=float32)``; the scores,
    kept sets and pages equal the CPU's (which upcasts), to rounding."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 5, 64, generator=gen).bfloat16(), torch.randn(4, 64, 300, generator=gen).bfloat16()
    torch.testing.assert_close(matmul_f32(a.cuda(), b.cuda()).cpu(), a.float() @ b.float(), atol=1e-4, rtol=1e-5)
    keys = torch.randn(2, 2, 300, 64, generator=gen).bfloat16()
    queries = torch.randn(2, 4, 8, 64, generator=gen).bfloat16()
    valid = torch.ones(2, 2, 300, dtype=torch.bool)
    positions = torch.arange(300).expand(2, 2, 300)
    for pol in (SnapKV(), RKV()):
        cpu = pol.score(keys=keys, queries=queries, valid=valid, positions=positions)
        gpu = pol.score(keys=keys.cuda(), queries=queries.cuda(), valid=valid.cuda(), positions=positions.cuda())
        torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=0)
    torch.testing.assert_close(key_redundancy(keys.cuda(), valid.cuda()).cpu(), key_redundancy(keys, valid),
                               atol=2e-5, rtol=0)


def _mix_minmax_stacked(imp, red, valid, *, mix):
    """R-KV's min-max mix as commit 2736bbc computed it (stacked terms, ±inf fills, lerp)."""
    x = torch.stack([imp, red])
    invalid = ~valid
    hi = x.masked_fill(invalid, -torch.inf).amax(-1, keepdim=True)
    lo = x.masked_fill(invalid, torch.inf).amin(-1, keepdim=True)
    z = (x - lo) / (hi - lo).clamp(min=1e-12)
    return torch.lerp(-z[1], z[0], mix).masked_fill(invalid, 0.0)


@given(st.integers(0, 2**31 - 1), st.integers(1, 40), st.sampled_from([0.0, 0.1, 0.5, 1.0]))
@settings(max_examples=50)
def test_mix_minmax_equals_the_stacked_form(seed, s, mix):
    """The minmax mix with one ``aminmax`` per term over the valid slots (invalid ones replaced by
    a valid value) equals the stacked ``±inf``-fill form to float rounding: valid prefixes,
    scattered valid slots, rows with one and with no valid slot, constant rows."""
    from sparsecorr.decoding.policies.rkv import mix_minmax

    gen = torch.Generator().manual_seed(seed)
    imp, red = torch.rand(4, 2, s, generator=gen), torch.randn(4, 2, s, generator=gen)
    valid = torch.rand(4, 2, s, generator=gen) < 0.7
    valid[0, 0] = torch.arange(s) < 1  # one valid slot
    valid[0, 1] = False  # none
    valid[1, 0] = torch.arange(s) < s  # all
    imp[1, 1] = 0.25  # a constant row
    got = mix_minmax(imp, red, valid, mix=mix)
    want = _mix_minmax_stacked(imp, red, valid, mix=mix)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    assert (got[~valid] == 0).all()
