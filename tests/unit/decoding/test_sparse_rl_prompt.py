"""Issue 51, Sparse-RL's variant: ``RKV(variant="sparse_rl")`` keeps the prompt whole until the
first decode-time compression, as Sparse-RL's SGLang fork does.

Reference: github.com/lsjia/Sparse-RL, commit ``182c0b26aeb8f2f6c6f12134c7f57cfe65f95376``,
``sglang-kvc/python/sglang/srt/layers/radix_attention.py``: ``RadixAttention.compress`` keeps
every token of an extend (prefill) batch (``pool_cache[req] = kv_locs``); in decode
``need_compress`` fires when ``seq_len > compress_max_prompt`` (the budget) and
``steps % compress_divide_length == 0``. The engine's trigger (`EvictionPolicy.due`: a row holding
more than ``budget + buffer`` slots) fires every ``buffer + 1`` decode steps once the row is past
it: the fork's cadence with ``compress_divide_length = buffer + 1``, its phase set by the first
decode step (the fork's by a global step counter). The loop reference below follows the fork's
rule step by step on a tiny Qwen3 and picks each kept set with the port of the fork's scoring
(`tests.unit.decoding.references.sparse_rl.keep`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache

from sparsecorr.decoding import RKV, generate, teacher_forced_logprobs
from sparsecorr.decoding.engine import pool_capacity
from sparsecorr.decoding.hf import cache_keyword
from sparsecorr.decoding.memory import plan_for
from sparsecorr.decoding.policies.base import row_capacity
from tests.models import tiny_model
from tests.unit.decoding.references import sparse_rl
from tests.unit.decoding.tracking import record_compressions

BUDGET, BUFFER, WINDOW = 16, 4, 4
P = 40  # prompt tokens: longer than budget + buffer


def _model():
    return tiny_model("qwen3", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def _prompt(b=1, p=P, seed=0):
    return torch.randint(3, 128, (b, p), generator=torch.Generator().manual_seed(seed))


def test_prefill_keeps_every_prompt_position_then_decode_keeps_the_budget(monkeypatch):
    """No compression between prefill chunks (chunk 8, prompt 40 > budget 16 + buffer 4): the
    first event scores the whole prompt plus the first decode token, and keeps ``budget``."""
    events = record_compressions(monkeypatch)
    ids = _prompt(2)
    out = generate(_model(), ids, policy=RKV(window=WINDOW, buffer=BUFFER, variant="sparse_rl"), budget=BUDGET,
                   max_new_tokens=12, temperature=0, backend="torch", prefill_chunk=8, record_keep=True)
    kw, keep = events[0]
    valid, positions = kw["valid"], kw["positions"]
    assert bool((valid.sum(-1) == P + 1).all())  # every prompt position and the first decode token
    assert sorted(positions[0, 0][valid[0, 0]].tolist()) == list(range(P + 1))
    assert bool((keep.valid.sum(-1) == BUDGET).all())
    ks = out.kept_sets
    assert int(ks.context.min()) == P + 1  # no event inside the prompt
    assert bool(((ks.positions >= 0).sum(-1) == BUDGET).all())
    # one kept set per layer, shared by the KV heads
    assert bool((ks.positions[:, :, :1] == ks.positions).all())


def test_default_rkv_still_compresses_between_prefill_chunks(monkeypatch):
    events = record_compressions(monkeypatch)
    out = generate(_model(), _prompt(), policy=RKV(window=WINDOW, buffer=BUFFER), budget=BUDGET, max_new_tokens=4,
                   temperature=0, backend="torch", prefill_chunk=8, record_keep=True)
    assert int(out.kept_sets.context.min()) <= P  # compressed inside the prompt
    assert int(events[0][0]["valid"].sum(-1).max()) <= BUDGET + BUFFER + 8


def _loop_reference(model, ids, *, steps):
    """Greedy decode following the fork's rule: the prompt whole (dense prefill); then each decode
    step appends its token to every layer's kept set and, when the set passes ``budget + buffer``
    (the fork's ``seq_len > budget`` and ``steps % (buffer + 1) == 0``, phase at the first decode
    step), keeps what the port of Sparse-RL's scoring keeps from the set's keys and the last
    ``window`` queries. Attention is masked to the kept set (one per layer: every head)."""
    n_layers = model.config.num_hidden_layers
    kept = [list(range(ids.shape[1])) for _ in range(n_layers)]
    queries = [[] for _ in range(n_layers)]
    decoding = [False]

    def attn(module, query, key, value, attention_mask, *, scaling, dropout=0.0, **kw):
        layer = module.layer_idx
        queries[layer].append(query)
        g = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
        s, q = key.shape[2], query.shape[2]
        allowed = torch.zeros(q, s, dtype=torch.bool)
        if decoding[0]:
            allowed[:, kept[layer]] = True
        else:
            allowed = torch.ones(q, s, dtype=torch.bool).tril(s - q)
        logits = (query @ k.transpose(-1, -2)) * scaling
        out = F.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1) @ v
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("sparse_rl_loop_ref", attn)
    model.set_attn_implementation("sparse_rl_loop_ref")
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})
    decoding[0] = True
    tokens, events = [], []
    for t in range(steps):
        tok = out.logits[:, -1].argmax(-1)
        tokens.append(int(tok))
        if t + 1 == steps:
            break
        pos = ids.shape[1] + t
        for layer in range(n_layers):
            kept[layer].append(pos)
        out = model(input_ids=tok[:, None], use_cache=True, **{cache_keyword(model): cache})
        if len(kept[0]) > BUDGET + BUFFER:
            event = []
            for layer in range(n_layers):
                keys = cache.layers[layer].keys[:, :, kept[layer]]
                q = torch.cat(queries[layer], dim=2)[:, :, -WINDOW:]
                rel, _ = sparse_rl.keep(keys, q, budget=BUDGET, window=WINDOW)
                kept[layer] = [kept[layer][i] for i in sorted(rel)]
                event.append(list(kept[layer]))
            events.append((pos + 1, event))
    return tokens, events


def test_greedy_decode_equals_the_forks_rule_step_by_step():
    model = _model()
    ids = _prompt()
    steps = 20
    out = generate(model, ids, policy=RKV(window=WINDOW, buffer=BUFFER, variant="sparse_rl"), budget=BUDGET,
                   max_new_tokens=steps, temperature=0, backend="reference", prefill_chunk=8, record_keep=True)
    ref_tokens, ref_events = _loop_reference(_model(), ids, steps=steps)
    assert out.tokens[0].tolist() == ref_tokens
    ks = out.kept_sets
    assert ks.context.tolist() == [c for c, _ in ref_events]
    assert len(ref_events) >= 3  # the first decode step, then every buffer + 1 steps
    for e, (_, layers) in enumerate(ref_events):
        for layer, want in enumerate(layers):
            for head in range(ks.positions.shape[2]):
                got = ks.positions[e, layer, head]
                assert sorted(got[got >= 0].tolist()) == want


def test_capacity_holds_the_whole_prompt():
    policy = RKV(window=WINDOW, buffer=BUFFER, variant="sparse_rl")
    longest, chunk = 200, 8
    table = torch.full((longest + 1,), BUDGET, dtype=torch.long)
    base = BUDGET + BUFFER + chunk
    assert policy.capacity(table, longest=longest, chunk=chunk) == base  # the policy's hook is unchanged
    assert row_capacity(policy, table, longest=longest, chunk=chunk, prompt=P) == P + 1
    assert row_capacity(policy, table, longest=longest, chunk=chunk, prompt=10) == base  # short prompts
    assert pool_capacity(policy, table, longest=longest, chunk=chunk, prompt=None) == longest  # unknown prompt
    assert pool_capacity(policy, table, longest=50, chunk=chunk, prompt=60) == 50  # capped by the context
    plain = RKV(window=WINDOW, buffer=BUFFER)
    assert row_capacity(plain, table, longest=longest, chunk=chunk, prompt=P) == base
    # the scheduler's plan (prompts unknown): the whole context
    _, plan = plan_for(_model(), policy, BUDGET, longest=longest, chunk=chunk, max_num_seqs=2, max_kv_bytes=None,
                       prompt=longest - 1)
    assert plan.capacity == longest


@pytest.mark.parametrize("variant", ["r_kv", "sparse_rl"])
def test_peak_kv_reads_the_whole_prompt_under_the_variant(variant):
    model = _model()
    out = generate(model, _prompt(), policy=RKV(window=WINDOW, buffer=BUFFER, variant=variant), budget=BUDGET,
                   max_new_tokens=8, temperature=0, backend="torch", prefill_chunk=8)
    slot = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x float32 bytes
    # the default: compressed to 16 after each chunk past 20, so a chunk of 8 reads at most 16 + 8;
    # the variant: the whole prompt and the first decode token
    want = (P + 1) if variant == "sparse_rl" else BUDGET + 8
    assert out.peak_kv_bytes == want * slot


def test_teacher_forcing_replays_the_variant():
    model = _model()
    ids = _prompt(2, seed=1)
    policy = RKV(window=WINDOW, buffer=BUFFER, variant="sparse_rl")
    out = generate(model, ids, policy=policy, budget=BUDGET, max_new_tokens=24, temperature=0, backend="torch",
                   prefill_chunk=8, record_keep=True)
    tf = teacher_forced_logprobs(model, ids, out.tokens, policy=policy, budget=BUDGET, response_mask=out.mask,
                                 backend="torch", prefill_chunk=8, record_keep=True)
    assert out.kept_sets.agreement(tf.kept_sets).identical == 1.0
    torch.testing.assert_close(tf.rollout_logp[out.mask], out.rollout_logp[out.mask], atol=1e-5, rtol=0)


def test_features_forward_the_softcap_to_begin_step():
    """Issue 52's follow-up: a soft-capped model's paged step is planned with its soft-cap in
    ``begin_step`` (the cache's `_Features`), so the first ``decode`` of a run plans nothing again."""
    from sparsecorr.decoding.cache import _Features

    calls = []

    class Backend:
        def begin_step(self, **kw):
            calls.append(kw)

    _Features(Backend(), 30.0).begin_step(lengths=torch.tensor([3]), keep=None)
    _Features(Backend(), None).begin_step(lengths=torch.tensor([3]), keep=None)
    assert calls[0]["softcap"] == 30.0 and "softcap" not in calls[1]


def test_scheduler_records_generates_peak_kv_split():
    """Issue 52's follow-up: the scheduler keeps ``generate``'s full / sliding split of its peak
    (``Scheduler.kv_groups``: ``peak_kv`` and ``kv_layers``), summing to ``peak_kv_bytes``."""
    from sparsecorr.decoding.scheduler import RequestParams, Scheduler
    from tests.unit.decoding.test_sliding import hybrid

    model = hybrid("gemma3", window=6)
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    policy = RKV(window=3, buffer=4)
    ref = generate(model, ids, policy=policy, budget=8, max_new_tokens=8, temperature=0.0, backend="torch",
                   prefill_chunk=4)
    sched = Scheduler(model, policy=policy, budget=8, max_model_len=32, backend="torch", prefill_chunk=4,
                      max_num_seqs=2)
    try:
        for i in range(2):
            sched.add_request(str(i), ids[i], RequestParams(max_tokens=8, temperature=0, ignore_eos=True))
        while sched.has_unfinished():
            sched.step()
        groups, peak = sched.kv_groups, sched.peak_kv_bytes
    finally:
        sched.close()
    assert sum(groups["peak_kv"].values()) == peak
    assert groups["kv_layers"] == ref.meta["kv_layers"]
    assert groups["peak_kv"]["sliding_bytes"] > 0 and groups["peak_kv"]["full_bytes"] > 0


def test_a_soft_capped_models_paged_steps_plan_once():
    """Through the engine (Gemma 2, soft cap 50, the paged backend on the CPU kernel): every decode
    step is planned with the soft-cap in ``begin_step``, so no ``decode`` plans the step again."""
    from sparsecorr.decoding.backends import PagedBackend, ReferenceDecodeKernel
    from tests.unit.decoding.test_sliding import hybrid

    model = hybrid("gemma2")
    backend = PagedBackend(ReferenceDecodeKernel, name="paged-oracle")
    replans = []
    original = backend._replan
    backend._replan = lambda softcap: (replans.append(softcap), original(softcap))[1]
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    generate(model, ids, policy=RKV(window=3, buffer=3), budget=8, max_new_tokens=6, temperature=0.0,
             backend=backend, prefill_chunk=4)
    assert backend._softcap == 50.0 and replans == []
