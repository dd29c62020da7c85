"""The family matrix (issue #52), driven by the one table of `tests.unit.decoding.families`.

For every served family: greedy ``Dense()`` decoding equals HF ``generate`` (tokens) and HF's own
forward over prompt + response (log-probs), sliding windows, sinks and soft-capping included;
every registered policy runs with finite log-probs. On the hybrid families the sliding layers
attend exactly their window (the slots a recording backend sees per layer and step). The refused
families raise a ``ValueError`` naming the feature before any forward. The default suite runs
dense-vs-HF for every family and the policies on a few; the whole matrix is ``slow``.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.bias import CausalBias

from sparsecorr.decoding import RKV, Dense, generate
from sparsecorr.decoding.backends import PagedBackend, ReferenceDecodeKernel, TorchBackend
from sparsecorr.decoding.policies import POLICIES
from tests.unit.decoding.families import HYBRID, REFUSED, SERVED, WINDOW, build

PROMPT, NEW = 6, 12  # prompt + decode = 18 > WINDOW: the sliding layers' ring wraps
#: small settings of the built-in policies (budget 8 < the context, so they evict / select)
SMALL = {"streaming_llm": dict(sink=2), "snapkv": dict(window=4, buffer=4), "rkv": dict(window=4, buffer=4),
         "block_topk": dict(page_size=4, dense_layers=1)}
BUILTIN = tuple(name for name, cls in POLICIES.items() if cls.__module__.startswith("sparsecorr."))
#: the families whose policies run in the default suite (the others: slow)
QUICK = {"gemma2", "gpt-oss"}


def _ids(b=2, seed=0):
    return torch.randint(3, 128, (b, PROMPT), generator=torch.Generator().manual_seed(seed))


def _mark(family, quick):
    return pytest.param(family, id=family.name, marks=() if family.name in quick else pytest.mark.slow)


def _full_forward_logp(model, ids, tokens):
    with torch.no_grad():
        logits = model(torch.cat([ids, tokens], 1)).logits[:, ids.shape[1] - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]


def _check_dense_equals_hf(model, backend="torch"):
    ids = _ids()
    out = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=NEW, temperature=0, eos_token_id=2,
                   backend=backend)
    hf = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=2, pad_token_id=0)[:, PROMPT:]
    for row, n in enumerate(out.lengths.tolist()):
        assert torch.equal(hf[row, :n], out.tokens[row, :n]), (row, hf[row], out.tokens[row])
    ref = _full_forward_logp(model, ids, out.tokens)
    torch.testing.assert_close(out.rollout_logp[out.mask], ref[out.mask], atol=1e-4, rtol=0)
    return out


@pytest.mark.parametrize("family", [_mark(f, {f.name for f in SERVED}) for f in SERVED])
def test_dense_greedy_equals_hf(family):
    _check_dense_equals_hf(build(family))


@pytest.mark.parametrize("family", [_mark(f, QUICK) for f in SERVED])
@pytest.mark.parametrize("name", BUILTIN)
def test_every_policy_runs(family, name):
    model = build(family)
    policy = POLICIES[name](**SMALL.get(name, {}))
    out = generate(model, _ids(), policy=policy, budget=None if name == "dense" else 8, max_new_tokens=NEW,
                   temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.mask.any() and torch.isfinite(out.rollout_logp[out.mask]).all()


# -- every backend on the attention variants ----------------------------------------------------------
VARIANTS = [f for f in SERVED if f.softcap is not None or f.sinks]


@pytest.mark.parametrize("family", [_mark(f, {"gpt-oss", "gemma2"}) for f in VARIANTS])
@pytest.mark.parametrize("backend", ["reference", "paged"])
def test_dense_equals_hf_on_every_backend(family, backend):
    """The float32 oracle and the paged path (on the CPU stand-in for FlashInfer's kernel: the
    soft-cap planned, the sinks folded in through its LSE) decode as HF does."""
    model = build(family)
    _check_dense_equals_hf(model, "reference" if backend == "reference" else
                           PagedBackend(ReferenceDecodeKernel, name="paged-oracle"))


# -- hybrid families: the sliding layers attend exactly their window ---------------------------------
class Recorder(TorchBackend):
    """The torch backend, recording how many slots each single-token attention call may read."""

    def __init__(self):
        self.counts: list[torch.Tensor] = []

    def attend(self, query, key, value, allowed, *, scaling, softcap=None, sinks=None):
        if query.shape[2] == 1:
            s = key.shape[2]
            if allowed is None or isinstance(allowed, CausalBias):
                n = torch.full((query.shape[0],), s)
            else:
                ok = allowed if allowed.dtype == torch.bool else allowed == 0
                n = ok.expand(query.shape[0], -1, 1, s)[:, 0, 0].sum(-1)  # row's first KV head
            self.counts.append(n)
        return super().attend(query, key, value, allowed, scaling=scaling, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("family", [_mark(f, {"gpt-oss", "gemma3"}) for f in HYBRID])
@pytest.mark.parametrize("policy", [Dense(), RKV(window=4, buffer=4)], ids=["dense", "rkv"])
def test_sliding_layers_hold_exactly_their_window(family, policy):
    """Decode step t of a row with a P-token prompt attends positions 0..P+t: a sliding layer reads
    exactly min(P + t + 1, WINDOW) slots, whatever the policy does on the full layers."""
    model = build(family)
    layers = model.config.num_hidden_layers
    rec = Recorder()
    out = generate(model, _ids(b=1), policy=policy, budget=None if isinstance(policy, Dense) else 8,
                   max_new_tokens=NEW, temperature=0, backend=rec)
    steps = len(rec.counts) // layers
    assert steps == int(out.lengths[0]) - 1 and len(rec.counts) == steps * layers
    for t in range(steps):
        ctx = PROMPT + t + 1
        for layer in family.sliding:
            assert int(rec.counts[t * layers + layer][0]) == min(ctx, WINDOW), (t, layer)
        for layer in set(range(layers)) - set(family.sliding):
            n = int(rec.counts[t * layers + layer][0])
            assert n == ctx if isinstance(policy, Dense) else n <= 8 + 4 + 1, (t, layer, n)


# -- refused families -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", [pytest.param(f, id=f.name) for f in REFUSED])
def test_refused_before_any_forward(family):
    model = build(family)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=family.refused) as err:
        generate(model, _ids(), policy=Dense(), budget=None, max_new_tokens=2, temperature=0)
    assert model.config.model_type in str(err.value) and calls == []


@pytest.mark.parametrize("family", [_mark(f, {"gpt-oss", "gemma2"}) for f in VARIANTS])
def test_graph_step_on_the_paged_path(family, cpu_graphs):
    """The CUDA-graph decode step (its CPU stand-in) on the paged oracle: fixed table buffers,
    the soft-cap planned before the capture, the sink rescale inside the step; = HF."""
    model = build(family)
    ids = _ids()
    out = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=NEW, temperature=0, eos_token_id=2,
                   backend=PagedBackend(ReferenceDecodeKernel, name="paged-oracle"), cuda_graph=True, fused=False)
    assert out.meta["cuda_graph"] == "on" and out.meta["graph_captures"] >= 1, out.meta
    hf = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=2, pad_token_id=0)[:, PROMPT:]
    for row, n in enumerate(out.lengths.tolist()):
        assert torch.equal(hf[row, :n], out.tokens[row, :n])


@pytest.mark.parametrize("name", ["gpt-oss", "gemma2", "gemma3"])
def test_generate_tells_auto_the_family_features(name, monkeypatch):
    """``generate`` hands ``select_backend`` the model's sinks / soft-cap (GPT-OSS, Gemma 2), and
    nothing for a family without them; a fake-CUDA, fake-installed FlashInfer then keeps
    FlashInfer for them (its kernels compute both) at a head dim it is built for."""
    import importlib

    from sparsecorr.decoding.backends import flashinfer as fi
    from sparsecorr.decoding.backends import select_backend
    from tests.unit.decoding.families import family

    gen = importlib.import_module("sparsecorr.decoding.generate")
    seen = []
    real = gen.select_backend
    monkeypatch.setattr(gen, "select_backend", lambda name, **kw: seen.append(kw) or real(name, **kw))
    fam = family(name)
    generate(build(fam), _ids(b=1), policy=Dense(), budget=None, max_new_tokens=2, temperature=0)
    want = {**({"sinks": True} if fam.sinks else {}), **({"softcap": fam.softcap} if fam.softcap else {})}
    assert {k: seen[0][k] for k in ("sinks", "softcap") if k in seen[0]} == want
    monkeypatch.setattr(fi, "flashinfer_status", lambda: (True, "ok"))
    monkeypatch.setattr(fi, "require_flashinfer", lambda: None)
    kw = {**seen[0], "device": "cuda", "dtype": torch.bfloat16, "head_dim": 64}
    assert select_backend("auto", **kw)[1] == "flashinfer"
