"""sparsecorr.decoding on a CUDA GPU (marker ``gpu``; skipped without CUDA).

Run with ``python -m pytest -m gpu tests/gpu`` (always with the path: a bare ``-m gpu`` also
collects the integration tests, which import TRL, OpenRLHF and verl); nothing here imports them.
The FlashInfer tests also need ``flashinfer-python`` (see the FlashInfer guide for a prebuilt,
JIT-free install on an offline machine).
"""

import importlib.util

import pytest
import torch

from sparsecorr.decoding import (
    RKV,
    BlockTopK,
    Dense,
    SnapKV,
    StreamingLLM,
    generate,
    teacher_forced_logprobs,
)

pytestmark = pytest.mark.gpu
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                      reason="needs flashinfer-python")
POLICIES = [Dense(), StreamingLLM(buffer=16), SnapKV(buffer=16), RKV(buffer=16), BlockTopK(dense_layers=1)]


def _model(*, kv_heads=2, heads=8, head_dim=128, layers=4, dtype=torch.bfloat16):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=2048,
                      max_position_embeddings=65536, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen3ForCausalLM(cfg).to(dtype).eval()


def _prompts(b=4, p=700, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 2048, (b, p), generator=g)
    am = torch.ones_like(ids)
    am[1, :37] = 0  # ragged
    return ids.cuda(), am.cuda()


def _mad(a, b, mask):
    return float((a - b)[mask].abs().mean())


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("backend", ["torch", pytest.param("flashinfer", marks=needs_flashinfer)])
@pytest.mark.parametrize("kv_heads", [2, 1])  # GQA groups 4 and 8 (8 // 1)
def test_decoded_logprobs_match_float32_teacher_forcing(policy, backend, kv_heads):
    """Decode in bf16 with the backend; replay the tokens with the float32 reference attention
    under the decode's own kept sets: per-token log-prob MAD < 1e-2 (issue #17's parity target,
    numerics only). The agreement of a free replay's kept sets is printed, not asserted: in bf16
    a near-tied eviction score flips (issue 34; ENGINE-READING-2026-11-26 §4)."""
    model = _model(kv_heads=kv_heads)
    ids, am = _prompts()
    out = generate(model, ids, am, policy=policy, budget=256, max_new_tokens=96, temperature=0,
                   backend=backend, prefill_chunk=256, record_keep=True)
    assert out.meta["backend"] == backend
    kw = dict(policy=policy, budget=256, attention_mask=am, response_mask=out.mask.cuda(), backend="reference",
              prefill_chunk=256)
    ref = teacher_forced_logprobs(model, ids, out.tokens.cuda(), keep_sets=out.kept_sets, **kw)
    free = teacher_forced_logprobs(model, ids, out.tokens.cuda(), record_keep=True, **kw)
    agree = out.kept_sets.agreement(free.kept_sets)
    print(f"[{policy.name} {backend} kv{kv_heads}] MAD replayed {_mad(out.rollout_logp, ref.rollout_logp, out.mask):.4f}"
          f" free {_mad(out.rollout_logp, free.rollout_logp, out.mask):.4f}; kept sets identical "
          f"{agree.identical:.3f} Jaccard {agree.jaccard:.3f} ({agree.events} events)")
    assert _mad(out.rollout_logp, ref.rollout_logp, out.mask) < 1e-2


@pytest.mark.parametrize("policy", POLICIES[1:4], ids=lambda p: p.name)
def test_float32_decode_keeps_the_replays_kept_sets(policy):
    """In float32 the decode and a free float32 replay keep identical sets (asserted)."""
    model = _model(dtype=torch.float32)
    ids, am = _prompts()
    out = generate(model, ids, am, policy=policy, budget=256, max_new_tokens=64, temperature=0,
                   backend="torch", prefill_chunk=256, record_keep=True)
    free = teacher_forced_logprobs(model, ids, out.tokens.cuda(), policy=policy, budget=256, attention_mask=am,
                                   response_mask=out.mask.cuda(), backend="reference", prefill_chunk=256,
                                   record_keep=True)
    agree = out.kept_sets.agreement(free.kept_sets)
    assert agree.events > 0 and agree.identical == 1.0, agree
    assert _mad(out.rollout_logp, free.rollout_logp, out.mask) < 1e-3


