"""The adapter's contract (``sparsecorr.decoding.hf``) against the installed transformers.

Run on the lock's transformers by ``make test`` and on both ends of the supported range by
``make test-edges``: the cache's ``update``, the forward keyword, the attention hook, positions
and the config fields each work as the engine relies on them, without a deprecation warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from torch.nn.attention.bias import causal_lower_right

from sparsecorr.decoding import Dense, StreamingLLM, generate, hf, teacher_forced_logprobs
from sparsecorr.decoding.backends import PagedBackend, ReferenceDecodeKernel, TorchBackend
from tests.models import tiny_model


class _Recording(hf.CacheBase):
    """A cache that keeps every layer's keys/values by concatenation and records each write."""

    def __init__(self, n):
        super().__init__(n)
        self.k, self.v, self.writes = [None] * n, [None] * n, []

    def write(self, layer_idx, key, value):
        self.writes.append((layer_idx, tuple(key.shape)))
        cat = lambda a, x: x if a is None else torch.cat([a, x], 2)  # noqa: E731
        self.k[layer_idx], self.v[layer_idx] = cat(self.k[layer_idx], key), cat(self.v[layer_idx], value)
        return self.k[layer_idx], self.v[layer_idx]

    def seq_length(self):
        return 0 if self.k[0] is None else self.k[0].shape[2]


def test_installed_transformers_is_supported_and_named():
    assert Version(hf.check_transformers()) in hf.SUPPORTED
    assert hf.check_transformers() == transformers.__version__


@pytest.mark.parametrize("version", ["5.8.1", "6.0.0", "4.57.6"])
def test_a_version_outside_the_range_gets_one_clear_error(version):
    with pytest.raises(hf.UnsupportedTransformersError) as err:
        hf.check_transformers(version)
    msg = str(err.value)
    assert f"transformers=={version} is installed" in msg and str(hf.SUPPORTED) in msg


def test_generate_refuses_an_unsupported_transformers_before_any_forward(monkeypatch):
    model = tiny_model("qwen3")
    monkeypatch.setattr(hf.transformers, "__version__", "6.1.0")
    called = []
    model.register_forward_pre_hook(lambda *a: called.append(1))
    with pytest.raises(hf.UnsupportedTransformersError, match=r"transformers==6\.1\.0"):
        generate(model, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, policy=Dense(), budget=None)
    assert not called


