r"""Full-vocabulary KL between two ``[B, T, V]`` logit tensors, chunked over the B·T rows.

With \(s = \log\mathrm{softmax}(z^S/\tau)\) (student) and \(t = \log\mathrm{softmax}(z^T/\tau)\)
(teacher, detached), per token

\[
\text{forward: } \mathrm{KL}(T\,\|\,S) = \sum_v e^{t_v}(t_v - s_v), \qquad
\text{reverse: } \mathrm{KL}(S\,\|\,T) = \sum_v e^{s_v}(s_v - t_v),
\]

with gradients with respect to the student logits

\[
\frac{\partial\,\mathrm{KL}(T\|S)}{\partial z^S_v} = \frac{e^{s_v} - e^{t_v}}{\tau}, \qquad
\frac{\partial\,\mathrm{KL}(S\|T)}{\partial z^S_v} = \frac{e^{s_v}\,(s_v - t_v - \mathrm{KL})}{\tau}.
\]

A custom autograd function computes one chunk of rows at a time in float32 and saves only the
(already existing) logits and one float per row; backward recomputes each chunk. No float32
``[B, T, V]`` copy is ever made (only the gradient itself, in the student's dtype, which autograd
needs anyway). No \(\tau^2\) factor is applied (multiply the result if you follow Hinton et al.).
"""

from __future__ import annotations

import torch

from ..._checks import check_choice, check_float_tensor, check_mask
from ...mismatch.logprobs import default_chunk_rows

__all__ = ["kl_from_logits"]

_MIN_ROWS = 16  # below this, per-chunk overhead dominates (small inputs)


def _row_kl(zs: torch.Tensor, zt: torch.Tensor, tau: float, reverse: bool):
    s = torch.log_softmax(zs.float() / tau if tau != 1.0 else zs.float(), dim=-1)
    t = torch.log_softmax(zt.float() / tau if tau != 1.0 else zt.float(), dim=-1)
    if reverse:
        s, t = t, s  # KL(S||T) = sum e^s (s - t): swap roles
    terms = torch.sub(t, s).mul_(t.exp()).masked_fill_(t == float("-inf"), 0.0)  # 0 log 0 = 0
    return terms.sum(-1), (t, s) if reverse else (s, t)


class _KLFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student2d, teacher2d, valid1d, tau, reverse, rows):
        n = student2d.shape[0]
        kl = torch.zeros(n, dtype=torch.float32, device=student2d.device)
        for start in range(0, n, rows):
            sl = slice(start, min(n, start + rows))
            kl[sl] = _row_kl(student2d[sl], teacher2d[sl], tau, reverse)[0]
        kl = torch.where(valid1d, kl, 0.0)
        ctx.save_for_backward(student2d, teacher2d, valid1d, kl)
        ctx.tau, ctx.reverse, ctx.rows = tau, reverse, rows
        return kl

    @staticmethod
    def backward(ctx, grad_out):
        student2d, teacher2d, valid1d, kl = ctx.saved_tensors
        tau, rows = ctx.tau, ctx.rows
        grad = torch.empty_like(student2d)
        g_all = torch.where(valid1d, grad_out.float(), 0.0) / tau
        for start in range(0, student2d.shape[0], rows):
            sl = slice(start, min(student2d.shape[0], start + rows))
            _, (s, t) = _row_kl(student2d[sl], teacher2d[sl], tau, ctx.reverse)
            g = g_all[sl, None]
            if ctx.reverse:
                q = s.exp()
                zero = s == float("-inf")
                chunk = s.sub_(t).sub_(kl[sl, None]).mul_(q).masked_fill_(zero, 0.0)
            else:
                chunk = s.exp_().sub_(t.exp_())
            grad[sl] = torch.where(valid1d[sl, None], chunk.mul_(g), 0.0).to(grad.dtype)
        return grad, None, None, None, None, None


def kl_from_logits(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    direction: str = "forward",
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-token full-vocabulary KL between student and teacher distributions (module formulas).

    Args:
        student_logits: the trained distribution (gradient flows here).
        teacher_logits: the target distribution (treated as a constant).
        mask: bool, True = the token counts; other positions give 0 and no gradient (their
            logits may hold anything, NaN included).
        direction: ``"forward"`` = KL(teacher ‖ student) (mode covering, classic distillation),
            ``"reverse"`` = KL(student ‖ teacher) (mode seeking, on-policy distillation).
        temperature: both logits are divided by \\(\\tau\\) before the softmax.
        chunk_size: rows of ``B·T`` per chunk (default: a few MiB of float32 per chunk, at
            least 16 rows).

    Returns:
        float32 per-token KL, 0 where masked.

    Shapes:
        student_logits, teacher_logits: ``[B, T, V]``; mask: ``[B, T]`` -> ``[B, T]``.
    """
    check_float_tensor("student_logits", student_logits, ndim=3)
    check_float_tensor("teacher_logits", teacher_logits, ndim=3)
    if tuple(teacher_logits.shape) != tuple(student_logits.shape):
        raise ValueError(f"teacher_logits: expected the shape of student_logits "
                         f"{tuple(student_logits.shape)}, got {tuple(teacher_logits.shape)}")
    check_mask(mask, student_logits[..., 0])
    check_choice("direction", direction, ("forward", "reverse"))
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature: expected a number > 0, got {temperature!r}")
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size: expected None or an int > 0, got {chunk_size!r}")
    v = student_logits.shape[-1]
    s2 = student_logits.reshape(-1, v)
    t2 = teacher_logits.detach().reshape(-1, v)
    rows = chunk_size or max(default_chunk_rows(s2, copies=6), min(_MIN_ROWS, s2.shape[0]))
    kl = _KLFromLogits.apply(s2, t2, mask.reshape(-1), float(temperature), direction == "reverse", rows)
    return kl.reshape(mask.shape)
