"""Issue 36: the fused decode step (``generate(..., fused=True)``: the captured step's model
forward through ``torch.compile``, our attention the opaque op ``sparsecorr::attend``) equals the
unfused step, compiles once for every batch bucket above 1, and falls back when compiling fails.

On the CPU the captured step runs through the eager stand-in runner (`EagerRunner`: the CUDA
graph step's static-buffer logic, compiled here by inductor's C++ backend); the capture of the
compiled code on a GPU is tests/gpu/test_fused_gpu.py.

Tolerance: log-probs within 2e-5 (float32 model; the compiled RMSNorm, rotary and SiLU·mul
reorder float sums, ~1e-7 relative per op over a 2-layer model and a 128-token softmax; the
observed gap is ~5e-7), the same bound the CUDA-graph step's own parity test uses. Tokens (greedy)
and kept sets must be identical.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import sparsecorr.decoding.fused as fused_mod
from sparsecorr.decoding import RKV, BlockTopK, Dense, SnapKV, StreamingLLM, generate
from sparsecorr.decoding.cache import active
from sparsecorr.decoding.hf import cache_keyword
from tests.models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", num_layers=2)


def _prompts(b=6, p=9, seed=0):
    ids = torch.randint(3, 128, (b, p), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # ragged rows: a mask in every step
    return ids, mask


def _generate(model, policy, *, fused, eos=None, steps=14, b=6):
    ids, mask = _prompts(b)
    return generate(model, ids, mask, policy=policy, budget=8 if policy.kind != "dense" else None,
                    max_new_tokens=steps, temperature=0, logprobs_topk=3, eos_token_id=eos, prefill_chunk=4,
                    cuda_graph=True, fused=fused, record_keep=policy.evicts)


POLICIES = [
    pytest.param(Dense(), id="dense"),
    pytest.param(RKV(window=3, buffer=3), id="rkv"),
    pytest.param(BlockTopK(page_size=2, keep_last_pages=1, dense_layers=1), id="blocktopk"),
    pytest.param(StreamingLLM(sink=1, buffer=2), id="streaming_llm", marks=pytest.mark.slow),
    pytest.param(SnapKV(window=3, buffer=3), id="snapkv", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("policy", POLICIES)
def test_fused_step_equals_the_unfused_step(cpu_graphs, model, policy):
    free = _generate(model, policy, fused=False)
    # an EOS set that ends the rows at different steps: smaller buckets, captured anew
    for eos in (None, sorted({int(free.tokens[r, 1 + 2 * r]) for r in range(free.tokens.shape[0])})):
        ref = free if eos is None else _generate(model, policy, fused=False, eos=eos)
        got = _generate(model, policy, fused=True, eos=eos)
        assert (ref.meta["fused"], got.meta["fused"]) == ("off", "on")
        assert got.meta["cuda_graph"] == ref.meta["cuda_graph"] == "on"
        assert got.meta["graph_captures"] == ref.meta["graph_captures"] >= (1 if eos is None else 2)
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.lengths, ref.lengths)
        torch.testing.assert_close(got.rollout_logp, ref.rollout_logp, atol=2e-5, rtol=0)
        torch.testing.assert_close(got.topk_logp, ref.topk_logp, atol=2e-5, rtol=0)
        torch.testing.assert_close(got.kv_kept, ref.kv_kept)
        if policy.evicts:
            agree = got.kept_sets.agreement(ref.kept_sets)
            assert agree.events == len(ref.kept_sets.rows) > 0 and agree.identical == 1.0


def test_the_compiled_step_runs_the_custom_op_once_per_layer(cpu_graphs, model, monkeypatch):
    """The captured step is the compiled forward, and every layer's K/V write and attention go
    through ``sparsecorr::attend`` at run time (the op reads the active cache; never traced)."""
    calls = []

    def spy():
        calls.append(torch.compiler.is_compiling())
        return active()

    monkeypatch.setattr(fused_mod, "active", spy)
    out = _generate(model, Dense(), fused=True, steps=3)
    assert out.meta["fused"] == "on"
    # 2 decode steps: the capture's warm-up call + 2 replays = 3 forwards of 2 layers
    assert len(calls) == 3 * 2 and not any(calls)
    calls.clear()
    _generate(model, Dense(), fused=False, steps=3)
    assert calls == []  # the unfused step never calls the op


def test_one_compile_serves_every_batch_bucket(cpu_graphs):
    """Rows that finish shrink the batch to the next power of two (8 -> 4 -> 2 -> 1 here); the
    batch dimension is dynamic, so the compiled forward is made once for the buckets above 1 and
    once for a batch of 1 (dynamo specialises size 1), not once per bucket or per step."""
    torch._dynamo.reset()
    model = tiny_model("qwen3", num_layers=1, seed=3)
    ids = torch.randint(3, 128, (8, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(policy=StreamingLLM(sink=1, buffer=2), budget=6, max_new_tokens=12, temperature=0, logprobs_topk=0,
              cuda_graph=True)
    free = generate(model, ids, **kw, fused=False)
    eos = sorted({int(free.tokens[r, 1 + r]) for r in range(8)})
    ref = generate(model, ids, **kw, fused=False, eos_token_id=eos)
    before = counters["stats"]["unique_graphs"]
    got = generate(model, ids, **kw, fused=True, eos_token_id=eos)
    compiles = counters["stats"]["unique_graphs"] - before
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.lengths, ref.lengths)
    live = [int((ref.lengths > t).sum()) for t in range(1, int(ref.lengths.max()))]
    assert got.meta["graph_captures"] >= 3 and min(live) == 1  # buckets 8, 4, 2 and 1 met
    assert compiles == 2
    again = generate(model, ids, **kw, fused=True, eos_token_id=eos)  # a later call: no compile
    assert counters["stats"]["unique_graphs"] - before == 2 and torch.equal(again.tokens, got.tokens)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_bad_fused_values_are_refused(model, bad):
    ids, mask = _prompts(2)
    with pytest.raises(ValueError, match="fused: expected None"):
        generate(model, ids, mask, policy=Dense(), budget=None, max_new_tokens=2, fused=bad)


def test_fused_needs_the_graph_step(model):
    ids, mask = _prompts(2)
    with pytest.raises(ValueError, match=r"fused: True .* needs cuda_graph=True"):
        generate(model, ids, mask, policy=Dense(), budget=None, max_new_tokens=2, fused=True)
    off = generate(model, ids, mask, policy=Dense(), budget=None, max_new_tokens=2)
    assert off.meta["fused"] == "off" and off.meta["cuda_graph"] == "off"


@pytest.mark.parametrize("policy", [RKV(window=3, buffer=3), BlockTopK(page_size=2, keep_last_pages=1, dense_layers=1)],
                         ids=lambda p: p.name)
def test_a_failed_compile_warns_and_runs_the_unfused_step(cpu_graphs, monkeypatch, policy):
    """The compiled forward raises after a full forward (every layer's K/V, ring and page-sum
    writes done): the step falls back to the unfused capture, with the warm-up's writes undone
    (BlockTopK's running page sums would otherwise count the step's key twice), so tokens and
    log-probs are the unfused step's. A model of its own: the failure is remembered for it."""
    model = tiny_model("qwen3", num_layers=2)

    def broken(model, embeds, positions, cache):
        c = active()
        model(inputs_embeds=embeds, position_ids=positions, use_cache=True, logits_to_keep=1,
              **{cache_keyword(model): c})
        raise RuntimeError("inductor: C++ compile failed")

    monkeypatch.setattr(fused_mod, "compiled_forward", lambda: broken)
    ref = _generate(model, policy, fused=False)
    with pytest.warns(RuntimeWarning, match="fused: compiling or capturing the fused decode step failed, running it unfused") as rec:
        got = _generate(model, policy, fused=True)
    assert sum("fused:" in str(w.message) for w in rec) == 1  # once, not once per bucket
    assert got.meta["fused"] == "failed: RuntimeError: inductor: C++ compile failed"
    assert got.meta["cuda_graph"] == "on"
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.rollout_logp, ref.rollout_logp, atol=0, rtol=0)
    if policy.evicts:
        assert got.kept_sets.agreement(ref.kept_sets).identical == 1.0