def _replay_logp(model, ids, am, tokens, *, policy, budget, backend, cuda_graph, keep_sets=None, fused=False):
    """Log-probs of ``tokens [B, T]`` fed one decode step at a time (as ``generate`` feeds its own
    samples), eagerly or through the captured graph step (``fused``: compiled), under
    ``keep_sets`` (the eager run's kept sets) when given; column 0 comes from the prefill."""
    from sparsecorr.decoding.backends import get_backend
    from sparsecorr.decoding.cache import ATTN_NAME, active_cache
    from sparsecorr.decoding.engine import Engine, pool_capacity
    from sparsecorr.decoding.generate import _prompts
    from sparsecorr.decoding.hf import sparse_attention
    from sparsecorr.decoding.loops import prefill
    from sparsecorr.decoding.validate import budget_table

    ids, lens = _prompts(model, ids, am)
    t = tokens.shape[1]
    longest = int(lens.max()) + t
    table = budget_table(budget, dense=policy.kind == "dense", longest=longest)
    param = next(model.parameters())
    engine = Engine(model, policy=policy, backend=get_backend(backend, device=param.device, dtype=param.dtype),
                    table=table, batch=ids.shape[0], capacity=pool_capacity(policy, table, longest=longest, chunk=256),
                    grad=False, cuda_graph=cuda_graph, fused=fused)
    engine.forced_keep = None if keep_sets is None else keep_sets.lookup()
    tokens = tokens.to(param.device)
    out = []
    with sparse_attention(model, ATTN_NAME), active_cache(engine.cache), torch.no_grad():
        logits = prefill(engine, ids, lens, 256)
        engine.compress_due()
        for i in range(t):
            out.append(logits.float().log_softmax(-1).gather(1, tokens[:, i:i + 1])[:, 0])
            if i + 1 == t:
                break
            logits = engine.feed(tokens[:, i:i + 1], torch.ones(ids.shape[0], dtype=torch.long), decode=True,
                                 logits_to_keep=1).logits[:, -1]
            engine.compress_due()
    status = engine.graphs.status if engine.graphs is not None else "off"
    if fused:  # the fused step must have run, not its unfused fallback
        assert engine.graphs.fused == "on", engine.graphs.fused
    return torch.stack(out, 1).cpu(), status


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("backend", ["torch", pytest.param("flashinfer", marks=needs_flashinfer)])
def test_cuda_graph_step_equals_eager(policy, backend):
    """What graph and eager steps can honestly be held to on a random bf16 model (nearly flat
    logits, so a greedy token may flip within kernel rounding, and one flip changes the rest of
    the row): the capture ran ("on"); replaying the eager tokens through the graph step gives
    the eager log-probs under the eager run's kept sets (MAD < 1e-2; a bf16 graph step may flip
    a near-tied eviction score, issue 34); with EOS (rows leave the batch), the runs agree in
    log-prob up to each row's first diverging token."""
    model = _model()
    ids, am = _prompts(seed=1)
    kw = dict(policy=policy, budget=256, max_new_tokens=64, temperature=0, backend=backend, prefill_chunk=256)
    eager = generate(model, ids, am, record_keep=True, **kw)
    replay, status = _replay_logp(model, ids, am, eager.tokens, policy=policy, budget=256, backend=backend,
                                  cuda_graph=True, keep_sets=eager.kept_sets)
    assert status == "on"
    assert _mad(eager.rollout_logp, replay, eager.mask) < 1e-2
    eager = generate(model, ids, am, eos_token_id=[7, 11], **kw)
    graph = generate(model, ids, am, cuda_graph=True, eos_token_id=[7, 11], **kw)
    assert graph.meta["cuda_graph"] == "on", graph.meta["cuda_graph"]
    same = (eager.tokens == graph.tokens) & eager.mask & graph.mask
    prefix = same.long().cumprod(1).bool()  # up to (and excluding) each row's first divergence
    assert bool(prefix[:, 0].all())  # the first token comes from the (shared) prefill
    assert _mad(eager.rollout_logp, graph.rollout_logp, prefix) < 1e-2


