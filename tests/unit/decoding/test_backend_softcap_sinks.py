"""Soft-capping (Gemma 2) and learned sinks (GPT-OSS) in every backend, against the peers' own
eager attention run in float64: transformers' ``models/gemma2/modeling_gemma2.py``
``eager_attention_forward`` (soft-cap) and ``models/gpt_oss/modeling_gpt_oss.py``
``eager_attention_forward`` (sink column concatenated to the logits, dropped after the softmax),
with masks, GQA and several query lengths; the paged path on the CPU stand-in for FlashInfer's
kernel (`ReferenceDecodeKernel`: it returns the LSE the sink rescale reads)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from sparsecorr.decoding.backends import (
    PagedBackend,
    ReferenceBackend,
    ReferenceDecodeKernel,
    TorchBackend,
)
from sparsecorr.decoding.backends.paged import apply_sinks
from sparsecorr.decoding.backends.paging import paged_attention_reference
from sparsecorr.decoding.backends.torch_ref import softmax_attention

F64 = torch.float64
SCALE = 0.3


class _Module(torch.nn.Module):
    """What HF's eager attention reads from its module."""

    def __init__(self, group: int, sinks: torch.Tensor | None = None):
        super().__init__()
        self.num_key_value_groups = group
        self.training = False
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)