def test_meta_says_unused_when_no_decode_step_was_captured(cpu_graphs, model):
    """Asked for, but no decode forward ran (the one token comes from the prefill's logits):
    ``meta`` says ``"unused"``, not ``"on"``, and no graph was captured."""
    ids, mask = _prompts(2)
    out = generate(model, ids, mask, policy=Dense(), budget=None, max_new_tokens=1, temperature=0, cuda_graph=True)
    assert (out.meta["cuda_graph"], out.meta["fused"], out.meta["graph_captures"]) == ("unused", "unused", 0)
    off = generate(model, ids, mask, policy=Dense(), budget=None, max_new_tokens=1, temperature=0, cuda_graph=True,
                   fused=False)
    assert (off.meta["cuda_graph"], off.meta["fused"]) == ("unused", "off")


def test_fused_defaults_to_the_graph_step(cpu_graphs, model):
    """``fused=None`` (the default) compiles the captured step whenever ``cuda_graph`` is on."""
    ids, mask = _prompts(2)
    kw = dict(policy=Dense(), budget=None, max_new_tokens=3, temperature=0)
    on = generate(model, ids, mask, cuda_graph=True, **kw)
    off = generate(model, ids, mask, cuda_graph=False, **kw)
    assert (on.meta["cuda_graph"], on.meta["fused"]) == ("on", "on")
    assert (off.meta["cuda_graph"], off.meta["fused"]) == ("off", "off")
    assert torch.equal(on.tokens, off.tokens)
