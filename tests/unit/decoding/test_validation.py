"""Bad input to the decoding API: each case is a ValueError naming the argument, raised before
any model work; empty batches give well-defined empty results (issue #14)."""

import math

import pytest
import torch

from sparsecorr.decoding import (
    RKV,
    BlockTopK,
    Dense,
    SnapKV,
    StreamingLLM,
    generate,
    get_policy,
    teacher_forced_logprobs,
)
from sparsecorr.decoding.backends import ReferenceBackend, TorchBackend, choose_backend, get_backend
from tests.models import tiny_model

IDS = torch.randint(3, 100, (2, 4), generator=torch.Generator().manual_seed(0))

GENERATE_CASES = [
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature=float("inf"))),
    ("temperature", dict(temperature=-1.0)),
    ("temperature", dict(temperature="hot")),
    ("top_k", dict(top_k=0)),
    ("top_k", dict(top_k=-1)),
    ("top_k", dict(top_k=2.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=float("nan"))),
    ("top_p", dict(top_p=-0.2)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("max_new_tokens", dict(max_new_tokens=2.0)),
    ("max_new_tokens", dict(max_new_tokens=True)),
    ("logprobs_topk", dict(logprobs_topk=-1)),
    ("eos_token_id", dict(eos_token_id="2")),
    ("eos_token_id", dict(eos_token_id=[2, None])),
    ("prefill_chunk", dict(prefill_chunk=0)),
    ("budget", dict(budget=0)),
    ("budget", dict(budget="8")),
    ("budget", dict(budget=-3)),
    ("policy", dict(policy="rkv")),
    ("backend", dict(backend="cuda")),
    ("input_ids", dict(input_ids=IDS + 1000)),  # beyond the vocabulary (was an IndexError)
    ("input_ids", dict(input_ids=-IDS)),
    ("input_ids", dict(input_ids=IDS.float())),
    ("input_ids", dict(input_ids=IDS[0])),
    ("attention_mask", dict(attention_mask=torch.ones(2, 5))),
    ("attention_mask", dict(attention_mask=torch.full((2, 4), 2))),
    ("attention_mask", dict(attention_mask=torch.ones(2, 4, dtype=torch.float32))),
    ("group_size", dict(pruner=object())),
    ("cuda_graph", dict(cuda_graph=True)),  # the model is on the CPU
    ("cuda_graph", dict(cuda_graph="yes")),
]


class _Bad:
    def budget_at(self, c):
        return 0


