r"""Log-probabilities from logits without a float32 copy of the whole ``[B, T, V]`` tensor.

A learner's logits are the largest tensor of an RL step (``[B, T, V]``, V ≈ 150k). Turning them
into per-token log-probs with ``log_softmax(logits.float(), -1).gather(...)`` makes one or two
float32 copies of the whole tensor. Here the work is chunked over the B·T rows, so at most one
chunk is ever upcast, and the backward pass of
[`token_logprobs`][sparsecorr.mismatch.token_logprobs] recomputes the softmax chunk by chunk
from the saved logits and per-row log-normalisers instead of keeping activations:

\[
\log \pi(y_t) = z_{t, y_t}/\tau - \operatorname{logsumexp}_v(z_{t,v}/\tau), \qquad
\frac{\partial \log \pi(y_t)}{\partial z_{t,v}} = \frac{\mathbb{1}[v = y_t] - \pi_t(v)}{\tau}.
\]
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .._checks import check_float_tensor, check_int

__all__ = [
    "default_chunk_rows",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "topk_logprobs",
    "truncate_logits",
    "truncated_token_logprobs",
]

_CHUNK_BYTES = 8 * 1024 * 1024  # float32 bytes per chunk copy


def default_chunk_rows(logits2d: torch.Tensor, *, copies: int = 2) -> int:
    """Rows per chunk so ``copies`` float32 temporaries of a chunk stay within ~8 MiB each,
    and never above ~4% of the logits' own size."""
    rows, v = logits2d.shape
    budget = min(_CHUNK_BYTES, max(1, logits2d.numel() * logits2d.element_size() // 25))
    return max(1, min(rows, budget // (4 * v * max(1, copies // 2))))


def _chunks(n: int, rows: int) -> Iterator[slice]:
    for start in range(0, n, rows):
        yield slice(start, min(n, start + rows))


def _check_logits(logits: object, temperature: object, chunk_size: object) -> None:
    """Shared checks: float logits with a non-empty vocab dim, finite temperature > 0,
    ``chunk_size`` None or a positive int (0 or less used to return uninitialised memory)."""
    check_float_tensor("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:  # type: ignore[union-attr]
        raise ValueError(
            f"logits: expected a non-empty last (vocabulary) dim, got shape {tuple(logits.shape)}"  # type: ignore[union-attr]
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        0 < temperature < float("inf")
    ):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
    check_int("chunk_size", chunk_size, low=1, allow_none=True)


def _check(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
           chunk_size: int | None = None, *, validate: bool = True) -> None:
    _check_logits(logits, temperature, chunk_size)
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens: expected an integer tensor, got {getattr(tokens, 'dtype', type(tokens))}")
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"tokens: expected shape {tuple(logits.shape[:-1])} (logits without the vocab dim), "
            f"got {tuple(tokens.shape)}"
        )
    v = logits.shape[-1]
    if validate and tokens.numel() and bool(((tokens < 0) | (tokens >= v)).any()):
        raise ValueError(
            f"tokens: expected ids in [0, {v - 1}] (the vocabulary of logits), got values in "
            f"[{int(tokens.min())}, {int(tokens.max())}]"
        )


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, tokens1d, temperature, rows):  # type: ignore[override]
        n = logits2d.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits2d.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits2d.device)
        for sl in _chunks(n, rows):
            z = logits2d[sl].float()
            if temperature != 1.0:
                z = z / temperature
            lse[sl] = torch.logsumexp(z, dim=-1)
            out[sl] = z.gather(1, tokens1d[sl, None]).squeeze(1) - lse[sl]
        ctx.save_for_backward(logits2d, tokens1d, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits2d, tokens1d, lse = ctx.saved_tensors
        grad = torch.empty_like(logits2d)
        t = ctx.temperature
        for sl in _chunks(logits2d.shape[0], ctx.rows):
            z = logits2d[sl].float()
            if t != 1.0:
                z = z / t
            g = grad_out[sl, None].float()
            chunk = (z - lse[sl, None]).exp_().mul_(-g)
            chunk.scatter_add_(1, tokens1d[sl, None], g)
            grad[sl] = (chunk / t if t != 1.0 else chunk).to(grad.dtype)
        return grad, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Log-prob of ``tokens`` under ``softmax(logits / temperature)``, chunked, differentiable.

    bf16/fp16 logits are accepted; arithmetic is float32 one chunk at a time. A position whose
    logits hold NaN or +inf gets a NaN log-prob (that position only; the loss path masks and
    counts it). Empty inputs (B = 0 or T = 0) give an empty result.

    Args:
        logits: unnormalised scores.
        tokens: ids in ``[0, V)``.
        temperature: finite, > 0.
        chunk_size: rows (of B·T) per chunk, a positive int (default: ~8 MiB per chunk).
        validate: check that every id is inside the vocabulary (one host synchronisation);
            ``False`` skips it for speed.

    Shapes:
        logits: ``[B, T, V]``; tokens: ``[B, T]`` -> ``[B, T]`` float32.
    """
    _check(logits, tokens, temperature, chunk_size, validate=validate)
    v = logits.shape[-1]
    logits2d = logits.reshape(-1, v)
    rows = chunk_size or default_chunk_rows(logits2d)
    out = _TokenLogprob.apply(logits2d, tokens.reshape(-1).long(), float(temperature), rows)
    return out.reshape(tokens.shape)


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(logp, entropy)``: `token_logprobs` plus the entropy
    \(H_t = \operatorname{logsumexp}(z) - \sum_v \pi_t(v) z_v\) (no gradient through the entropy).

    Arguments and checks as in `token_logprobs`.

    Shapes:
        logits: ``[B, T, V]``; tokens: ``[B, T]`` -> two ``[B, T]`` float32.
    """
    logp = token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size,
                          validate=validate)
    v = logits.shape[-1]
    logits2d = logits.detach().reshape(-1, v)
    ent = torch.empty(logits2d.shape[0], dtype=torch.float32, device=logits.device)
    for sl in _chunks(logits2d.shape[0], chunk_size or default_chunk_rows(logits2d, copies=4)):
        z = logits2d[sl].float() / temperature
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        ent[sl] = lse.squeeze(1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, ent.reshape(tokens.shape)


def topk_logprobs(
    logits: torch.Tensor, *, k: int = 20, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probs and their token ids (descending), chunked, no gradient.

    Shapes:
        logits: ``[B, T, V]`` -> values ``[B, T, k]`` float32, indices ``[B, T, k]`` int64.
    """
    _check_logits(logits, temperature, chunk_size)
    v = logits.shape[-1]
    check_int("k", k, low=1, high=v)
    logits2d = logits.detach().reshape(-1, v)
    vals = torch.empty(logits2d.shape[0], k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(logits2d.shape[0], k, dtype=torch.long, device=logits.device)
    for sl in _chunks(logits2d.shape[0], chunk_size or default_chunk_rows(logits2d)):
        z = logits2d[sl].float() / temperature
        top = z.topk(k, dim=-1)
        vals[sl] = top.values - torch.logsumexp(z, dim=-1, keepdim=True)
        idx[sl] = top.indices
    return vals.reshape(*logits.shape[:-1], k), idx.reshape(*logits.shape[:-1], k)


def truncate_logits(z: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set logits outside the top-k / top-p support to -inf (HF / vLLM order: k then p).

    ``z`` is already divided by the temperature. The most likely token is always kept.
    ``top_k`` is None or an int >= 1, ``top_p`` None or a number in (0, 1] (checked on the
    Python values only: no host synchronisation, this runs at every decode step).

    Shapes:
        z: ``[N, V]`` -> ``[N, V]`` (same dtype).
    """
    check_int("top_k", top_k, low=1, allow_none=True)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p: expected a number in (0, 1] or None, got {top_p!r}")
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (a token is dropped when the mass
        # before it already reaches top_p); the most likely token is always kept
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def truncated_token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    r"""Log-probs renormalised over the support a top-k / top-p sampler keeps.

    Inference engines report \(\log \tilde\pi(y) = z_y/\tau - \operatorname{logsumexp}_{v \in S}
    z_v/\tau\) where \(S\) is the kept support (temperature first, then top-k, then top-p, as
    transformers and vLLM do). Comparing such log-probs with full-softmax ones is off by the
    truncated mass (TRL #6789); use this function to reproduce the engine's numbers.
    Tokens outside the support get ``-inf``. No gradient.

    Shapes:
        logits: ``[B, T, V]``; tokens: ``[B, T]`` -> ``[B, T]`` float32.
    """
    _check(logits, tokens, temperature, chunk_size, validate=validate)
    v = logits.shape[-1]
    check_int("top_k", top_k, low=1, allow_none=True)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p: expected a number in (0, 1] or None, got {top_p!r}")
    logits2d = logits.detach().reshape(-1, v)
    tok = tokens.reshape(-1, 1).long()
    out = torch.empty(logits2d.shape[0], dtype=torch.float32, device=logits.device)
    for sl in _chunks(logits2d.shape[0], chunk_size or default_chunk_rows(logits2d, copies=6)):
        z = truncate_logits(logits2d[sl].float() / temperature, top_k, top_p)
        out[sl] = z.gather(1, tok[sl]).squeeze(1) - torch.logsumexp(z, dim=-1)
    return out.reshape(tokens.shape)
