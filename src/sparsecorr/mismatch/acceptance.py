r"""Per-token acceptance rate between the dense and the sparse next-token distributions.

Sparrow (Zhou et al., 2026, arXiv 2606.08446, §2) measures, at every generated position, the
acceptance rate of speculative sampling between the dense distribution \(p\) and the sparse
one \(q\):

\[
\alpha_t = \sum_v \min\big(p_t(v), q_t(v)\big) = 1 - \mathrm{TV}(p_t, q_t) \in [0, 1],
\]

1 exactly when the two distributions agree. Inference engines usually return only the top-k
log-probs (k = 20); summing \(\min(p, q)\) over the tokens present in *both* top-k sets gives a
lower bound of \(\alpha_t\) (every omitted term is \(\ge 0\)):
[`acceptance_rate_topk`][sparsecorr.mismatch.acceptance_rate_topk].
"""

from __future__ import annotations

import torch

from .._checks import check_float_tensor, check_int_tensor, check_same_shape
from .logprobs import _check_logits, _chunks, default_chunk_rows

__all__ = ["acceptance_rate", "acceptance_rate_topk"]


def acceptance_rate(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    r"""Exact \(\alpha_t = \sum_v \min(p_t(v), q_t(v))\) from full logits, chunked over B·T.

    Args:
        p_logits: dense model logits.
        q_logits: sparse sampler logits at the same positions.
        temperature: applied to both before the softmax (finite, > 0).
        chunk_size: rows (of B·T) per chunk, a positive int; default keeps each float32 chunk
            small.

    Returns:
        \(\alpha_t\), NaN at a position where either row of logits holds NaN or +inf (an
        unknown acceptance: quantiles and sketches skip it); empty for B = 0 or T = 0.

    Shapes:
        p_logits, q_logits: ``[B, T, V]`` -> ``[B, T]`` float32 in [0, 1].
    """
    check_float_tensor("p_logits", p_logits)
    check_float_tensor("q_logits", q_logits)
    check_same_shape(p_logits=p_logits, q_logits=q_logits)
    _check_logits(p_logits, temperature, chunk_size)
    v = p_logits.shape[-1]
    p2, q2 = p_logits.reshape(-1, v), q_logits.reshape(-1, v)
    out = torch.empty(p2.shape[0], dtype=torch.float32, device=p_logits.device)
    rows = chunk_size or default_chunk_rows(p2, copies=4)
    for sl in _chunks(p2.shape[0], rows):
        p = torch.softmax(p2[sl].float() / temperature, dim=-1)
        q = torch.softmax(q2[sl].float() / temperature, dim=-1)
        out[sl] = torch.minimum(p, q).sum(-1)
    return out.clamp(0.0, 1.0).reshape(p_logits.shape[:-1])


def acceptance_rate_topk(
    p_logp: torch.Tensor, p_ids: torch.Tensor, q_logp: torch.Tensor, q_ids: torch.Tensor
) -> torch.Tensor:
    r"""Top-k lower bound of \(\alpha_t\): \(\sum_{v \in K_p \cap K_q} \min(p(v), q(v))\).

    Args:
        p_logp: top-k log-probs of the dense model.
        p_ids: their token ids.
        q_logp: top-k log-probs of the sparse sampler (k may differ).
        q_ids: their token ids.

    Returns:
        the bound; NaN at a position where either side's top-k log-probs hold a NaN (an
        unknown acceptance, skipped by quantiles and sketches); ``-inf`` log-probs are
        legitimate (zero probability) and contribute 0. Empty for B = 0 or T = 0.

    Shapes:
        ``[B, T, k_p]`` and ``[B, T, k_q]`` (k >= 1) -> ``[B, T]`` float32 in [0, 1].
    """
    check_float_tensor("p_logp", p_logp)
    check_float_tensor("q_logp", q_logp)
    check_int_tensor("p_ids", p_ids)
    check_int_tensor("q_ids", q_ids)
    check_same_shape(p_logp=p_logp, p_ids=p_ids)
    check_same_shape(q_logp=q_logp, q_ids=q_ids)
    for name, x in (("p_logp", p_logp), ("q_logp", q_logp)):
        if x.dim() < 1 or x.shape[-1] < 1:
            raise ValueError(f"{name}: expected [..., k] with k >= 1, got shape {tuple(x.shape)}")
    if p_logp.shape[:-1] != q_logp.shape[:-1]:
        raise ValueError(
            f"q_logp: expected leading shape {tuple(p_logp.shape[:-1])} of p_logp, "
            f"got {tuple(q_logp.shape[:-1])}"
        )
    p, q = p_logp.float(), q_logp.float()
    unknown = p.isnan().any(-1) | q.isnan().any(-1)
    same = p_ids[..., :, None] == q_ids[..., None, :]  # [..., k_p, k_q]
    q_match = torch.where(same, q.nan_to_num(nan=float("-inf"))[..., None, :], float("-inf")).amax(-1)
    terms = torch.minimum(p.nan_to_num(nan=float("-inf")), q_match).exp()  # exp(-inf) = 0: no match
    alpha = terms.sum(-1).clamp(0.0, 1.0)
    return torch.where(unknown, float("nan"), alpha)
