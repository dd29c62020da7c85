"""``linearized``: the value and the gradient taken in the forward pass equal autograd's."""

from __future__ import annotations

import pytest
import torch

from sparsecorr.losses.linearize import linearized


def _inputs(seed: int = 0, b: int = 5, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g)
    kept = torch.rand(b, t, generator=g) > 0.3
    logp[0, 0] = float("nan")  # a non-finite learner token outside the kept ones
    logp[1, 2] = float("inf")
    kept[0, 0] = kept[1, 2] = False
    adv = torch.randn(b, 1, generator=g)
    return logp, old, kept, adv


def _ppo(old, kept, adv):
    def fn(z):
        rho = torch.exp(torch.where(kept, z - old, 0.0).clamp(-20, 20))  # [B, T]
        lo = torch.where(adv >= 0, 0.0, 0.8)
        hi = torch.where(adv >= 0, 1.2, 1e9)
        return torch.where(kept, -adv * torch.clamp(rho, lo, hi), 0.0), rho
    return fn


def _row_coupled(old, kept, adv):
    def fn(z):  # GSPO-like: one ratio per row
        n = kept.sum(1, keepdim=True).clamp(min=1)
        s = torch.exp(torch.where(kept, z - old, 0.0).sum(1, keepdim=True) / n)  # [B, 1]
        return torch.where(kept, -adv * s.clamp(0.9, 1.1), 0.0), s
    return fn


@pytest.mark.parametrize("in_forward", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_per_token_value_and_gradient_equal_autograd_for_any_weighting(seed, in_forward):
    logp, old, kept, adv = _inputs(seed)
    fn = _ppo(old, kept, adv)
    c = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed + 10))  # any weights
    a = logp.clone().requires_grad_()
    value, aux = linearized(fn, a, in_forward=in_forward)
    (value * c).sum().backward()
    b = logp.clone().requires_grad_()
    ref, ref_aux = fn(b)
    (ref * c).sum().backward()
    torch.testing.assert_close(value, ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(aux, ref_aux.detach(), rtol=0, atol=0)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert torch.isfinite(a.grad).all() and not aux.requires_grad


@pytest.mark.parametrize("seed", range(4))
def test_row_coupled_gradient_is_exact_for_row_uniform_weights(seed):
    logp, old, kept, adv = _inputs(seed)
    fn = _row_coupled(old, kept, adv)
    r = torch.rand(logp.shape[0], 1, generator=torch.Generator().manual_seed(seed)) + 0.5  # [B, 1]
    a = logp.clone().requires_grad_()
    (linearized(fn, a, in_forward=True)[0] * r).sum().backward()
    b = logp.clone().requires_grad_()
    (fn(b)[0] * r).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_no_gradient_is_taken_without_one():
    logp, old, kept, adv = _inputs()
    value, _ = linearized(_ppo(old, kept, adv), logp)  # logp does not require a gradient
    assert not value.requires_grad
    with torch.no_grad():
        value, _ = linearized(_ppo(old, kept, adv), logp.clone().requires_grad_())
    assert not value.requires_grad


def test_a_low_precision_logp_gets_its_gradient_in_its_dtype():
    logp, old, kept, adv = _inputs()
    logp = torch.where(torch.isfinite(logp), logp, -1.0)
    a = logp.bfloat16().requires_grad_()
    linearized(_ppo(old, kept, adv), a, in_forward=True)[0].sum().backward()
    b = logp.bfloat16().requires_grad_()
    _ppo(old, kept, adv)(b.float())[0].sum().backward()
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_in_the_forward_pass_the_backward_keeps_one_float_per_token():
    logp, old, kept, adv = _inputs()
    a = logp.clone().requires_grad_()
    value, _ = linearized(_ppo(old, kept, adv), a, in_forward=True)
    saved = value.grad_fn.saved_tensors
    assert [(tuple(x.shape), x.dtype) for x in saved] == [(tuple(logp.shape), torch.float32)]
    assert next(f for f, _ in value.grad_fn.next_functions if f is not None).variable is a


def test_eager_default_works_under_saved_tensor_hooks():
    logp, old, kept, adv = _inputs()
    a = logp.clone().requires_grad_()
    with torch.autograd.graph.save_on_cpu():
        value, _ = linearized(_ppo(old, kept, adv), a)
    value.sum().backward()
    assert torch.isfinite(a.grad).all()
