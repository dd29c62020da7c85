"""The fused decode step on the model a trainer trains, and what a failed fused compile or graph
capture leaves behind.

A trainer prepares its model before the rollouts see it: gradient checkpointing on, transformers'
input-require-grads forward hook on the input embeddings (its ``requires_grad_()`` is what
dynamo in torch 2.11 cannot trace), often a peft LoRA wrapper, and train mode that the rollout
switches off. ``generate(..., cuda_graph=True)`` runs here through the eager stand-in runner (the
CUDA-graph step's static-buffer logic and the compiled forward, run eagerly on the CPU), and
must run the fused step for such a model (``meta["fused"] == "on"``), equal the unfused step, hold
no KV pool after it returns with the cycle collector off, and leave the model as it found it.

A fused compile that fails (dynamo's own ``Unsupported``, raised from a frame of its traceback
that keeps it: a reference cycle) must leave no pool alive either, warn once, and not be tried
again for the same model state. Tolerances: those of test_fused.py (log-probs within 2e-5).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import sparsecorr.decoding.fused as fused_mod
import sparsecorr.decoding.graphs as graphs_mod
import sparsecorr.decoding.runner as runner_mod
from sparsecorr._modes import eval_mode
from sparsecorr.decoding import generate
from sparsecorr.decoding.hf import model_state
from sparsecorr.decoding.policies import POLICIES, get_policy
from tests.models import tiny_model, trainer_prepared
from tests.unit.decoding.drive import alive

#: a small instance of every registered policy (the test below checks none is missing)
KWARGS = {"dense": {}, "streaming_llm": dict(sink=1, buffer=2), "snapkv": dict(window=3, buffer=2),
          "rkv": dict(window=3, buffer=2), "block_topk": dict(page_size=2, keep_last_pages=1, dense_layers=1)}


@pytest.fixture(scope="module")
def prepared():
    """A tiny Qwen3 prepared as TRL prepares it (compiled once for every test that uses it)."""
    return trainer_prepared(tiny_model("qwen3", num_layers=2))


def _generate(model, policy, *, fused, steps=5):
    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # ragged
    return generate(model, ids, mask, policy=policy, budget=None if policy.kind == "dense" else 6,
                    max_new_tokens=steps, temperature=0, logprobs_topk=2, prefill_chunk=4, cuda_graph=True,
                    fused=fused)


def _snapshot(model) -> tuple:
    """What the call must leave as it was: hooks and checkpointing flags, every module's mode."""
    return model_state(model), tuple(m.training for m in model.modules())


def _same_outputs(got, ref) -> None:
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.lengths, ref.lengths)
    torch.testing.assert_close(got.rollout_logp, ref.rollout_logp, atol=2e-5, rtol=0)
    torch.testing.assert_close(got.topk_logp, ref.topk_logp, atol=2e-5, rtol=0)


def test_every_registered_policy_is_covered():
    assert set(KWARGS) == set(POLICIES)


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_a_trainer_prepared_model_runs_fused_and_holds_no_pool(name, prepared, cpu_graphs, tracked, no_gc):
    """Fused on for the model TRL trains, equal to the unfused step, and no KV pool alive after
    each of three calls with the cycle collector off; hooks, flags and modes as they were."""
    policy = get_policy(name, **KWARGS[name])
    before = _snapshot(prepared)
    ref = _generate(prepared, policy, fused=False)
    for i in range(3):
        got = _generate(prepared, policy, fused=True)
        assert (got.meta["cuda_graph"], got.meta["fused"]) == ("on", "on"), got.meta["fused"]
        assert alive(tracked) == 0, f"call {i}: {alive(tracked)} engine/pool objects alive"
    _same_outputs(got, ref)
    assert _snapshot(prepared) == before
    assert prepared._require_grads_hook is not None  # the trainer's hook is still there


class _Injected(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise _Injected("injected in the decode loop")


def test_a_model_in_train_mode_runs_fused_and_is_restored(prepared, cpu_graphs, monkeypatch):
    """A model left in train mode (gradient checkpointing active, which would drop the cache
    a decoder layer is given): the rollout's ``eval_mode`` and ``generate`` itself switch it off
    for the call; each module's mode is back afterwards, also when the call raises."""
    policy = get_policy("rkv", **KWARGS["rkv"])
    ref = _generate(prepared, policy, fused=False)
    prepared.train()
    try:
        with eval_mode(prepared):  # what the TRL integration's sparse_rollouts does
            rolled = _generate(prepared, policy, fused=True)
        assert all(m.training for m in prepared.modules())
        prepared.lm_head.eval()  # a mixed state: generate restores it module by module
        before = _snapshot(prepared)
        direct = _generate(prepared, policy, fused=True)
        assert _snapshot(prepared) == before and prepared.training and not prepared.lm_head.training
        for got in (rolled, direct):
            assert got.meta["fused"] == "on"
            _same_outputs(got, ref)
        monkeypatch.setattr(runner_mod, "sample", _raise)  # inside the decode loop (the runner samples)
        with pytest.raises(_Injected):
            _generate(prepared, policy, fused=True)
        assert _snapshot(prepared) == before
    finally:
        prepared.eval()


def test_a_peft_lora_model_runs_fused(cpu_graphs, tracked, no_gc):
    """A LoRA-wrapped model (adapters not zero), prepared as TRL prepares a peft model."""
    peft = pytest.importorskip("peft")
    base = tiny_model("qwen3", num_layers=1, seed=4)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)
    model = trainer_prepared(peft.get_peft_model(base, lora))
    before = _snapshot(model)
    policy = get_policy("rkv", **KWARGS["rkv"])
    ref = _generate(model, policy, fused=False)
    with model.disable_adapter():
        plain = _generate(model, policy, fused=False)
    assert not torch.equal(plain.rollout_logp, ref.rollout_logp)  # the adapter is in the forward
    got = _generate(model, policy, fused=True)
    assert got.meta["fused"] == "on", got.meta["fused"]
    _same_outputs(got, ref)
    assert alive(tracked) == 0 and _snapshot(model) == before