def hf_eager(query, key, value, allowed, *, softcap=None, sinks=None):
    """The peer's attention in float64: Gemma 2's (soft-cap), GPT-OSS's (sinks), or, for both at
    once (no HF family has both), GPT-OSS's sink column over Gemma 2's capped logits."""
    q, k, v = query.to(F64), key.to(F64), value.to(F64)
    hq, hkv = q.shape[1], k.shape[1]
    bias = None
    if allowed is not None:
        m = allowed._materialize(q.device)[None, None] if isinstance(allowed, CausalBias) else allowed
        if m.shape[1] not in (1, hq):
            m = m.repeat_interleave(hq // hkv, dim=1)
        bias = torch.zeros(m.shape, dtype=F64).masked_fill(~m, -torch.inf)
    if sinks is None:
        out, _ = gemma2_eager(_Module(hq // hkv), q, k, v, bias, scaling=SCALE, softcap=softcap)
    elif softcap is None:
        out, _ = gpt_oss_eager(_Module(hq // hkv, sinks.to(F64)), q, k, v, bias, scaling=SCALE)
    else:  # Gemma 2's capping, then GPT-OSS's sink column (written out: no HF function does both)
        kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        logits = softcap * torch.tanh(q @ kr.transpose(2, 3) * SCALE / softcap)
        logits = logits if bias is None else logits + bias
        col = sinks.to(F64).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        probs = torch.softmax(torch.cat([logits, col], -1), -1)[..., :-1]
        out = (probs @ vr).transpose(1, 2)
    return out.transpose(1, 2)  # HF returns [B, Q, H, D]


def _inputs(hkv, q_len, *, b=2, hq=4, s=11, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, q_len, d, generator=g) * 2
    k = torch.randn(b, hkv, s, d, generator=g) * 2
    v = torch.randn(b, hkv, s, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 2
    return q.to(dtype), k.to(dtype), v.to(dtype), sinks


def _mask(kind, b, hq, hkv, q_len, s, seed=1):
    if kind == "none":
        return None
    if kind == "causal":
        return causal_lower_right(q_len, s)
    g = torch.Generator().manual_seed(seed)
    heads = {"row": 1, "kv": hkv, "q": hq}[kind]
    m = torch.rand(b, heads, q_len, s, generator=g) < 0.6
    own = torch.arange(q_len)[:, None] + s - q_len == torch.arange(s)  # each query reads its own slot
    return m | own


FEATURES = [dict(softcap=2.0), dict(sinks=True), dict(softcap=1.5, sinks=True)]


def _feat(feat, sinks):
    return dict(softcap=feat.get("softcap"), sinks=sinks if feat.get("sinks") else None)


@pytest.mark.parametrize("feat", FEATURES, ids=["softcap", "sinks", "both"])
@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize("q_len", [1, 3, 7])
@pytest.mark.parametrize("mask", ["none", "causal", "row", "kv", "q"])
@pytest.mark.parametrize("backend", [TorchBackend(), ReferenceBackend()], ids=["torch", "reference"])
def test_backend_equals_the_peers_eager_attention(backend, mask, q_len, hkv, feat):
    q, k, v, sinks = _inputs(hkv, q_len)
    allowed = _mask(mask, 2, 4, hkv, q_len, 11)
    kw = _feat(feat, sinks)
    want = hf_eager(q, k, v, allowed, **kw)
    got = backend.attend(q, k, v, allowed, scaling=SCALE, **kw)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.to(F64), want, atol=2e-5, rtol=2e-5)


def test_the_features_change_the_result():
    """The comparison can fail: without the feature the backend's output is far from the peer's."""
    q, k, v, sinks = _inputs(2, 3)
    for kw in (dict(softcap=2.0), dict(sinks=sinks)):
        want = hf_eager(q, k, v, None, **kw)
        plain = TorchBackend().attend(q, k, v, None, scaling=SCALE)
        assert (plain.to(F64) - want).abs().max() > 1e-2


@pytest.mark.parametrize("feat", FEATURES, ids=["softcap", "sinks", "both"])
def test_torch_backend_in_bf16_and_with_the_additive_step_bias(feat):
    """bf16 (the model's dtype: products in bf16, softmax in float32) is close to float64, and a
    single-token step's mask given as the engine's float bias (0 / -inf) equals the bool mask."""
    q, k, v, sinks = _inputs(2, 1, dtype=torch.bfloat16)
    allowed = _mask("row", 2, 4, 2, 1, 11)
    kw = _feat(feat, sinks)
    want = hf_eager(q, k, v, allowed, **kw)
    got = TorchBackend().attend(q, k, v, allowed, scaling=SCALE, **kw)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.to(F64), want, atol=3e-2, rtol=3e-2)
    bias = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill_(~allowed, -torch.inf)
    torch.testing.assert_close(TorchBackend().attend(q, k, v, bias, scaling=SCALE, **kw), got)


def test_a_large_sink_leaves_little_and_a_very_negative_one_nothing():
    q, k, v, _ = _inputs(2, 1)
    plain = ReferenceBackend().attend(q, k, v, None, scaling=SCALE)
    none = ReferenceBackend().attend(q, k, v, None, scaling=SCALE, sinks=torch.full((4,), -1e4))
    torch.testing.assert_close(none, plain)
    big = ReferenceBackend().attend(q, k, v, None, scaling=SCALE, sinks=torch.full((4,), 60.0))
    assert big.abs().max() < 1e-6


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "2"])
def test_a_bad_softcap_is_refused(bad):
    q, k, v, _ = _inputs(2, 1)
    for backend in (TorchBackend(), ReferenceBackend()):
        with pytest.raises(ValueError, match="softcap: expected None or a positive finite float"):
            backend.attend(q, k, v, None, scaling=SCALE, softcap=bad)


def test_sinks_of_the_wrong_shape_are_refused():
    q, k, v, _ = _inputs(2, 1)
    for backend in (TorchBackend(), ReferenceBackend()):
        with pytest.raises(ValueError, match=r"sinks: expected a \[4\] tensor .* got \(2,\)"):
            backend.attend(q, k, v, None, scaling=SCALE, sinks=torch.zeros(2))


# -- the paged path (CPU stand-in for FlashInfer's paged decode) ------------------------------------
def test_apply_sinks_is_the_sink_softmax():
    """out · sigmoid(lse − sink) equals the softmax with the sink column, per request and head."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4, 9, generator=g, dtype=F64) * 3
    v = torch.randn(6, 9, 5, generator=g, dtype=F64)
    sinks = torch.randn(8, generator=g, dtype=F64)  # heads=2, G=4: query head h·G + g
    out = torch.softmax(logits, -1) @ v
    got = apply_sinks(out, torch.logsumexp(logits, -1), sinks, heads=2)
    col = sinks.reshape(1, 2, 4, 1).expand(3, 2, 4, 1).reshape(6, 4, 1)
    want = torch.softmax(torch.cat([logits, col], -1), -1)[..., :-1] @ v
    torch.testing.assert_close(got.to(F64), want, atol=1e-6, rtol=1e-6)


def test_paged_reference_kernel_soft_caps_its_logits_and_lse():
    g = torch.Generator().manual_seed(4)
    q, kp, vp = torch.randn(2, 3, 8, generator=g) * 3, torch.randn(10, 1, 8, generator=g) * 3, torch.randn(10, 1, 8, generator=g)
    from sparsecorr.decoding.backends.paging import page_table_from_keep
    table = page_table_from_keep(torch.arange(5).reshape(1, 1, 5).expand(1, 2, 5).contiguous(),
                                 torch.ones(1, 2, 5, dtype=torch.bool), slots=5)
    out, lse = paged_attention_reference(q, kp, vp, table, scale=SCALE, softcap=1.0)
    logits = torch.tanh(SCALE * torch.einsum("rgd,rsd->rgs", q, kp.reshape(2, 5, 8)))  # cap 1
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ vp.reshape(2, 5, 8))


def _paged_step(backend, lengths, *, hkv, hq, d, cap_slots, page_size, softcap_at_plan, keep=None):
    backend.begin_step(lengths=lengths, keep=keep, heads=hkv, group=hq // hkv, head_dim=d,
                       pages_per_row=cap_slots // page_size, page_size=page_size, dtype=torch.float32,
                       scale=SCALE, device=torch.device("cpu"), softcap=softcap_at_plan)


@pytest.mark.parametrize("feat", FEATURES, ids=["softcap", "sinks", "both"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("at_plan", [True, False], ids=["planned", "replanned"])
def test_paged_decode_equals_the_peers_eager_attention(feat, page_size, hkv, at_plan):
    """One decode step of rows of different lengths through the paged backend on the CPU kernel
    (tables, plan, LSE, sink rescale) equals HF's eager attention over each row's prefix. The
    soft-cap is passed to ``begin_step`` ("planned") or only to ``decode`` (the step is planned
    again, once)."""
    b, hq, d, cap_slots = 2, 4, 16, 32
    g = torch.Generator().manual_seed(5)
    kp, vp = torch.randn(b, hkv, cap_slots, d, generator=g) * 2, torch.randn(b, hkv, cap_slots, d, generator=g)
    q, sinks = torch.randn(b, hq, 1, d, generator=g) * 2, torch.randn(hq, generator=g) * 2
    lengths = torch.tensor([7, 20])
    kw = _feat(feat, sinks)
    backend = PagedBackend(ReferenceDecodeKernel, name="paged-oracle")
    _paged_step(backend, lengths, hkv=hkv, hq=hq, d=d, cap_slots=cap_slots, page_size=page_size,
                softcap_at_plan=kw["softcap"] if at_plan else None)
    got = backend.decode(q, kp, vp, **kw)
    for i, n in enumerate(lengths.tolist()):
        want = hf_eager(q[i:i + 1], kp[i:i + 1, :, :n], vp[i:i + 1, :, :n], None, **kw)
        torch.testing.assert_close(got[i:i + 1].to(F64), want, atol=2e-5, rtol=2e-5)
    if kw["softcap"] is not None:  # the kernel now holds the soft-cap: the next step plans with it
        _paged_step(backend, lengths, hkv=hkv, hq=hq, d=d, cap_slots=cap_slots, page_size=page_size,
                    softcap_at_plan=None)
        assert backend._dense.softcap == kw["softcap"]


def test_paged_selection_with_sinks_and_softcap():
    """A BlockTopK-style selection (page ids written into the planned sparse table) with both
    features equals HF's eager attention over the selected pages."""
    b, hkv, hq, d, ps, ppr = 1, 2, 4, 8, 16, 4
    g = torch.Generator().manual_seed(6)
    kp, vp = torch.randn(b, hkv, ppr * ps, d, generator=g) * 2, torch.randn(b, hkv, ppr * ps, d, generator=g)
    q, sinks = torch.randn(b, hq, 1, d, generator=g) * 2, torch.randn(hq, generator=g)
    length = 50  # pages 0..3, the last partial (2 tokens)
    pages = torch.tensor([[[3, 1, 0], [3, 2, 1]]])  # rank order: the own (last) page first
    ok = torch.ones(1, 2, 3, dtype=torch.bool)
    backend = PagedBackend(ReferenceDecodeKernel, name="paged-oracle")
    _paged_step(backend, torch.tensor([length]), hkv=hkv, hq=hq, d=d, cap_slots=ppr * ps, page_size=ps,
                softcap_at_plan=3.0, keep=torch.tensor([3]))
    got = backend.decode(q, kp, vp, selected=(pages, ok), softcap=3.0, sinks=sinks)
    for h in range(hkv):
        slots = torch.cat([torch.arange(p * ps, min((p + 1) * ps, length)) for p in sorted(pages[0, h].tolist())])
        qh = q[:, h * 2:(h + 1) * 2]
        want = hf_eager(qh, kp[:, h:h + 1, slots], vp[:, h:h + 1, slots], None, softcap=3.0,
                        sinks=sinks[h * 2:(h + 1) * 2])
        torch.testing.assert_close(got[:, h * 2:(h + 1) * 2].to(F64), want, atol=2e-5, rtol=2e-5)


def test_paged_graph_mode_replans_outside_a_capture_and_refuses_inside(monkeypatch):
    """In CUDA-graph mode a soft-cap missing from ``begin_step`` is planned by the warm-up's first
    decode (into the fixed buffers); during a capture it cannot be, and says so."""
    backend = PagedBackend(ReferenceDecodeKernel, name="paged-oracle")
    backend.enable_graph(batch=1, heads=1, pages_per_row=4, keep_cap=0, group=2, head_dim=8,
                         device=torch.device("cpu"))
    _paged_step(backend, torch.tensor([3]), hkv=1, hq=2, d=8, cap_slots=4, page_size=1, softcap_at_plan=None)
    q, kp = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 4, 8)
    got = backend.decode(q, kp, kp, softcap=2.0)
    torch.testing.assert_close(got.double(), hf_eager(q, kp[:, :, :3], kp[:, :, :3], None, softcap=2.0),
                               atol=2e-5, rtol=2e-5)
    assert backend._dense.softcap == 2.0 and backend._dense.table.indptr is backend._dense.buffers[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match=r"softcap: this CUDA-graph step was planned with softcap=2\.0 .* capture"):
        backend.decode(q, kp, kp, softcap=3.0)


def test_paged_chunks_take_the_features_too():
    """Prefill / multi-token chunks of the paged backend run the torch backend with the features."""
    q, k, v, sinks = _inputs(2, 3)
    backend = PagedBackend(ReferenceDecodeKernel, name="paged-oracle")
    got = backend.attend(q, k, v, causal_lower_right(3, 11), scaling=SCALE, softcap=2.0, sinks=sinks)
    want = softmax_attention(q, k, v, causal_lower_right(3, 11), scaling=SCALE, softcap=2.0, sinks=sinks)
    torch.testing.assert_close(got, want)


# -- FlashInferDecode with a stand-in ``flashinfer``: the soft-cap is planned, the LSE converted ----
def test_flashinfer_decode_plans_the_softcap_and_gives_a_natural_log_lse(monkeypatch):
    import sys
    import types

    from sparsecorr.decoding.backends import flashinfer as fi
    from sparsecorr.decoding.backends.paging import dense_page_table

    planned = []

    class Wrapper:
        def __init__(self, workspace, layout, **kw):
            pass

        def plan(self, *args, **kw):
            planned.append(kw)

        def run(self, q, kv, *, return_lse=False):
            out = torch.ones_like(q)
            return (out, torch.full(q.shape[:2], 3.0)) if return_lse else out  # base 2, as FlashInfer's

    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper))
    monkeypatch.setattr(fi, "flashinfer_status", lambda: (True, "ok"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    kernel = fi.FlashInferDecode(device="cpu", group_size=2, head_dim=8, workspace_bytes=16)
    table = dense_page_table(torch.tensor([3]), heads=1, pages_per_row=4, page_size=1, device="cpu")
    kernel.plan(table, dtype=torch.bfloat16, softcap=30.0)
    kernel.plan(table, dtype=torch.bfloat16)
    assert [kw["logits_soft_cap"] for kw in planned] == [30.0, None]  # None: FlashInfer's "off" (0.0)
    _, lse = kernel.run(torch.zeros(1, 2, 8), torch.zeros(4, 1, 8), torch.zeros(4, 1, 8))
    torch.testing.assert_close(lse, torch.full((1, 2), 3.0 * math.log(2.0)))


# -- ``auto`` and ``"flashinfer"`` by name with the attention features --------------------------------
@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInfer "installed and importable" on a "CUDA" device (as in test_backend_auto.py)."""
    from sparsecorr.decoding.backends import flashinfer as fi

    monkeypatch.setattr(fi, "flashinfer_status", lambda: (True, "ok"))
    monkeypatch.setattr(fi, "require_flashinfer", lambda: None)


@pytest.mark.parametrize(("sinks", "softcap", "reason"), [
    (False, None, None),
    (True, None, None),  # GPT-OSS: the LSE rescale
    (False, 50.0, None),  # Gemma 2: logits_soft_cap
    (True, 30.0, None),
    (False, 0.0, "softcap 0.0"),  # FlashInfer would read 0 as "off"
    (False, -1.0, "softcap -1.0"),
    (False, math.inf, "softcap inf"),
    (False, True, "softcap True"),
    ("yes", None, "sinks='yes'"),
])
def test_flashinfer_supports_the_features(sinks, softcap, reason):
    from sparsecorr.decoding.backends.flashinfer import flashinfer_supports

    got = flashinfer_supports(head_dim=64, dtype=torch.bfloat16, group_size=8, sinks=sinks, softcap=softcap)
    if reason is None:
        assert got is None
    else:
        assert got.startswith("FlashInfer does not support ") and reason in got


def test_auto_takes_flashinfer_for_sinks_and_softcap_and_says_why_not(fake_flashinfer):
    from sparsecorr.decoding.backends import select_backend

    bf16 = torch.bfloat16
    for kw in (dict(sinks=True), dict(softcap=50.0), dict(sinks=True, softcap=50.0)):
        back, label = select_backend("auto", device="cuda", dtype=bf16, head_dim=64, group_size=8, **kw)
        assert back.name == "flashinfer" and label == "flashinfer" and back.paged
    back, label = select_backend("auto", device="cuda", dtype=bf16, head_dim=64, group_size=8, softcap=0.0)
    assert isinstance(back, TorchBackend) and label.startswith("torch (auto: FlashInfer does not support softcap 0.0")
    back, label = select_backend("auto", device="cuda", dtype=bf16, head_dim=16, group_size=2, sinks=True)
    assert isinstance(back, TorchBackend) and "head_dim 16" in label  # the shape still decides first
    back, label = select_backend("auto", device="cuda", dtype=bf16, softcap=-2.0)  # no shape given
    assert isinstance(back, TorchBackend) and "softcap -2.0" in label
    assert select_backend("auto", device="cpu", dtype=bf16, head_dim=64, group_size=8, sinks=True)[1] == "torch"


def test_flashinfer_by_name_refuses_what_it_cannot_compute(fake_flashinfer):
    from sparsecorr.decoding.backends import get_backend

    bf16 = torch.bfloat16
    assert get_backend("flashinfer", device="cuda", dtype=bf16, head_dim=64, group_size=8, sinks=True,
                       softcap=30.0).name == "flashinfer"
    with pytest.raises(ValueError, match=r"backend='flashinfer': FlashInfer does not support softcap 0.0 .*"
                                         r"use backend='torch'"):
        get_backend("flashinfer", device="cuda", dtype=bf16, head_dim=64, group_size=8, softcap=0.0)
    with pytest.raises(ValueError, match="sinks=1"):
        get_backend("flashinfer", device="cuda", dtype=bf16, softcap=None, sinks=1)
