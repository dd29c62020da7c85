"""Each eviction policy's kept sets against a port of its authors' code (issue 51).

The library's policy is driven as the engine drives it: `compress` (which calls
``policy.score``) on keys ``[n·B, H_kv, S, D]``, the observation window's queries (oldest first),
the valid slots and their positions, with R-KV's key norms and unit-key sums as its state passes
them; the port (``references/``, each citing its repository, file and commit) runs on each
sequence alone, as the references do (batch 1). Kept index sets are compared per (sequence,
KV head): identical, except where the port's own scores tie (within ``TIE``) at its cutoff (a
``topk`` may pick either of two equal scores; the library picks the more recent). Inputs: random
keys and queries, and structured ones (keys drawn around a few prototypes, so near-duplicates
above R-KV's cosine threshold abound, and queries aimed at a few keys), MHA and GQA, full rows
and a padded batch. BlockTopK (Sparrow, arXiv 2606.08446) is checked against its own documented
rule: Sparrow's code is not mirrored here. The end-to-end test compares every compression
event of ``generate(record_keep=True)`` on a tiny Qwen3 with the R-KV port on that event's keys.
"""

from __future__ import annotations

import pytest
import torch

from sparsecorr.decoding import generate
from sparsecorr.decoding.policies import RKV, BlockTopK, SnapKV, StreamingLLM, compress
from tests.models import tiny_model
from tests.unit.decoding.references import r_kv, snapkv, sparse_rl, streaming_llm
from tests.unit.decoding.tracking import record_compressions

TIE = 1e-6  # float32 rounding of the scores: differences this small are ties
W, D, S, BUDGET = 8, 16, 96, 40


def _inputs(kind: str, *, hkv: int, group: int, seed: int, b: int = 1, s: int = S):
    """Keys ``[b, hkv, s, D]`` and window queries ``[b, hkv·group, W, D]``, float32."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        keys = torch.randn(b, hkv, s, D, generator=g)
        queries = torch.randn(b, hkv * group, W, D, generator=g)
        return keys, queries
    protos = torch.randn(b, hkv, 6, D, generator=g) * 2.0
    pick = torch.randint(0, 6, (b, hkv, s), generator=g)
    keys = protos.gather(2, pick[..., None].expand(-1, -1, -1, D)) + 0.6 * torch.randn(b, hkv, s, D, generator=g)
    aim = torch.randint(0, s, (b, hkv * group, W), generator=g)
    kv = keys.repeat_interleave(group, dim=1)
    queries = kv.gather(2, aim[..., None].expand(-1, -1, -1, D)) * 0.8 + torch.randn(b, hkv * group, W, D, generator=g)
    return keys, queries


def _state_inputs(keys, valid):
    """What R-KV's state passes `compress`: the key norms and the sum of the valid unit keys."""
    norms = torch.linalg.vector_norm(keys, dim=-1)
    unit = keys / norms.clamp(min=1e-12)[..., None] * valid[..., None]
    return {"key_norms": norms, "unit_sum": unit.sum(2, keepdim=True)}


def _library_sets(policy, keys, queries, counts, budget, **extra):
    """`compress`'s kept slots per (row, head), rows holding ``counts`` valid slots (a prefix)."""
    b, h, s, _ = keys.shape
    valid = (torch.arange(s) < counts[:, None])[:, None, :].expand(b, h, s)
    positions = torch.arange(s).expand(b, h, s)
    if policy.key_norms and extra.pop("state", False):
        extra.update(_state_inputs(keys, valid))
    keep = compress(policy, keys=keys, queries=queries, valid=valid, positions=positions, budget=budget, **extra)
    return [[set(keep.index[r, i][keep.valid[r, i]].tolist()) for i in range(h)] for r in range(b)]


