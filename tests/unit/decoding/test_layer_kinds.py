"""Issue 52: what ``hf.model_spec`` reads of each layer's attention, the ring's window against
HF's own mask function, the learned sinks read from the module at call time, logit soft-capping
against HF, and the CUDA-graph and fused steps (on the CPU through ``cpu_graphs``) on hybrid
models."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.masking_utils import sliding_window_causal_mask_function

from sparsecorr.decoding import RKV, BlockTopK, Dense, generate, teacher_forced_logprobs
from sparsecorr.decoding.hf import model_spec
from sparsecorr.decoding.pool import WindowRing
from tests.unit.decoding.test_sliding import WINDOW, _ids, hf_greedy, hybrid


@pytest.mark.parametrize("window", [1, 3, 5])
def test_the_ring_mask_is_hfs_sliding_window_mask(window):
    """`WindowRing.mask` attends what HF's ``sliding_window_causal_mask_function`` allows, for
    every query and key position of a wrapped ring (the window includes the query)."""
    slots, ctx = window + 3, 17
    ring = WindowRing(layers=1, batch=1, kv_heads=1, head_dim=2, window=window, slots=slots,
                      dtype=torch.float32, device=torch.device("cpu"), grad=False)
    real, offsets = torch.tensor([4]), torch.arange(4)
    for c0 in range(0, ctx, 4):
        s, p = ring.plan(torch.tensor([c0]), real, offsets)
        ring.write_positions(s, p)
        queries = (c0 + offsets)[None]
        mask = ring.mask(queries)[0, 0]
        fn = sliding_window_causal_mask_function(window)
        for i, q in enumerate(queries[0].tolist()):
            for j, kv in enumerate(ring.pos[0].tolist()):
                if kv < 0:
                    assert not mask[i, j]
                    continue
                want = bool(fn(torch.tensor(0), torch.tensor(0), torch.tensor(q), torch.tensor(kv)))
                assert bool(mask[i, j]) == want, (q, kv)
            # every position HF allows is in the ring (none was overwritten too early)
            held = set(ring.pos[0].tolist())
            assert set(range(max(0, q - window + 1), q + 1)) <= held


def _fake(n, **cfg):
    """A model-shaped object: ``config`` and attention modules with ``layer_idx`` / ``scaling``."""
    mods = [torch.nn.Module() for _ in range(n)]
    for i, m in enumerate(mods):
        m.layer_idx, m.scaling = i, 0.25
    root = torch.nn.ModuleList(mods)
    root.config = SimpleNamespace(num_hidden_layers=n, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  hidden_size=32, **cfg)
    return root


@pytest.mark.parametrize("cfg,sliding", [
    (dict(sliding_window=4, sliding_window_pattern=3), (0, 1, 3, 4)),  # every 3rd layer full
    (dict(sliding_window=4), (0, 1, 2, 3, 4, 5)),  # Mistral: a window on the config, every layer
    (dict(sliding_window=4, use_sliding_window=False), ()),  # Qwen's unused window
    (dict(sliding_window=4, layer_types=["full_attention", "sliding_attention"] * 3), (1, 3, 5)),
    (dict(sliding_window=None), ()),
])
def test_the_conventions_without_and_with_layer_types(cfg, sliding):
    spec = model_spec(_fake(6, **cfg))
    assert spec.sliding == sliding
    assert spec.window == (4 if sliding else None)
    assert spec.layer_kinds == tuple(("sliding", 4) if i in sliding else ("full", None) for i in range(6))


def test_sliding_layers_with_two_windows_are_refused():
    model = _fake(4, sliding_window=4, layer_types=["sliding_attention"] * 4)
    model[2].sliding_window = 8
    with pytest.raises(ValueError, match=r"model: sliding_window is not supported .*windows \[4, 8\]"):
        model_spec(model)


@pytest.fixture(scope="module")
def gpt_oss():
    return hybrid("gpt_oss")


def test_sinks_are_read_from_the_module_at_call_time(gpt_oss):
    """Training updates the sinks in place: the next call decodes with the new values (and
    still equals HF, which reads the same parameter)."""
    ids = _ids()
    kw = dict(policy=Dense(), budget=None, max_new_tokens=10, temperature=0.0, backend="torch", prefill_chunk=4)
    before = generate(gpt_oss, ids, **kw)
    sinks = [m.sinks for m in gpt_oss.modules() if getattr(m, "sinks", None) is not None]
    saved = [s.detach().clone() for s in sinks]
    try:
        with torch.no_grad():
            for s in sinks:
                s.add_(torch.linspace(-4.0, 4.0, s.numel()))
        after = generate(gpt_oss, ids, **kw)
        assert not torch.allclose(after.rollout_logp, before.rollout_logp)
        assert torch.equal(after.tokens, hf_greedy(gpt_oss, ids, 10))
    finally:
        with torch.no_grad():
            for s, v in zip(sinks, saved):
                s.copy_(v)


def test_soft_capped_logits_decode_as_hf():
    """Gemma 2 (soft cap 50 by default; 5 here so the cap bites): dense greedy equals HF."""
    model = hybrid("gemma2")
    for m in model.modules():
        if hasattr(m, "attn_logit_softcapping"):
            m.attn_logit_softcapping = 5.0
    model.config.attn_logit_softcapping = 5.0
    assert model_spec(model).softcap == 5.0
    ids = _ids()
    out = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=12, temperature=0.0, backend="torch",
                   prefill_chunk=4)
    assert torch.equal(out.tokens, hf_greedy(model, ids, 12))


@pytest.mark.parametrize("policy", [pytest.param(RKV(window=3, buffer=3), id="rkv"),
                                    pytest.param(BlockTopK(page_size=2, keep_last_pages=1, dense_layers=0),
                                                 id="block_topk", marks=pytest.mark.slow)])
def test_the_graph_step_equals_the_eager_step_on_a_hybrid_model(cpu_graphs, gpt_oss, policy):
    """The captured step (static buffers, the ring's mask made inside it, sinks from the module)
    runs on the hybrid model without falling back, and equals the eager step."""
    ids = _ids(b=3)
    kw = dict(policy=policy, budget=6, max_new_tokens=10, temperature=0.0, backend="torch", prefill_chunk=4)
    eager = generate(gpt_oss, ids, **kw)
    graph = generate(gpt_oss, ids, cuda_graph=True, fused=False, **kw)
    assert graph.meta["cuda_graph"] == "on"
    assert torch.equal(graph.tokens, eager.tokens)
    torch.testing.assert_close(graph.rollout_logp, eager.rollout_logp, atol=2e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_oss", "gemma3"])
def test_the_fused_step_runs_on_a_hybrid_model(cpu_graphs, name):
    """The compiled step (the custom op ``sparsecorr::attend`` takes the module's sinks) does not
    fall back on sliding + sinks layers, and equals the eager step (inductor's C++ compile: slow)."""
    model = hybrid(name)
    ids = _ids(b=3)
    kw = dict(policy=Dense(), budget=None, max_new_tokens=10, temperature=0.0, backend="torch", prefill_chunk=4)
    fused = generate(model, ids, cuda_graph=True, fused=True, **kw)
    assert fused.meta["fused"] == "on"
    eager = generate(model, ids, **kw)
    assert torch.equal(fused.tokens, eager.tokens)
    torch.testing.assert_close(fused.rollout_logp, eager.rollout_logp, atol=2e-5, rtol=0)


def test_every_layer_kind_of_the_tiny_families():
    """What the spec reads of each family's own config (transformers builds it)."""
    want = {"gemma3": ((0, 1, 2, 3, 4), None, False), "gpt_oss": ((0, 2), None, True),
            "mistral": ((0, 1, 2, 3), None, False), "qwen2": ((2, 3), None, False),
            "exaone4": ((0, 1, 2), None, False), "gemma2": ((0, 2), 50.0, False)}
    for name, (sliding, softcap, sinks) in want.items():
        spec = model_spec(hybrid(name))
        assert (spec.sliding, spec.window, spec.softcap, spec.sinks) == (sliding, WINDOW, softcap, sinks), name
    assert model_spec(hybrid("mistral")).full == ()
    assert isinstance(transformers.__version__, str)


def test_the_sinks_gradient_reaches_every_layers_parameter(gpt_oss):
    """With ``grad=True`` the sliding and the full layers' sinks (the module parameters, passed
    to the backend) get a gradient from the sparse log-probs."""
    ids, resp = _ids(), _ids(p=8, seed=6)
    out = teacher_forced_logprobs(gpt_oss, ids, resp, policy=RKV(window=3, buffer=3), budget=6, grad=True,
                                  backend="torch", prefill_chunk=4)
    try:
        out.rollout_logp.sum().backward()
        sinks = [m.sinks for m in gpt_oss.modules() if getattr(m, "sinks", None) is not None]
        assert len(sinks) == model_spec(gpt_oss).layers
        assert all(s.grad is not None and bool(s.grad.abs().sum() > 0) for s in sinks)
    finally:
        gpt_oss.zero_grad(set_to_none=True)