@pytest.mark.parametrize("name,kwargs", GENERATE_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(GENERATE_CASES)])
def test_generate_bad_arguments_name_the_argument(name, kwargs, monkeypatch):
    model = tiny_model("qwen3")
    calls = []
    monkeypatch.setattr(model.model, "forward", lambda *a, **k: calls.append(1))  # no model work
    args = dict(input_ids=IDS, policy=RKV(), budget=8, max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{name}"):
        generate(model, **args)
    assert not calls


def test_schedule_budgets_are_checked():
    with pytest.raises(ValueError, match=r"^budget: budget_at must return"):
        generate(tiny_model("qwen3"), IDS, policy=RKV(), budget=_Bad(), max_new_tokens=2)


TF_CASES = [
    ("response_ids", dict(response_ids=torch.zeros(3, 4, dtype=torch.long))),
    ("response_ids", dict(response_ids=torch.full((2, 4), 500))),
    ("response_ids", dict(response_ids=torch.zeros(2, 4))),
    ("response_mask", dict(response_mask=torch.ones(2, 3))),
    ("chunk_size", dict(chunk_size=0)),
    ("top_p", dict(top_p=2.0)),
    ("temperature", dict(temperature=float("nan"))),
]


@pytest.mark.parametrize("name,kwargs", TF_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TF_CASES)])
def test_teacher_forcing_bad_arguments(name, kwargs):
    args = dict(response_ids=torch.zeros(2, 4, dtype=torch.long), policy=Dense(), budget=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{name}"):
        teacher_forced_logprobs(tiny_model("qwen3"), IDS, **args)


POLICY_CASES = [
    ("page_size", lambda: BlockTopK(page_size=0)),  # was a ZeroDivisionError
    ("page_size", lambda: BlockTopK(page_size=2.0)),
    ("keep_first_pages", lambda: BlockTopK(keep_first_pages=-1)),
    ("keep_last_pages", lambda: BlockTopK(keep_last_pages=0)),
    ("dense_layers", lambda: BlockTopK(dense_layers=-1)),
    ("sink", lambda: StreamingLLM(sink=-1)),
    ("window", lambda: StreamingLLM(window=-2)),
    ("buffer", lambda: StreamingLLM(buffer=1.5)),
    ("window", lambda: SnapKV(window=0)),
    ("kernel", lambda: SnapKV(kernel=2)),
    ("kernel", lambda: SnapKV(kernel=True)),
    ("pooling", lambda: SnapKV(pooling="min")),
    ("buffer", lambda: SnapKV(buffer=-1)),
    ("mix", lambda: RKV(mix=1.5)),
    ("mix", lambda: RKV(mix=float("nan"))),
    ("mix", lambda: RKV(mix="0.1")),
    ("sink", lambda: RKV(sink=-1)),
    ("window", lambda: RKV(window=0)),
    ("name", lambda: get_policy("h2o")),
    ("name", lambda: get_policy(None)),
    ("kwargs", lambda: get_policy("rkv", budget=3)),
    ("window", lambda: get_policy("rkv", window=0)),
]


@pytest.mark.parametrize("name,make", POLICY_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(POLICY_CASES)])
def test_policy_bad_arguments(name, make):
    with pytest.raises(ValueError, match=rf"^{name}"):
        make()


def test_empty_batches_give_empty_results():
    model = tiny_model("qwen3")
    empty = generate(model, IDS[:0], policy=RKV(), budget=8, max_new_tokens=5)
    assert empty.tokens.shape == (0, 5) and empty.topk_logp.shape == (0, 5, 20) and empty.finish_reason == ()
    no_prompt = generate(model, IDS[:, :0], policy=Dense(), budget=None, max_new_tokens=3)
    assert no_prompt.tokens.shape == (2, 3) and not no_prompt.mask.any()
    assert no_prompt.finish_reason == ("empty", "empty") and no_prompt.lengths.tolist() == [0, 0]
    # one row without a prompt token in a batch: that row is blank, the other decodes as alone
    am = torch.ones_like(IDS)
    am[1] = 0
    mixed = generate(model, IDS, am, policy=RKV(window=2, buffer=2), budget=4, max_new_tokens=6, temperature=0)
    alone = generate(model, IDS[:1], policy=RKV(window=2, buffer=2), budget=4, max_new_tokens=6, temperature=0)
    assert torch.equal(mixed.tokens[0], alone.tokens[0]) and mixed.finish_reason == ("length", "empty")
    assert mixed.prompt_lengths.tolist() == [4, 0] and not mixed.mask[1].any()
    tf = teacher_forced_logprobs(model, IDS, torch.zeros(2, 0, dtype=torch.long), policy=Dense(), budget=None)
    assert tf.rollout_logp.shape == (2, 0)
    for t in (empty, no_prompt, mixed, tf):
        assert all(math.isfinite(float(x)) for x in t.rollout_logp.flatten())


def test_backend_choice():
    assert choose_backend("auto", device="cpu", flashinfer_ok=True) == "torch"
    assert choose_backend("auto", device="cuda", flashinfer_ok=True) == "flashinfer"
    assert choose_backend("auto", device="cuda", flashinfer_ok=False) == "torch"
    assert choose_backend("reference", device="cuda", flashinfer_ok=True) == "reference"
    assert isinstance(get_backend("auto"), TorchBackend) and isinstance(get_backend("reference"), ReferenceBackend)
    custom = ReferenceBackend()
    assert get_backend(custom) is custom
    with pytest.raises(ValueError, match=r"^backend"):
        choose_backend("vllm", device="cpu", flashinfer_ok=True)