def _agree(ours: set[int], ref: set[int], scores: torch.Tensor, n_scored: int) -> bool:
    """Identical sets, or sets that differ only among keys whose reference scores tie at the cutoff."""
    diff = [j for j in ours ^ ref if j < n_scored]
    if len(diff) != len(ours ^ ref):
        return False
    kept = [float(scores[j]) for j in ref if j < n_scored]
    if not kept:
        return not diff
    cut = min(kept)
    return all(abs(float(scores[j]) - cut) <= TIE * max(1.0, abs(cut)) for j in diff)


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / max(len(a | b), 1)


CASES = [(kind, hkv, group, seed) for kind in ("random", "structured") for hkv, group in ((2, 1), (2, 4))
         for seed in (0, 1)]


def _ids(case):
    kind, _, group, seed = case
    return f"{kind}-{'mha' if group == 1 else 'gqa'}-{seed}"


@pytest.mark.parametrize("state", [False, True], ids=["keys", "state-sums"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rkv_default_keeps_what_r_kv_keeps(case, state):
    kind, hkv, group, seed = case
    keys, queries = _inputs(kind, hkv=hkv, group=group, seed=seed, b=2)
    counts = torch.tensor([S, S - 17])  # a padded row too
    policy = RKV(window=W, kernel=7, mix=0.1)
    ours = _library_sets(policy, keys, queries, counts, BUDGET, state=state)
    scores_j = []
    for r, n in enumerate(counts.tolist()):
        ref, scores = r_kv.keep(keys[r:r + 1, :, :n], queries[r:r + 1], budget=BUDGET, window=W, kernel=7, mix=0.1)
        for i in range(hkv):
            assert _agree(ours[r][i], ref[i], scores[i], n - W), (r, i, sorted(ours[r][i] ^ ref[i]))
            scores_j.append(jaccard(ours[r][i], ref[i]))
    assert sum(scores_j) / len(scores_j) >= 0.99


@pytest.mark.parametrize("mix", [0.07, 0.5])
def test_rkv_default_follows_r_kv_at_other_mixes_and_kernels(mix):
    keys, queries = _inputs("structured", hkv=2, group=2, seed=5)
    policy = RKV(window=W, kernel=3, mix=mix)
    ours = _library_sets(policy, keys, queries, torch.tensor([S]), 48)
    ref, scores = r_kv.keep(keys, queries, budget=48, window=W, kernel=3, mix=mix)
    for i in range(2):
        assert _agree(ours[0][i], ref[i], scores[i], S - W)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rkv_sparse_rl_variant_keeps_what_sparse_rl_keeps(case):
    kind, hkv, group, seed = case
    keys, queries = _inputs(kind, hkv=hkv, group=group, seed=seed, b=2)
    counts = torch.tensor([S, S - 9])
    ours = _library_sets(RKV(window=W, variant="sparse_rl"), keys, queries, counts, BUDGET, state=True)
    scores_j = []
    for r, n in enumerate(counts.tolist()):
        ref, scores = sparse_rl.keep(keys[r:r + 1, :, :n], queries[r:r + 1], budget=BUDGET, window=W)
        assert all(ours[r][i] == ours[r][0] for i in range(hkv))  # one set for the layer's heads
        assert _agree(ours[r][0], ref, scores, n - W), (r, sorted(ours[r][0] ^ ref))
        scores_j.append(jaccard(ours[r][0], ref))
    assert sum(scores_j) / len(scores_j) >= 0.99


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_snapkv_keeps_what_snapkv_cluster_keeps(case, pooling):
    kind, hkv, group, seed = case
    keys, queries = _inputs(kind, hkv=hkv, group=group, seed=seed, b=2)
    counts = torch.tensor([S, S - 13])
    ours = _library_sets(SnapKV(window=W, kernel=5, pooling=pooling), keys, queries, counts, BUDGET)
    for r, n in enumerate(counts.tolist()):
        ref, scores = snapkv.keep(keys[r:r + 1, :, :n], queries[r:r + 1], budget=BUDGET, window=W, kernel=5,
                                  pooling=f"{pooling}pool")
        for i in range(hkv):
            assert _agree(ours[r][i], ref[i], scores[i], n - W), (r, i, sorted(ours[r][i] ^ ref[i]))


@pytest.mark.parametrize("start,budget", [(4, 32), (0, 20), (1, 8)])
def test_streaming_llm_keeps_start_and_recent(start, budget):
    keys, queries = _inputs("random", hkv=2, group=2, seed=3, b=2)
    counts = torch.tensor([S, 50])
    ours = _library_sets(StreamingLLM(sink=start), keys, queries, counts, budget)
    for r, n in enumerate(counts.tolist()):
        ref = streaming_llm.keep(n, start=start, recent=budget - start)
        assert all(ours[r][i] == ref for i in range(2))


def _block_topk_rule(policy, keys, query, budget):
    """BlockTopK's documented rule (its module docstring), restated per (row, head): pages of
    ``page_size`` positions scored by mean key · mean query of the group; the first
    ``keep_first_pages`` and last ``keep_last_pages`` pages kept; ``max(budget // page_size,
    first + last)`` pages in all (at most all of them)."""
    b, h, s, _ = keys.shape
    ps, group = policy.page_size, query.shape[1] // h
    n_pages = (s + ps - 1) // ps
    out = []
    for r in range(b):
        for i in range(h):
            q = query[r, i * group:(i + 1) * group, 0].double().mean(0)
            score = {p: float(keys[r, i, p * ps:(p + 1) * ps].double().mean(0) @ q) for p in range(n_pages)}
            forced = set(range(policy.keep_first_pages)) | set(range(n_pages - policy.keep_last_pages, n_pages))
            n_keep = min(max(budget // ps, policy.keep_first_pages + policy.keep_last_pages), n_pages)
            rest = sorted((p for p in score if p not in forced), key=lambda p: -score[p])
            pages = forced | set(rest[:max(0, n_keep - len(forced))])
            out.append({j for p in pages for j in range(p * ps, min((p + 1) * ps, s))})
    return out


@pytest.mark.parametrize("kind", ["random", "structured"])
@pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa"])
def test_block_topk_follows_its_documented_rule(kind, group):
    policy = BlockTopK(page_size=8, keep_first_pages=1, keep_last_pages=2, dense_layers=0)
    keys, queries = _inputs(kind, hkv=2, group=group, seed=7, b=2, s=90)
    valid = torch.ones(2, 2, 90, dtype=torch.bool)
    mask = policy.attend_mask(keys=keys, query=queries[:, :, -1:], valid=valid,
                              positions=torch.arange(90).expand(2, 2, 90), budget=40, layer_idx=0)
    got = [set(torch.nonzero(mask[r, i]).flatten().tolist()) for r in range(2) for i in range(2)]
    assert got == _block_topk_rule(policy, keys, queries[:, :, -1:], 40)


def test_rkv_end_to_end_kept_sets_equal_the_port(monkeypatch):
    """Every compression event of a decode (tiny Qwen3, GQA 4/2, float32): the positions
    ``generate(record_keep=True)`` records equal the kept sets of the R-KV port run on that
    event's keys and observation window, per layer, row and KV head."""
    events = record_compressions(monkeypatch)
    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    budget, window = 16, 4
    out = generate(model, ids, policy=RKV(window=window, buffer=4), budget=budget, max_new_tokens=24,
                   temperature=0, backend="torch", record_keep=True, prefill_chunk=8)
    assert events and out.kept_sets.rows.numel() > 0
    recorded = {(layer, head, tuple(p[p >= 0].tolist())) for e in out.kept_sets.positions
                for layer, heads in enumerate(e) for head, p in enumerate(heads)}
    compared = 0
    for kw, keep in events:
        keys, queries, valid, positions = kw["keys"], kw["queries"], kw["valid"], kw["positions"]
        assert kw.get("query_valid") is None  # every row has seen a full window
        rows = ids.shape[0]  # the event stacks the layers: row r is layer r // B, batch row r % B
        for r in range(keys.shape[0]):
            n = int(valid[r, 0].sum())
            if n <= budget:
                continue
            ref, _ = r_kv.keep(keys[r:r + 1, :, :n], queries[r:r + 1], budget=budget, window=window, kernel=7,
                               mix=0.1)
            for i in range(keys.shape[1]):
                want = sorted(int(positions[r, i, j]) for j in ref[i])
                got = sorted(positions[r, i].gather(-1, keep.index[r, i][keep.valid[r, i]]).tolist())
                assert got == want
                assert (r // rows, i, tuple(want)) in recorded  # what generate recorded
                compared += 1
    assert compared >= 8


@pytest.mark.parametrize("block", [1, 64, 1 << 26])
def test_near_duplicates_in_row_blocks_equal_the_port_rule(monkeypatch, block):
    """The op ``sparsecorr::near_duplicates`` (its stock chain: the cosines in row blocks of any
    size) gives every key's last near-duplicate as R-KV's ``cal_similarity`` picks it (the last
    column above 0.5 of its row, index 0 where none) and that cosine."""
    from sparsecorr.decoding.kernels import votes

    monkeypatch.setattr(votes, "_ND_BLOCK", block)
    keys, _ = _inputs("structured", hkv=2, group=1, seed=11, s=70)
    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    last, val = votes.near_duplicates(unit, torch.zeros(1, 2, dtype=torch.long), threshold=0.5)
    cos = unit[0] @ unit[0].transpose(-1, -2)
    for h in range(2):
        cos[h].fill_diagonal_(0.0)
        want = torch.where(cos[h] > 0.5, torch.arange(70), 0).max(-1).values
        assert torch.equal(last[0, h], want)
        torch.testing.assert_close(val[0, h], cos[h].gather(-1, want[:, None])[:, 0], atol=1e-6, rtol=0)


def test_sparse_rl_end_to_end_keeps_the_prompt_then_the_ports_sets(monkeypatch):
    """Every compression event of a ``RKV(variant="sparse_rl")`` decode (tiny Qwen3, GQA 4/2,
    float32, prefill chunks of 8): none during the prefill, as Sparse-RL's
    ``RadixAttention.compress`` keeps an extend batch whole (``sglang-kvc/python/sglang/srt/layers/
    radix_attention.py``, commit ``182c0b26aeb8f2f6c6f12134c7f57cfe65f95376``); the first scores the
    whole prompt plus the first decode token; each keeps the Sparse-RL port's set in every head."""
    events = record_compressions(monkeypatch)
    model = tiny_model("qwen3", num_layers=2)
    p, budget, window = 30, 16, 4
    ids = torch.randint(3, 128, (2, p), generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, policy=RKV(window=window, buffer=4, variant="sparse_rl"), budget=budget,
                   max_new_tokens=16, temperature=0, backend="torch", record_keep=True, prefill_chunk=8)
    assert int(out.kept_sets.context.min()) == p + 1
    assert bool((events[0][0]["valid"].sum(-1) == p + 1).all())
    compared = 0
    for kw, keep in events:
        keys, queries, valid, positions = kw["keys"], kw["queries"], kw["valid"], kw["positions"]
        for r in range(keys.shape[0]):
            n = int(valid[r, 0].sum())
            if n <= budget:
                continue
            ref, _ = sparse_rl.keep(keys[r:r + 1, :, :n], queries[r:r + 1], budget=budget, window=window)
            want = sorted(int(positions[r, 0, j]) for j in ref)
            for i in range(keys.shape[1]):
                assert sorted(positions[r, i].gather(-1, keep.index[r, i][keep.valid[r, i]]).tolist()) == want
                compared += 1
    assert compared >= 8
