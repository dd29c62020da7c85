"""Issue 52: sliding-window layers keep a ring of their window and attend exactly what the model's
own attention attends (HF's ``sliding_window_overlay``: ``kv_idx > q_idx - window``, causal).

Every check runs the peer's real code: HF ``generate`` (greedy, eager attention, its own
sliding-window mask) or the model's own full forward, on tiny random configs built in-process
with a window (5) much shorter than the context (9-token prompts + 12 new tokens), so each ring
(``window + chunk - 1`` slots) wraps several times. Exact token equality for greedy decoding, as
the engine's other parity tests; log-probs within 1e-5 (float32, a different summation order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import sparsecorr.decoding.engine as engine_mod
from sparsecorr.decoding import (
    RKV,
    BlockTopK,
    Dense,
    SnapKV,
    StreamingLLM,
    generate,
    teacher_forced_logprobs,
)
from sparsecorr.decoding.backends import PagedBackend, TorchBackend
from sparsecorr.decoding.backends.paged import ReferenceDecodeKernel
from sparsecorr.decoding.engine import Engine
from sparsecorr.decoding.hf import model_spec

WINDOW = 5
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def hybrid(name: str, *, window: int = WINDOW, layers: int = 4, seed: int = 0):
    """A tiny random model of family ``name`` with a sliding window (eager attention)."""
    t = transformers
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    configs = {
        # pattern 6 (layer 6 full): 6 layers -> 5 sliding + 1 full
        "gemma3": lambda: t.Gemma3TextConfig(**base | dict(num_hidden_layers=6), sliding_window=window, **SPECIAL),
        "gpt_oss": lambda: t.GptOssConfig(**base, sliding_window=window, num_local_experts=4,
                                          num_experts_per_tok=2, **SPECIAL),
        "mistral": lambda: t.MistralConfig(**base, sliding_window=window),
        "qwen2": lambda: t.Qwen2Config(**base, use_sliding_window=True, sliding_window=window, max_window_layers=2),
        "exaone4": lambda: t.Exaone4Config(**base, sliding_window=window, **SPECIAL),
        "gemma2": lambda: t.Gemma2Config(**base, sliding_window=window, **SPECIAL),
    }
    cfg = configs[name]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return t.AutoModelForCausalLM.from_config(cfg).eval()


def hf_greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


def _ids(b=2, p=9, seed=1):
    return torch.randint(3, 96, (b, p), generator=torch.Generator().manual_seed(seed))


FAMILIES = ["gemma3", "gpt_oss", "mistral", "qwen2", "exaone4"]


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, name):
    if name not in models:
        models[name] = hybrid(name)
    return models[name]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("chunk", [1, 4, None])
def test_dense_greedy_equals_hf_generate_with_a_wrapping_ring(models, name, chunk):
    model = _model(models, name)
    ids = _ids()
    out = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=12, temperature=0.0, backend="torch",
                   prefill_chunk=chunk)
    assert torch.equal(out.tokens, hf_greedy(model, ids, 12))
    spec = model_spec(model)
    layers = out.meta["kv_layers"]
    assert (layers["full"], layers["sliding"], layers["window"]) == (len(spec.full), len(spec.sliding), WINDOW)
    longest = 9 + 12
    assert layers["ring_slots"] == min(WINDOW + (chunk or 9) - 1, longest) < longest  # the ring wraps


def test_a_wrong_window_would_be_seen(models, monkeypatch):
    """The equality above can fail: the same decode with a narrower ring window differs from HF."""
    model = _model(models, "gpt_oss")
    ids = _ids()
    ref = hf_greedy(model, ids, 12)
    real = engine_mod.model_spec

    def narrower(m):
        s = real(m)
        return dataclasses.replace(s, window=s.window - 3)

    monkeypatch.setattr(engine_mod, "model_spec", narrower)
    out = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=12, temperature=0.0, backend="torch",
                   prefill_chunk=4)
    assert not torch.equal(out.tokens, ref)


@pytest.mark.parametrize("name", ["gpt_oss", "gemma3"])
def test_ragged_rows_in_a_batch_decode_as_each_row_alone(models, name):
    model = _model(models, name)
    ids = _ids(b=3, p=10, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0  # a 3-token prompt: its row reads padding while the others read their prompts
    kw = dict(policy=Dense(), budget=None, max_new_tokens=10, temperature=0.0, backend="torch", prefill_chunk=3)
    batch = generate(model, ids, mask, **kw)
    for r in range(3):
        alone = generate(model, ids[r:r + 1, mask[r].bool()], **kw)
        assert torch.equal(batch.tokens[r], alone.tokens[0])
        torch.testing.assert_close(batch.rollout_logp[r], alone.rollout_logp[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gpt_oss", "qwen2"])
def test_teacher_forcing_in_long_chunks_equals_the_models_own_forward(models, name):
    """Chunks of 7 tokens > window: each query of a chunk attends its own window inside it."""
    model = _model(models, name)
    ids, resp = _ids(p=9), _ids(p=14, seed=4)
    out = teacher_forced_logprobs(model, ids, resp, policy=Dense(), budget=None, backend="torch",
                                  prefill_chunk=4, chunk_size=7)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids, resp], 1)).logits.float()
    ref = logits.log_softmax(-1)[:, 8:-1].gather(-1, resp[..., None])[..., 0]
    torch.testing.assert_close(out.rollout_logp, ref, atol=1e-5, rtol=1e-5)


POLICIES = [pytest.param(RKV(window=3, buffer=3), id="rkv"), pytest.param(SnapKV(window=3, buffer=3), id="snapkv"),
            pytest.param(StreamingLLM(sink=1, buffer=2), id="streaming_llm"),
            pytest.param(BlockTopK(page_size=2, keep_last_pages=1, dense_layers=0), id="block_topk")]


@pytest.mark.parametrize("policy", POLICIES)
def test_teacher_forcing_reproduces_the_decode_on_a_hybrid_model(models, policy):
    model = _model(models, "gpt_oss")
    ids = _ids(p=9)
    kw = dict(policy=policy, budget=6, temperature=0.0, backend="torch", prefill_chunk=4)
    out = generate(model, ids, max_new_tokens=14, **kw)
    assert torch.isfinite(out.rollout_logp).all()
    tf = teacher_forced_logprobs(model, ids, out.tokens, **kw)
    torch.testing.assert_close(tf.rollout_logp, out.rollout_logp, atol=1e-5, rtol=0)


def test_kept_sets_hold_the_window_on_sliding_layers_and_replay(models):
    model = _model(models, "gpt_oss")
    spec = model_spec(model)
    ids = _ids(p=9)
    kw = dict(policy=RKV(window=3, buffer=3), budget=6, temperature=0.0, backend="torch", prefill_chunk=4)
    out = generate(model, ids, max_new_tokens=14, record_keep=True, **kw)
    ks = out.kept_sets
    assert ks.positions.shape[1] == spec.layers and ks.rows.numel() > 0
    for e in range(ks.rows.numel()):
        ctx = int(ks.context[e])
        want = torch.arange(max(0, ctx - WINDOW), ctx)
        for layer in spec.sliding:
            for h in range(spec.heads_kv):
                got = ks.positions[e, layer, h]
                assert torch.equal(got[got >= 0], want)
        for layer in spec.full:
            assert int((ks.positions[e, layer] >= 0).sum(-1).max()) <= 6
    replay = teacher_forced_logprobs(model, ids, out.tokens, keep_sets=ks, record_keep=True, **kw)
    torch.testing.assert_close(replay.rollout_logp, out.rollout_logp, atol=1e-5, rtol=0)
    assert replay.kept_sets.agreement(ks).identical == 1.0


@pytest.mark.parametrize("name", ["gpt_oss", "mistral"])
def test_the_scheduler_serves_a_hybrid_model_as_the_one_pool_path(models, name):
    model = _model(models, name)
    ids = _ids(b=4, p=9, seed=5)
    kw = dict(policy=RKV(window=3, buffer=3), budget=6, max_new_tokens=10, temperature=0.0, backend="torch",
              prefill_chunk=4)
    one = generate(model, ids, **kw)
    sched = generate(model, ids, max_num_seqs=2, **kw)
    assert "scheduler" in sched.meta
    assert sched.meta["kv_layers"] == {**one.meta["kv_layers"], "ring_slots": sched.meta["kv_layers"]["ring_slots"]}
    assert sum(sched.meta["peak_kv"].values()) == sched.peak_kv_bytes
    assert torch.equal(sched.tokens, one.tokens)
    torch.testing.assert_close(sched.rollout_logp, one.rollout_logp, atol=1e-5, rtol=0)


def test_all_sliding_models_run_no_policy(models):
    """Mistral with a window: every layer slides, so the window bounds the cache and a policy has
    nothing to do: any policy decodes as dense (and equals HF)."""
    model = _model(models, "mistral")
    ids = _ids()
    out = generate(model, ids, policy=RKV(window=3, buffer=3), budget=4, max_new_tokens=12, temperature=0.0,
                   backend="torch", prefill_chunk=4)
    assert out.meta["kv_layers"]["policy"].startswith("none")
    assert out.meta["kv_pool_bytes"] > 0 and out.meta["peak_kv"]["full_bytes"] == 0
    assert torch.equal(out.tokens, hf_greedy(model, ids, 12))


def test_a_forward_longer_than_the_ring_was_sized_for_is_refused(models):
    model = _model(models, "gpt_oss")
    table = torch.full((40,), -1, dtype=torch.long)
    engine = Engine(model, policy=Dense(), backend=TorchBackend(), table=table, batch=1, capacity=40, grad=False,
                    chunk=2)
    assert engine.ring.slots == WINDOW + 1
    with pytest.raises(ValueError, match="chunk: expected at most 2 tokens per forward"):
        engine.plan(3, torch.tensor([3]), decode=False)


@pytest.mark.parametrize("policy", [pytest.param(Dense(), id="dense"), pytest.param(RKV(window=3, buffer=3), id="rkv"),
                                    pytest.param(BlockTopK(page_size=2, keep_last_pages=1, dense_layers=0),
                                                 id="block_topk")])
def test_the_paged_path_serves_the_full_layers_of_a_hybrid_model(models, policy):
    """Single-token steps read the full layers through the page tables (the float32 paged oracle
    as the kernel, sinks included) and the sliding layers through their ring: = the torch backend."""
    model = _model(models, "gpt_oss")
    ids = _ids(b=3)
    kw = dict(policy=policy, budget=None if policy.ignores_budget else 6, max_new_tokens=12, temperature=0.0,
              prefill_chunk=4)
    ref = generate(model, ids, backend=TorchBackend(), **kw)
    got = generate(model, ids, backend=PagedBackend(ReferenceDecodeKernel, name="paged-oracle"), **kw)
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.rollout_logp, ref.rollout_logp, atol=2e-5, rtol=0)
