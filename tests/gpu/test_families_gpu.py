"""Hybrid attention on a CUDA GPU (issue #52; marker ``gpu``, skipped without CUDA): a GPT-OSS-shaped
small model (sliding-window layers beside full ones, learned sinks; random bf16 weights) and a
Gemma 2-shaped one (soft-capping) on the backend ``auto`` chooses (FlashInfer where installed: the
sinks through its LSE, the soft-cap as ``logits_soft_cap``), CUDA-graph steps against eager ones
and the decode against float32 teacher forcing with the reference backend.

Run with ``python -m pytest -m gpu tests/gpu/test_families_gpu.py``. Nothing here imports TRL,
OpenRLHF or verl.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sparsecorr.decoding import RKV, Dense, generate, teacher_forced_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
WINDOW = 128
ALT = ["sliding_attention", "full_attention"] * 2


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, vocab_size=2048, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=WINDOW, layer_types=ALT,
                       max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return cfg, GptOssForCausalLM


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=128, vocab_size=2048, sliding_window=WINDOW,
                       layer_types=ALT, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                       query_pre_attn_scalar=128, max_position_embeddings=4096, eos_token_id=None,
                       bos_token_id=None, pad_token_id=0)
    return cfg, Gemma2ForCausalLM


def _model(make):
    cfg, cls = make()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device("cuda"):
        return cls(cfg).to(torch.bfloat16).eval()


def _prompts(b=4, p=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 2048, (b, p), generator=g)
    am = torch.ones_like(ids)
    am[1, :37] = 0  # ragged
    return ids.cuda(), am.cuda()


def _mad(a, b, mask):
    return float((a.float() - b.float())[mask].abs().mean())


def _first_diff(a, b):
    """Per row, the decode steps before the first differing token (bf16 may flip a near tie)."""
    same = (a == b).long().cumprod(1)
    return same.sum(1)


FAMILIES = [pytest.param(_gpt_oss, id="gpt-oss"), pytest.param(_gemma2, id="gemma2")]


@pytest.mark.parametrize("policy", [Dense(), RKV(buffer=16)], ids=lambda p: p.name)
@pytest.mark.parametrize("make", FAMILIES)
def test_hybrid_decode_on_auto_graph_equals_eager_and_float32(make, policy):
    model = _model(make)
    ids, am = _prompts()
    kw = dict(policy=policy, budget=None if isinstance(policy, Dense) else 96, max_new_tokens=96, temperature=0,
              backend="auto", prefill_chunk=128)
    eager = generate(model, ids, am, cuda_graph=False, record_keep=not isinstance(policy, Dense), **kw)
    graph = generate(model, ids, am, cuda_graph=True, **kw)
    label = eager.meta["backend"]
    print(f"[{make.__name__} {policy.name}] backend {label!r}; graph {graph.meta['cuda_graph']!r}")
    if importlib.util.find_spec("flashinfer") is not None:
        assert label == "flashinfer", label  # sinks and the soft-cap do not send auto to torch
    assert graph.meta["backend"] == label and graph.meta["cuda_graph"] == "on"
    # graph = eager: identical tokens up to a bf16 near-tie, log-probs within 1e-2 before it
    n = _first_diff(eager.tokens, graph.tokens)
    mask = eager.mask & (torch.arange(eager.tokens.shape[1])[None] < n[:, None])
    print(f"  graph = eager for {n.tolist()} of {eager.lengths.tolist()} steps; "
          f"MAD {_mad(eager.rollout_logp, graph.rollout_logp, mask):.5f}")
    assert int((n >= eager.lengths).sum()) >= 3  # 3 rows in 4 identical throughout
    assert _mad(eager.rollout_logp, graph.rollout_logp, mask) < 1e-2
    # the bf16 decode against float32 teacher forcing with the reference backend (same kept sets)
    ref = teacher_forced_logprobs(model, ids, eager.tokens.cuda(), policy=policy, budget=kw["budget"],
                                  attention_mask=am, response_mask=eager.mask.cuda(), backend="reference",
                                  prefill_chunk=128, keep_sets=eager.kept_sets)
    mad = _mad(eager.rollout_logp, ref.rollout_logp, eager.mask)
    print(f"  decode vs float32 teacher forcing: MAD {mad:.5f}")
    assert mad < 1e-2