def _causal(layer, query, key, value, scaling):
    """Causal attention over the keys ``write`` returned (the model's own mask is not used)."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(query.shape[2], key.shape[2]), scale=scaling, enable_gqa=True)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_cache_update_forward_keyword_and_positions(arch):
    """Every layer's ``update`` reaches ``write`` once per forward, the returned keys are the ones
    attended, positions are honoured, and no FutureWarning is raised (the keyword is current)."""
    model = tiny_model(arch, num_layers=3)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    hf.register_attention("sparsecorr_contract_causal", _causal)
    with torch.no_grad(), hf.sparse_attention(model, "sparsecorr_contract_causal"):
        full = model(input_ids=ids).logits
        cache = _Recording(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            first = hf.forward(model, input_ids=ids[:, :4], position_ids=torch.arange(4).expand(2, 4), cache=cache)
            second = hf.forward(model, input_ids=ids[:, 4:], position_ids=torch.arange(4, 7).expand(2, 3),
                                cache=cache, logits_to_keep=1)
    assert [w[0] for w in cache.writes] == [0, 1, 2, 0, 1, 2]
    assert cache.writes[0][1] == (2, 2, 4, 16) and cache.get_seq_length() == 7 and len(cache) == 3
    torch.testing.assert_close(first.logits, full[:, :4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second.logits[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)


def test_attention_hook_is_called_per_layer_with_the_scale_and_restored():
    model = tiny_model("qwen3", num_layers=2)
    seen = []

    def attn(layer, query, key, value, scaling):
        seen.append((layer, scaling))
        return torch.zeros_like(query)

    hf.register_attention("sparsecorr_contract_probe", attn)
    before = model.config._attn_implementation
    with torch.no_grad(), hf.sparse_attention(model, "sparsecorr_contract_probe"):
        model(input_ids=torch.ones(1, 3, dtype=torch.long))
    assert seen == [(0, 16 ** -0.5), (1, 16 ** -0.5)]
    assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="boom"), hf.sparse_attention(model, "sparsecorr_contract_probe"):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_model_spec_reads_the_config(arch):
    model = tiny_model(arch, num_layers=3, num_heads=4, num_kv_heads=2)
    spec = hf.model_spec(model)
    head_dim = 16 if arch != "qwen2" else 64 // 4
    assert spec == hf.ModelSpec(layers=3, heads_q=4, heads_kv=2, head_dim=head_dim, hidden_size=64,
                                scaling=head_dim ** -0.5)


# -- attention variants: read into the spec (served; refusals: test_refusals.py) -------------------
def _tiny(config_cls, model_cls, **extra):
    cfg = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, **extra)
    cfg._attn_implementation = "eager"
    return model_cls(cfg).eval()


def _variants():
    t = transformers
    yield "qwen3-sliding", lambda: _tiny(t.Qwen3Config, t.Qwen3ForCausalLM, use_sliding_window=True,
                                         sliding_window=8, max_window_layers=0), dict(sliding=(0, 1), window=8)
    yield "mistral-sliding", lambda: _tiny(t.MistralConfig, t.MistralForCausalLM, sliding_window=8), \
        dict(sliding=(0, 1), window=8)
    yield "gemma2-softcap", lambda: _tiny(t.Gemma2Config, t.Gemma2ForCausalLM, attn_logit_softcapping=50.0,
                                          sliding_window=8), dict(sliding=(0,), window=8, softcap=50.0)
    yield "gpt-oss-sinks", lambda: _tiny(t.GptOssConfig, t.GptOssForCausalLM, num_local_experts=2,
                                         num_experts_per_tok=1, sliding_window=8), dict(sliding=(0,), window=8,
                                                                                          sinks=True)


@pytest.mark.parametrize("name,build,fields", list(_variants()), ids=lambda x: x if isinstance(x, str) else "")
def test_attention_variants_are_read_into_the_spec(name, build, fields):
    spec = hf.model_spec(build())
    got = {k: getattr(spec, k) for k in fields}
    assert got == fields
    assert spec.full == tuple(i for i in range(spec.layers) if i not in spec.sliding)


def _scaled(scale):
    model = tiny_model("qwen3", num_layers=2)
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "scaling"):
            m.scaling = scale
    return model


def test_a_model_scaling_is_honoured_against_the_models_own_forward():
    model = _scaled(0.5)
    assert hf.model_spec(model).scaling == 0.5
    g = torch.Generator().manual_seed(1)
    ids, resp = torch.randint(3, 128, (2, 6), generator=g), torch.randint(3, 128, (2, 5), generator=g)
    out = teacher_forced_logprobs(model, ids, resp, policy=Dense(), budget=None, backend="torch")
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids, resp], 1)).logits.float()
    ref = logits.log_softmax(-1)[:, 5:-1].gather(-1, resp[..., None])[..., 0]
    torch.testing.assert_close(out.rollout_logp, ref, atol=1e-5, rtol=1e-5)


def test_the_paged_backend_uses_the_model_scaling():
    model = _scaled(0.9)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, policy=StreamingLLM(sink=1, buffer=2), budget=6, temperature=0.0)
    ref = generate(model, ids, backend=TorchBackend(), **kw)
    got = generate(model, ids, backend=PagedBackend(ReferenceDecodeKernel, name="paged-oracle"), **kw)
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.rollout_logp, ref.rollout_logp, atol=2e-5, rtol=0)


def test_different_scales_per_layer_are_refused():
    model = _scaled(0.5)
    next(m for m in model.modules() if getattr(m, "layer_idx", None) == 1 and hasattr(m, "scaling")).scaling = 0.3
    with pytest.raises(ValueError, match="model: scaling is not supported"):
        hf.model_spec(model)


def test_a_peft_wrapped_model_gets_the_keyword_of_the_model_it_wraps():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen3", num_layers=2),
                                peft.LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.0))
    cache = _Recording(2)
    hf.register_attention("sparsecorr_contract_causal", _causal)
    with torch.no_grad(), hf.sparse_attention(model, "sparsecorr_contract_causal"), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        hf.forward(model, input_ids=torch.ones(1, 3, dtype=torch.long), position_ids=torch.arange(3)[None],
                   cache=cache)
    assert [w[0] for w in cache.writes] == [0, 1]
