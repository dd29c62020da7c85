r"""``sparse_grpo``: decoupled three-policy PPO / GRPO for sparse rollouts.

Tokens are sampled by the sparse sampler (``rollout_logp``), the dense model with rollout-time
weights gives ``old_logp`` and the learner gives ``logp``. The loss of Sparse-RL (Luo et al.
2026, arXiv 2601.10079) and decoupled PPO (Hilton et al. 2022) runs in three stages:

1. **correction** — the batch's [`Mismatch`][sparsecorr.mismatch.Mismatch] record is built once
   (or passed in) and a correction ``Mismatch -> Correction`` turns it into detached weights
   \(w_t\) on \(\pi_\text{old}/\pi_\text{rollout}\) and a rejection mask;
2. **surrogate** — an object from ``SURROGATES`` (``PPOClip``, ``GSPO``, ``CISPO``, ``SAPO``, ``VESPO``)
   gives the per-token loss, e.g. for PPO
   \(\ell_t = -w_t \min(\rho_t A, \mathrm{clip}(\rho_t, 1-\varepsilon_l, 1+\varepsilon_h) A)\)
   with \(\rho_t = \pi_\theta/\pi_\text{old}\);
3. **aggregation** — an [`Aggregation`][sparsecorr.losses.Aggregation] turns it into a scalar,
   plus \(\beta\, k_3(\text{ref}\,\|\,\theta)_t\) on kept tokens (``kl``), \(k_3 = e^{d} - d - 1\),
   \(d = \text{ref\_logp} - \text{logp}\) (Schulman 2020).

Tokens the correction rejects leave both the numerator and the denominator. A token whose
``logp``, ``old_logp``, ``rollout_logp`` or (with a KL term) ``ref_logp`` is NaN/±inf, or a row
whose advantage is, leaves the loss and is counted (``loss/nonfinite_tokens``,
``loss/nonfinite_advantage_seqs``); an empty batch gives a 0 loss with a 0 gradient.

The whole call is plain tensor code: no host read, no device branch, no control flow on tensor
values, nothing cached between calls. ``torch.compile(sparse_grpo, fullgraph=True)`` traces it
in one graph and equals eager (tested over every preset, surrogate and aggregation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._checks import (
    check_advantages,
    check_choice,
    check_float_tensor,
    check_mask,
    check_number,
    check_same_shape,
    count,
)
from .._masks import and_rows, count_rows, row_any, rows_count, rows_total, total
from .._ratio import clamp_log_ratio
from ..correction import Correction
from ..mismatch import Mismatch, measure, mismatch_quantiles, reduce_metrics
from ..mismatch.summary import DEFAULT_QUANTILES, mismatch_sums
from .aggregation import Aggregation, scaled_sum
from .linearize import linearized
from .output import LossOutput
from .ppo import SurrogateInputs
from .surrogate import SURROGATES

__all__ = ["METRIC_LEVELS", "KLPenalty", "sparse_grpo"]

METRIC_LEVELS = ("none", "loss", "default", "full")


@dataclass(frozen=True)
class KLPenalty:
    r"""The k3 penalty to a reference model, \(\beta\,k_3\) per kept token (not IS-weighted).

    Attributes:
        coef: \(\beta\) (Sparse-RL: 1e-4; TRL ``beta``).
        bias_correction: multiply each token's \(k_3\) by the surrogate's importance ratio
            (with its gradient: \(\rho_t\) per token, GSPO's sequence ratio \(s_i\)), as TRL's
            ``use_bias_correction_kl`` does: the tokens were sampled from \(\pi_\text{old}\),
            not \(\pi_\theta\).
    """

    coef: float = 0.0
    bias_correction: bool = False

    def __post_init__(self) -> None:
        check_number("kl", self.coef, low=0)


def _surrogate(surrogate: object) -> Callable:
    if isinstance(surrogate, str):
        check_choice("surrogate", surrogate, sorted(SURROGATES))
        return SURROGATES[surrogate]()
    if not callable(surrogate):
        raise ValueError(f"surrogate: expected a name in {sorted(SURROGATES)} or a surrogate object, "
                         f"got {type(surrogate).__name__}")
    return surrogate


def _options(surrogate, aggregation, kl, ref_logp, metrics):
    """Validate every hyperparameter before any tensor work."""
    sur = _surrogate(surrogate)
    if isinstance(aggregation, str):
        aggregation = Aggregation(aggregation)
    elif not isinstance(aggregation, Aggregation):
        raise ValueError(f"aggregation: expected a mode name or an Aggregation, got "
                         f"{type(aggregation).__name__}")
    pen = kl if isinstance(kl, KLPenalty) else KLPenalty(coef=kl)
    if pen.coef > 0 and ref_logp is None:
        raise ValueError(f"ref_logp: expected a [B, T] tensor when kl > 0 (kl={pen.coef!r}), got None")
    check_choice("metrics", metrics, METRIC_LEVELS)
    return sur, aggregation, pen


def _check_inputs(logp, old_logp, advantages, mask, rollout_logp, ref_logp, mm) -> None:
    check_float_tensor("logp", logp, ndim=2)
    check_float_tensor("old_logp", old_logp, ndim=2)
    check_same_shape(logp=logp, old_logp=old_logp, rollout_logp=rollout_logp, ref_logp=ref_logp)
    for name, t in (("rollout_logp", rollout_logp), ("ref_logp", ref_logp)):
        if t is not None:
            check_float_tensor(name, t, ndim=2)
    check_mask(mask, logp)
    check_float_tensor("advantages", advantages)
    check_advantages(advantages, logp)
    b, t = logp.shape
    if mm is not None and tuple(mm.shape) != (b, t):
        raise ValueError(f"mismatch: expected a record of shape {(b, t)}, got {tuple(mm.shape)}")


def _correction(correction, mm: Mismatch | None, advantages, logp) -> Correction | None:
    if correction is None:
        return None
    if mm is None and not isinstance(correction, Correction):
        raise ValueError("rollout_logp: expected the sparse sampler's [B, T] log-probs (or a "
                         "mismatch record) when a correction is given, got None (a correction "
                         "cannot act without them)")
    if isinstance(correction, Correction):
        corr = correction
    elif callable(correction):
        corr = correction(mm.with_context(advantages=advantages, logp=logp, validate=False))
    else:
        raise ValueError(f"correction: expected a callable Mismatch -> Correction or a "
                         f"Correction, got {type(correction).__name__}")
    if not isinstance(corr, Correction):
        raise ValueError(f"correction: expected the callable to return a Correction, got "
                         f"{type(corr).__name__}")
    shape = tuple(logp.shape) if mm is None else tuple(mm.shape)
    if tuple(corr.mask.shape) != shape:
        raise ValueError(f"correction.mask: expected shape {shape}, got {tuple(corr.mask.shape)}")
    return corr


def sparse_grpo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_logp: torch.Tensor | None = None,
    mismatch: Mismatch | None = None,
    correction: Callable | Correction | None = None,
    surrogate: str | Callable = "ppo",
    aggregation: str | Aggregation = "token-mean",
    ref_logp: torch.Tensor | None = None,
    kl: float | KLPenalty = 0.0,
    metrics: str = "default",
    validate: bool = True,
) -> LossOutput:
    r"""Decoupled three-policy PPO/GRPO loss with an optional sparse-rollout correction.

    Without ``rollout_logp`` and ``correction`` this is plain GRPO/DAPO. With both, the
    correction's detached weights \(w_t\) multiply each token's surrogate and its mask removes
    rejected tokens from numerator and denominator. With ``rollout_logp`` but no correction the
    loss is **not reweighted** (the untruncated decoupled weight has unbounded variance): the
    mismatch is only measured (``mismatch/*``) and non-finite rollout tokens are masked and
    counted; pass e.g. ``correction=sparse_rl()`` to act on it.

    A sequence rejected as a whole gets no gradient here; keep it out of its group's statistics
    too by computing the correction first, passing ``valid=correction.sequence_mask`` to
    [`group_advantages`][sparsecorr.losses.group_advantages], then passing that ``Correction``.

    Args:
        logp: learner log-probs of the sampled tokens (carry the gradient).
        old_logp: dense log-probs with the rollout-time weights.
        advantages: per sequence ``[B]`` (or ``[B, 1]``) or per token ``[B, T]``.
        mask: bool, True = the token counts.
        rollout_logp: sparse sampler log-probs (the record is built from them here).
        mismatch: an already built record of ``(old_logp, rollout_logp, mask)`` instead of
            ``rollout_logp`` (build it once per batch and share it across micro-steps).
        correction: a callable ``Mismatch -> Correction`` (``sparse_rl()``, ``tis(cap=2.0)``,
            ``chain(...)``) or an already computed ``Correction`` (which needs no record: it
            carries its mask and weights, e.g. computed once per generation batch).
        surrogate: a name in ``SURROGATES`` (``"ppo"``, ``"gspo"``, ``"cispo"``, ``"sapo"``,
            ``"vespo"``) or
            an object, e.g. ``PPOClip(clip_low=0.2, clip_high=0.28)`` (DAPO).
        aggregation: a mode name or an ``Aggregation`` with global normalisers
            (``Aggregation("token-mean", num_tokens=N)`` over data-parallel ranks).
        ref_logp: reference-model log-probs for the k3 KL penalty / metric.
        kl: \(\beta\), or a ``KLPenalty`` (``bias_correction=True`` as TRL).
        metrics: ``"default"`` (cheap, every step), ``"full"`` (adds ratio extremes,
            mismatch quantiles, k2/chi2), ``"loss"`` (the ``loss/*`` metrics only: the record's
            and the correction's are logged where they were computed, once per generation
            batch) or ``"none"`` (nothing computed).
        validate: check shapes and dtypes (host-side checks of Python attributes only: no
            tensor value is read, so they cost nothing under ``torch.compile``).

    Returns:
        ``LossOutput(loss, token_loss, metrics, mask, ratio, sums, kl)``: ``ratio`` the detached
        importance ratio the surrogate used (``[B, T]``, or ``[B, 1]`` for GSPO), ``kl`` the
        detached per-token penalty term (``None`` when ``kl`` is 0), ``sums`` the
        metrics' 0-d sums and counts (``reduce_metrics(out.sums, group)`` gives the metrics
        over data-parallel ranks); metrics ``loss/*`` (clip fractions,
        ``ratio_mean``, ``ppo_kl_k1_mean``, ``tokens``, ``sequences``, ``kl_ref_k3_mean``,
        non-finite counts, ``pg_loss``, ``loss``), ``correction/*`` and ``mismatch/*``.

    Shapes:
        logp, old_logp, rollout_logp, ref_logp, mask: ``[B, T]``; advantages ``[B]`` or
        ``[B, T]`` -> loss ``[]``, token_loss/mask ``[B, T]``.

    Example:
        >>> import torch
        >>> from sparsecorr.correction import sparse_rl
        >>> from sparsecorr.losses import PPOClip, sparse_grpo
        >>> g = torch.Generator().manual_seed(0)
        >>> roll = -torch.rand(4, 6, generator=g)
        >>> old = roll + 0.05 * torch.randn(4, 6, generator=g)
        >>> logp = old.clone().requires_grad_()
        >>> out = sparse_grpo(logp, old, torch.tensor([1.0, -1.0, 0.5, -0.5]),
        ...                   torch.ones(4, 6, dtype=torch.bool), rollout_logp=roll,
        ...                   correction=sparse_rl(), surrogate=PPOClip(clip_high=0.28))
        >>> out.loss.backward()
        >>> round(float(out.metrics["loss/tokens"]))
        24
    """
    sur, agg, pen = _options(surrogate, aggregation, kl, ref_logp, metrics)
    if mismatch is not None and rollout_logp is not None:
        raise ValueError("mismatch, rollout_logp: expected one of them (the record carries the "
                         "rollout log-probs), got both")
    if validate:
        _check_inputs(logp, old_logp, advantages, mask, rollout_logp, ref_logp, mismatch)
    mm = mismatch if mismatch is not None else (
        measure(old_logp, rollout_logp, mask, validate=False) if rollout_logp is not None else None)
    corr = _correction(correction, mm, advantages, logp)
    use_ref = ref_logp is not None and (pen.coef > 0 or metrics != "none")
    with torch.no_grad():
        # [B, T] token part, [B] bool row part (a veto's) or None: a dropped row leaves the loss
        # by its row scale and every sum by row weights
        base, rows = _base(mask, mm, corr)
        kept, adv, bad_adv_seqs = _learner_side(logp, old_logp, ref_logp if use_ref else None,
                                                advantages, base, rows)
        old = old_logp.detach().float()
        log_ratio = torch.where(kept, logp.detach().float() - old, 0.0)  # [B, T]
        n = count(kept) if rows is None else rows_count(kept, rows)
        w_tok = _token_weights(corr, kept)  # [B, T]
        weights = torch.where(kept, w_tok, 0.0)  # [B, T], before the batch scale
        neg_wa = torch.where(kept, adv.neg() * w_tok, 0.0)  # [B, T]: -w A
        # the batch scale multiplies the scalar loss (weighted_loss), not every token
        w_scale = None if corr is None or corr.scale is None else corr.scale.detach().float().reshape(())
        is_ratio = None if corr is None else (weights if w_scale is None else weights * w_scale)
        loss_mask = kept if rows is None else and_rows(kept, rows)  # [B, T]
    scales = agg.row_scales(loss_mask, tokens=n)  # [B] or [1]
    if rows is not None:
        scales = scales * rows  # [B]: 0 on a dropped row (no loss, no gradient)
    out = sur(SurrogateInputs(logp=logp, old_logp=old, log_ratio=log_ratio, kept=kept, advantages=adv,
                              weights=weights, neg_weighted_adv=neg_wa, scales=scales, n=n,
                              is_ratio=is_ratio, full_metrics=metrics == "full", weight_scale=w_scale,
                              rows=rows))
    token_loss, loss = out.token_loss, out.loss
    pg_loss = loss.detach()
    k3 = kl_term = None
    if use_ref:
        ref = ref_logp.detach().float()

        def k3_of(z: torch.Tensor) -> torch.Tensor:  # k3 of the learner's log-probs z, 0 off kept
            d = clamp_log_ratio(torch.where(kept, ref - z, 0.0))  # [B, T]
            return torch.expm1(d) - d

        def penalty(z: torch.Tensor):
            k3_ = k3_of(z)
            return (k3_ * out.kl_ratio(z) if pen.bias_correction else k3_), k3_  # TRL: k3 times the ratio

        if pen.coef > 0:
            term, k3 = linearized(penalty, logp)  # [B, T] with its gradient, k3 detached
            kl_term = term.detach()
            token_loss = token_loss + pen.coef * term
            loss = loss + pen.coef * scaled_sum(term, scales)
        else:  # the metric only
            with torch.no_grad():
                k3 = k3_of(logp.detach().float())
    if rows is not None:  # the outputs on a dropped row: token loss and KL term 0, ratio 1 (as off kept)
        token_loss = token_loss * rows.reshape(-1, 1)
        kl_term = None if kl_term is None else kl_term * rows.reshape(-1, 1)
    ratio = out.ratio if rows is None else torch.where(rows.reshape(-1, 1), out.ratio, 1.0)
    if metrics == "none":
        return LossOutput(loss=loss, token_loss=token_loss, metrics={}, mask=loss_mask, ratio=ratio,
                          kl=kl_term)
    with torch.no_grad():
        sums = _sums(out, mm=mm, corr=corr, kept=kept, rows=rows, n=n, base=base,
                     bad_adv_seqs=bad_adv_seqs, k3=k3, agg=agg, full=metrics == "full",
                     stages=metrics != "loss")
        sums["loss/pg_loss"] = pg_loss.float()
        sums["loss/loss"] = loss.detach().float()
        m = reduce_metrics(sums)
        if metrics == "full" and mm is not None:
            m.update(mismatch_quantiles(mm, DEFAULT_QUANTILES))
    return LossOutput(loss=loss, token_loss=token_loss, mask=loss_mask, metrics=m, ratio=ratio, sums=sums,
                      kl=kl_term)


def _base(mask, mm: Mismatch | None, corr: Correction | None):
    """``(tokens, rows)``: the tokens the correction keeps (the record's valid ones without a
    correction) as a ``[B, T]`` token part and a ``[B]`` bool row part (a veto's
    ``Correction.factor``; ``None`` without one). A correction's tokens are intersected with
    its record's valid tokens, so a non-finite token never gets through; a computed
    ``Correction`` given without a record is trusted (the caller built it from one: TRL's
    generation step)."""
    if corr is None:
        return (mask if mm is None else mm.valid), None
    valid = mm.valid if mm is not None else (corr.source.valid if corr.source is not None else None)
    tokens, rows = (corr.mask, None) if corr.factor is None else (corr.factor.token_mask, corr.factor.rows)
    return (tokens if valid is None else tokens & valid), rows


def _token_weights(corr: Correction | None, kept: torch.Tensor) -> torch.Tensor:
    """The correction's token weights before its batch scale (of its token part when it has a
    row part), 1 without weights.  ``[B, T]``"""
    if corr is None:
        return kept.float()
    w = corr.token_weights if corr.factor is None else corr.factor.token_weights
    return kept.float() if w is None else w


def _learner_side(logp, old_logp, ref_logp, advantages, base, rows):
    """The loss's tokens (a token part): ``base`` minus those with a non-finite ``logp -
    old_logp`` (or ``ref_logp``) or advantage; the float32 advantages (``[B, 1]`` or
    ``[B, T]``, 0 where non-finite) and the number of rows (of ``rows``, the correction's row
    part, when given) with a non-finite advantage."""
    kept = base & torch.isfinite(logp.detach().float() - old_logp.detach().float())  # [B, T]
    if ref_logp is not None:
        kept = kept & torch.isfinite(ref_logp.detach())
    adv = advantages.detach().float()
    if adv.dim() == 1 or adv.shape[1] == 1:
        adv = adv.reshape(-1, 1)  # [B, 1]
    ok = torch.isfinite(adv)  # [B, 1] or [B, T]
    if adv.shape[1] == 1:  # every row whose advantage is non-finite
        bad = count(~ok)
    else:  # the rows (kept by ``rows``) with a kept token whose advantage is non-finite
        bad_rows = row_any(kept & ~ok)  # [B]
        bad = count(bad_rows if rows is None else bad_rows & rows)
    return kept & ok, torch.where(ok, adv, 0.0), bad


def _sums(out, *, mm, corr, kept, rows, n, base, bad_adv_seqs, k3, agg, full,
          stages) -> dict[str, torch.Tensor]:
    """Every stage's metrics as 0-d sums and counts (``reduce_metrics`` conventions): the
    record's, the correction's and the loss's per-kept-token means and counts."""
    sums: dict[str, torch.Tensor] = {}
    if mm is not None and stages:
        sums["loss/nonfinite_rollout"] = mm.nonfinite
        sums.update(mismatch_sums(mm, full=full))
    if corr is not None and stages:
        sums.update(corr.metric_sums(full=full))
    loss_sums = out.sums()
    if k3 is not None:
        loss_sums["loss/kl_ref_k3_mean"] = total(k3) if rows is None else rows_total(k3, rows)
    for name in list(loss_sums):
        if not name.endswith("#n") and "#" not in name and name + "#n" not in loss_sums:
            loss_sums[name + "#n"] = n  # a per-kept-token mean
    sums.update(loss_sums)
    sums["loss/tokens"] = n
    # row-weighted sums: the row tests wait for no token pass
    sums["loss/sequences"] = count_rows(kept, rows)
    sums["loss/nonfinite_tokens"] = (count(base) if rows is None else rows_count(base, rows)) - n
    sums["loss/nonfinite_advantage_seqs"] = bad_adv_seqs
    fallback = agg.normalizer_fallback()
    if fallback is not None:
        sums["loss/normalizer_fallback"] = fallback
    return sums
