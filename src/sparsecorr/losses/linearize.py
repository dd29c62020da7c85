r"""A per-token loss with its gradient taken in the forward pass: ``linearized(fn, logp)``.

Every gradient-carrying term of ``sparse_grpo`` (each surrogate, the k3 penalty) is a plain
function ``fn`` of the learner's float32 log-probs \(z\) (``[B, T] -> [B, T]``), written as the
paper's formula with ``torch.where`` on the kept tokens. ``linearized`` evaluates it and its
derivative together with ``torch.func.grad``,

\[
v = \text{fn}(z), \qquad g_{i,t} = \frac{\partial}{\partial z_{i,t}} \sum_{t'} v_{i,t'},
\]

and returns \(v\) whose gradient with respect to ``logp`` is \(g\): the backward pass is one
multiply, \(\partial L/\partial \text{logp}_{i,t} = (\partial L/\partial v_{i,t})\, g_{i,t}\).

Why: with autograd through ``torch.where(kept, ...)``, the backward needs the ``[B, T]`` bool
``kept`` (or what it is made of) and the min-cut partitioner of ``torch.compile`` saves that
bool plus the float inputs of every ``exp`` and ``clamp`` and re-derives the rest in the
compiled backward; here the backward keeps one float per token and nothing else, whatever the
formula. Under ``torch.compile(fullgraph=True)`` ``torch.func.grad`` traces into the forward
graph. In eager mode there is no partitioner, so by default ``linearized`` leaves the gradient
to autograd through the same ``fn`` (no ``torch.func`` dispatch per op, and saved-tensor hooks
keep working); ``in_forward=`` picks either way, and the two are tested equal. Same code and
same numbers on every device.

Exactness: \(g\) is the derivative of a row's *sum*. For a per-token term (\(v_{i,t}\) depends on
\(z_{i,t}\) only: PPO, CISPO, SAPO, VESPO's token factor, k3) it is the exact per-token gradient,
for any reduction of \(v\). For a row-coupled term (GSPO's sequence ratio) it is exact for every
reduction that weights a row's tokens alike: every ``Aggregation`` mode, and the peers'
token-mean / sequence-mean reductions. Second derivatives are not available (the backward
multiplies by a constant \(g\)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["linearized"]


class _WithGradient(torch.autograd.Function):
    """``value`` whose vector-Jacobian product with respect to ``logp`` is ``upstream * grad``."""

    @staticmethod
    def forward(ctx, logp: torch.Tensor, value: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, upstream: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (upstream * grad).to(ctx.logp_dtype), None, None


def linearized(
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, object]], logp: torch.Tensor, *,
    in_forward: bool | None = None,
) -> tuple[torch.Tensor, object]:
    r"""``(value, aux)`` of ``fn(logp.float())``, ``value`` carrying the gradient with respect to
    ``logp`` (see the module docstring).

    Args:
        fn: ``z -> (value, aux)``: the ``[B, T]`` term as a differentiable function of the float32
            log-probs ``z`` and the by-products its metrics read (``aux``: a tensor or a tuple
            of them, ``()`` for none; returned detached).
        logp: the learner's log-probs (any float dtype); no gradient is taken when it does not
            require one or grad mode is off.
        in_forward: take the gradient in the forward pass (``torch.func.grad``, one float per
            token kept for the backward) or leave it to autograd through ``fn`` (eager
            autograd saves what each op needs, and works under saved-tensor hooks such as
            ``torch.autograd.graph.save_on_cpu``, which ``torch.func.grad`` refuses). Default:
            in the forward pass under ``torch.compile``, autograd in eager mode. Both give the
            same gradient (tested: ``tests/unit/losses/test_linearize.py`` and the
            compiled-equals-eager tests).

    Shapes:
        logp ``[B, T]`` -> value ``[B, T]``, aux as ``fn`` returns it.
    """
    z = logp.detach().float()
    if not (logp.requires_grad and torch.is_grad_enabled()):
        with torch.no_grad():
            return fn(z)
    if not (torch.compiler.is_compiling() if in_forward is None else in_forward):
        value, aux = fn(logp.float())
        return value, _detached(aux)

    def row_sums_total(w: torch.Tensor):
        value, aux = fn(w)
        return value.sum(), (value, aux)

    grad, (value, aux) = torch.func.grad(row_sums_total, has_aux=True)(z)  # [B, T], ([B, T], aux)
    return _WithGradient.apply(logp, value, grad), aux


def _detached(aux: object) -> object:
    if isinstance(aux, torch.Tensor):
        return aux.detach()
    return tuple(_detached(a) for a in aux)
