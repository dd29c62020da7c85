import pytest
import torch

from sparsecorr.losses import (
    adapter_parameters,
    dense_mode,
    distill_sparse_loss,
    sparse_adapter,
    sparse_grpo,
)
from sparsecorr.mismatch import token_logprobs
from tests.models import tiny_model

pytest.importorskip("peft")


def _tokens(b=2, t=6, vocab=128, seed=0):
    return torch.randint(3, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _perturb(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_adapter_active_only_outside_dense_mode():
    model = tiny_model("qwen3")
    ids = _tokens()
    with torch.no_grad():
        base = model(ids).logits.clone()
    wrapped = sparse_adapter(model, r=4)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ids).logits, base)  # LoRA B starts at zero
    _perturb(wrapped)
    with torch.no_grad():
        sparse = wrapped(ids).logits
        with dense_mode(wrapped):
            dense = wrapped(ids).logits
        again = wrapped(ids).logits
    torch.testing.assert_close(dense, base)
    assert (sparse - base).abs().max() > 1e-3
    torch.testing.assert_close(again, sparse)


def test_dense_mode_restores_adapter_after_error():
    wrapped = sparse_adapter(tiny_model("llama"), r=2)
    _perturb(wrapped)
    ids = _tokens()
    with torch.no_grad():
        sparse = wrapped(ids).logits
    with pytest.raises(RuntimeError):
        with dense_mode(wrapped):
            raise RuntimeError("boom")
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ids).logits, sparse)


def test_parameters_and_freezing():
    wrapped = sparse_adapter(tiny_model("qwen2"), r=2)
    lora = adapter_parameters(wrapped)
    assert lora and all(p.requires_grad for p in lora)
    base = [p for n, p in wrapped.named_parameters() if "lora_" not in n]
    assert all(p.requires_grad for p in base)  # dense theta stays trainable by default
    frozen = sparse_adapter(tiny_model("qwen2"), r=2, freeze_base=True)
    assert not any(p.requires_grad for n, p in frozen.named_parameters() if "lora_" not in n)


def test_distill_sparse_step_trains_adapter_and_dense_update_skips_it():
    model = sparse_adapter(tiny_model("qwen3"), r=4)
    _perturb(model, seed=1)
    ids = _tokens(b=4, t=8)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    mask = torch.ones_like(targets, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    with torch.no_grad():
        rollout_logp = token_logprobs(model(inputs).logits, targets)
        with dense_mode(model):
            dense_logp = token_logprobs(model(inputs).logits, targets)
    # dense update of theta: the adapter receives no gradient
    with dense_mode(model):
        logp = token_logprobs(model(inputs).logits, targets)
        sparse_grpo(logp, dense_logp, adv, mask, rollout_logp=rollout_logp).loss.backward()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in adapter_parameters(model))
    model.zero_grad(set_to_none=True)
    # adapter update: sparse PPO + lambda * k3
    sparse_logp = token_logprobs(model(inputs).logits, targets)
    out = distill_sparse_loss(sparse_logp, rollout_logp, dense_logp, adv, mask)
    assert out.metrics["distill/kl_k3_mean"] > 0  # the perturbed adapter differs from dense
    out.loss.backward()
    grads = [p.grad for p in adapter_parameters(model)]
    assert all(g is not None for g in grads) and any(g.abs().max() > 0 for g in grads)


def test_dense_mode_requires_peft_model():
    with pytest.raises(ValueError, match="model"):
        with dense_mode(torch.nn.Linear(2, 2)):
            pass


def test_bad_rank():
    with pytest.raises(ValueError, match="r:"):
        sparse_adapter(tiny_model("qwen3"), r=0)


def test_missing_peft_gives_install_hint(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    with pytest.raises(ImportError, match=r"sparsecorr\[peft\]"):
        sparse_adapter(torch.nn.Linear(2, 2))