def test_sampling_with_a_cpu_generator_on_cuda():
    """temperature > 0 with a CPU generator (what the TRL trainer and ``sparsecorr decode``
    pass): noise is drawn on the GPU from a generator seeded by it; seeded runs reproduce."""
    model = _model(layers=2)
    ids, am = _prompts(b=2, p=64)
    kw = dict(policy=RKV(buffer=16), budget=32, max_new_tokens=8, temperature=1.0)
    a = generate(model, ids, am, generator=torch.Generator().manual_seed(0), **kw)
    b = generate(model, ids, am, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(a.tokens, b.tokens)
    c = generate(model, ids, am, generator=torch.Generator("cuda").manual_seed(0), **kw)
    assert c.tokens.shape == a.tokens.shape


def test_decode_step_issues_no_host_sync():
    from sparsecorr.decoding.backends import TorchBackend
    from sparsecorr.decoding.cache import ATTN_NAME, active_cache
    from sparsecorr.decoding.engine import Engine, pool_capacity
    from sparsecorr.decoding.hf import sparse_attention
    from sparsecorr.decoding.loops import prefill
    from sparsecorr.decoding.validate import budget_table

    model = _model()
    ids, _ = _prompts()
    lens = torch.full((ids.shape[0],), ids.shape[1])
    for policy in (Dense(), RKV(buffer=16), BlockTopK(dense_layers=1)):
        table = budget_table(256, dense=policy.kind == "dense", longest=ids.shape[1] + 8)
        engine = Engine(model, policy=policy, backend=TorchBackend(), table=table, batch=ids.shape[0],
                        capacity=pool_capacity(policy, table, longest=ids.shape[1] + 8, chunk=256), grad=False)
        with sparse_attention(model, ATTN_NAME), active_cache(engine.cache), torch.no_grad():
            logits = prefill(engine, ids, lens, 256)
            engine.compress_due()
            tok = logits.argmax(-1)[:, None]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):  # within budget + buffer: no compression event in between
                    out = engine.feed(tok, torch.ones(ids.shape[0], dtype=torch.long), decode=True,
                                      logits_to_keep=1)
                    tok = out.logits[:, -1].argmax(-1)[:, None]
            finally:
                torch.cuda.set_sync_debug_mode("default")


def test_long_prefill_is_memory_bounded():
    """8 x 32k tokens through a 4-layer model: no S x S scores, logits only at the last token,
    and an eviction policy's KV never above budget + buffer + one prefill chunk."""
    model = _model(heads=16, kv_heads=8)
    b, s = 8, 32768
    ids = torch.randint(5, 2048, (b, s), generator=torch.Generator().manual_seed(2)).cuda()
    weights = torch.cuda.memory_allocated()
    dense_kv = 2 * 4 * 8 * 128 * 2 * b * s  # K+V, layers, heads, head_dim, bf16
    for policy, budget in ((Dense(), None), (RKV(), 2048), (SnapKV(), 2048)):
        torch.cuda.reset_peak_memory_stats()
        out = generate(model, ids, policy=policy, budget=budget, max_new_tokens=8, temperature=0,
                       prefill_chunk=1024)
        peak = torch.cuda.max_memory_allocated() - weights
        if budget is None:
            assert peak < 2.0 * dense_kv, peak / dense_kv
        else:
            assert out.peak_kv_bytes <= (budget + 128 + 1024) * dense_kv // s
            assert peak < 0.25 * dense_kv, peak / dense_kv


@needs_flashinfer
def test_auto_picks_flashinfer_on_cuda():
    model = _model(layers=2)
    ids, am = _prompts(b=2, p=64)
    out = generate(model, ids, am, policy=RKV(buffer=16), budget=32, max_new_tokens=4)
    assert out.meta["backend"] == "flashinfer"


@pytest.mark.parametrize("device", ["cuda", "cpu"], ids=["cuda-generator", "cpu-generator"])
def test_seeded_graph_steps_sample_as_eager_steps(device):
    """Issue 50: the captured step samples (forward + sampling in one graph). A seeded run gives the
    eager run's tokens: the warm-up leaves the generator where it was, a non-default CUDA
    generator is registered with each graph (``register_generator_state``), and every step draws
    its noise for the whole batch, so padding rows and late-read EOS rows change no row's draw.
    float32, so the two paths' logits differ by float noise only; EOS ends rows at different steps
    (the batch pads, then shrinks to a smaller bucket)."""
    model = _model(layers=2, dtype=torch.float32)
    ids, am = _prompts(b=6, p=32)
    kw = dict(policy=RKV(buffer=16), budget=32, max_new_tokens=48, temperature=1.0, top_p=0.95,
              logprobs_topk=2, eos_token_id=[7, 11, 19, 23, 29])
    gen = lambda: torch.Generator(device).manual_seed(0)  # noqa: E731
    eager = generate(model, ids, am, generator=gen(), **kw)
    graph = generate(model, ids, am, generator=gen(), cuda_graph=True, fused=False, **kw)
    again = generate(model, ids, am, generator=gen(), cuda_graph=True, fused=False, **kw)
    assert graph.meta["cuda_graph"] == "on", graph.meta["cuda_graph"]
    assert torch.equal(graph.tokens, again.tokens)
    assert torch.equal(graph.tokens, eager.tokens) and torch.equal(graph.lengths, eager.lengths)
    assert graph.finish_reason == eager.finish_reason
    torch.testing.assert_close(graph.rollout_logp, eager.rollout_logp, atol=1e-4, rtol=0)