def _count_compile_attempts(monkeypatch) -> list:
    """The fused attempts made: captures asked to compile the step (``fused == "on"``)."""
    attempts = []
    real = graphs_mod.capture_fused

    def counted(make, *, fused):
        attempts.extend([1] if fused == "on" else [])
        return real(make, fused=fused)

    monkeypatch.setattr(graphs_mod, "capture_fused", counted)
    return attempts


def test_dynamos_unsupported_leaves_no_pool_and_is_not_retried(cpu_graphs, tracked, no_gc, monkeypatch):
    """A model piece dynamo refuses under ``fullgraph`` (a graph break in a forward hook of the
    final norm): dynamo's ``Unsupported`` propagates out of a frame that keeps it (a reference
    cycle through the frames that hold the step's pool). The step runs unfused, no pool is
    alive after each call, one warning, the same ``meta["fused"]`` on every call, and the
    compile is attempted once for this model state (not for the state without the hook)."""
    model = tiny_model("qwen3", num_layers=1, seed=5)
    handle = model.model.norm.register_forward_hook(lambda module, args, out: torch._dynamo.graph_break())
    attempts = _count_compile_attempts(monkeypatch)
    policy = get_policy("snapkv", **KWARGS["snapkv"])
    ref = _generate(model, policy, fused=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        outs = []
        for i in range(3):
            outs.append(_generate(model, policy, fused=True))
            assert alive(tracked) == 0, f"call {i}: {alive(tracked)} engine/pool objects alive"
    fused = [o.meta["fused"] for o in outs]
    assert fused[0].startswith("failed: Unsupported") and fused == [fused[0]] * 3
    assert all(o.meta["cuda_graph"] == "on" for o in outs)
    assert len(attempts) == 1  # remembered: the second and third calls do not try again
    assert sum("fused: compiling or capturing" in str(w.message) for w in rec) == 1
    _same_outputs(outs[-1], ref)
    assert fused_mod.fused_status(model) == fused[0]
    handle.remove()  # another model state: the next call tries again
    assert fused_mod.fused_status(model) == "on"


class _CaptureError(RuntimeError):
    pass


class _FailingRunner(graphs_mod.EagerRunner):
    """A runner whose capture fails after its warm-up step, raising an exception that a frame of
    its own traceback keeps (as dynamo's ``compile_wrapper`` keeps ``Unsupported``): a cycle
    through the frame that holds the step (and so the pool)."""

    def __init__(self, fn, **kw):
        super().__init__(fn, **kw)
        try:
            raise _CaptureError("operation not permitted when stream is capturing")
        except _CaptureError as e:
            kept = e
            raise kept from None


def test_a_failed_graph_capture_leaves_no_pool(tracked, no_gc, monkeypatch):
    monkeypatch.setattr(graphs_mod, "CudaGraphRunner", _FailingRunner)
    monkeypatch.setattr(graphs_mod, "check_graph_device", lambda device: None)
    model = tiny_model("qwen3", num_layers=1, seed=6)
    policy = get_policy("dense")
    for i in range(2):
        with pytest.warns(RuntimeWarning, match="cuda_graph: capture failed, decoding eagerly"):
            out = _generate(model, policy, fused=False)
        assert out.meta["cuda_graph"] == "failed: _CaptureError"
        assert alive(tracked) == 0, f"call {i}: {alive(tracked)} engine/pool objects alive"


def test_an_outer_exception_keeps_its_traceback(cpu_graphs, monkeypatch):
    """A failed fused attempt inside the caller's ``except`` block clears its own frames, not
    those of the exception the caller is handling (its traceback is the caller's to re-raise)."""
    def broken(*args):
        raise RuntimeError("inductor: C++ compile failed")

    monkeypatch.setattr(fused_mod, "compiled_forward", lambda: broken)
    model = tiny_model("qwen3", num_layers=1, seed=7)
    try:
        raise KeyError("the caller's")
    except KeyError as outer:
        tb = outer.__traceback__
        with pytest.warns(RuntimeWarning, match="fused: compiling"):
            out = _generate(model, get_policy("dense"), fused=True)
        assert outer.__traceback__ is tb
    assert out.meta["fused"] == "failed: RuntimeError: inductor: C++ compile failed"
