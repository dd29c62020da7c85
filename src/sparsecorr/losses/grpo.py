r"""``sparse_grpo``: decoupled three-policy PPO / GRPO for sparse rollouts.

Tokens are sampled by the sparse sampler (``rollout_logp``), the dense model with rollout-time
weights gives ``old_logp`` and the learner gives ``logp``. The loss of Sparse-RL (Luo et al.
2026, arXiv 2601.10079) and decoupled PPO (Hilton et al. 2022) runs in three stages:

1. **correction** — the batch's [`Mismatch`][sparsecorr.mismatch.Mismatch] record is built once
   (or passed in) and a correction ``Mismatch -> Correction`` turns it into detached weights
   \(w_t\) on \(\pi_\text{old}/\pi_\text{rollout}\) and a rejection mask;
2. **surrogate** — an object from ``SURROGATES`` (``PPOClip``, ``GSPO``, ``CISPO``, ``SAPO``)
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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

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
from .._masks import count_float, count_rows
from ..correction import Correction
from ..mismatch import (
    LOG_RATIO_CLAMP,
    MetricPlan,
    Mismatch,
    add_mismatch_metrics,
    as_metrics,
    measure,
    mismatch_quantiles,
)
from ..mismatch.summary import DEFAULT_QUANTILES
from .aggregation import Aggregation, scaled_sum
from .learner import learner_raw, learner_side
from .output import LossOutput
from .ppo import SurrogateInputs
from .surrogate import SURROGATES

__all__ = ["METRIC_LEVELS", "KLPenalty", "sparse_grpo"]

METRIC_LEVELS = ("none", "default", "full")


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


@lru_cache(maxsize=16)
def _named(kind: str, name: str | float):
    """The default object for a name (frozen: one instance serves every call)."""
    if kind == "surrogate":
        check_choice("surrogate", name, sorted(SURROGATES))
        return SURROGATES[name]()
    if kind == "aggregation":
        return Aggregation(name)
    return KLPenalty(coef=name)


def _surrogate(surrogate: object) -> Callable:
    if isinstance(surrogate, str):
        return _named("surrogate", surrogate)
    if not callable(surrogate):
        raise ValueError(f"surrogate: expected a name in {sorted(SURROGATES)} or a surrogate object, "
                         f"got {type(surrogate).__name__}")
    return surrogate


def _options(surrogate, aggregation, kl, ref_logp, metrics):
    """Validate every hyperparameter before any tensor work."""
    sur = _surrogate(surrogate)
    if isinstance(aggregation, str):
        aggregation = _named("aggregation", aggregation)
    elif not isinstance(aggregation, Aggregation):
        raise ValueError(f"aggregation: expected a mode name or an Aggregation, got "
                         f"{type(aggregation).__name__}")
    pen = kl if isinstance(kl, KLPenalty) else (
        _named("kl", kl) if type(kl) in (int, float) else KLPenalty(coef=kl))
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
    if mm is None:
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
    if tuple(corr.mask.shape) != tuple(mm.shape):
        raise ValueError(f"correction.mask: expected shape {tuple(mm.shape)}, got {tuple(corr.mask.shape)}")
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
            ``chain(...)``) or an already computed ``Correction``.
        surrogate: a name in ``SURROGATES`` (``"ppo"``, ``"gspo"``, ``"cispo"``, ``"sapo"``) or
            an object, e.g. ``PPOClip(clip_low=0.2, clip_high=0.28)`` (DAPO).
        aggregation: a mode name or an ``Aggregation`` with global normalisers
            (``Aggregation("token-mean", num_tokens=N)`` over data-parallel ranks).
        ref_logp: reference-model log-probs for the k3 KL penalty / metric.
        kl: \(\beta\), or a ``KLPenalty`` (``bias_correction=True`` as TRL).
        metrics: ``"default"`` (cheap, every step), ``"full"`` (adds ratio extremes,
            mismatch quantiles, k2/chi2) or ``"none"`` (nothing computed).
        validate: check shapes and dtypes (set False in a hot loop once inputs are trusted).

    Returns:
        ``LossOutput(loss, token_loss, metrics, mask)``; metrics ``loss/*`` (clip fractions,
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
    if mm is not None and metrics != "none":
        mm.expect_ratio_m1()  # the k3 metric reads rho - 1: the weights are built from it too
    corr = _correction(correction, mm, advantages, logp)
    base = _base_mask(corr, mm, mask)
    plan = None if metrics == "none" else MetricPlan()
    with torch.no_grad():
        if plan is not None:  # the record's and the correction's metrics first: they read its buffers
            _record_metrics(plan, mm, corr, full=metrics == "full")
        # the learner side: logp - old_logp must be finite (covers old_logp without a record);
        # in the record's own buffers when this call built it and no one reads it any more
        own = mm if mismatch is None and metrics != "full" else None
        raw, buf = learner_raw(logp, old_logp, own, None if corr is None else corr.token_weights)
        use_ref = ref_logp is not None and (pen.coef > 0 or metrics != "none")
        kept, kept_f, lr, lr_sum, adv, bad_adv = learner_side(
            raw, base, ref_logp if use_ref else None, advantages, buf)
        # float32, or int64 (promoted where it meets a float); the correction counted its mask
        n = corr.tokens if corr is not None and kept is corr.mask else count_float(kept_f, kept)
        neg_adv = adv.neg() if corr is None or corr.scale is None else adv * -corr.scale.reshape(())
        w = None if corr is None else corr.token_weights
        neg_wa = kept_f.mul_(neg_adv)
        if w is not None:
            neg_wa.mul_(w)
    scales = agg.row_scales(kept, tokens=n)
    out = sur(SurrogateInputs(logp=logp, old_logp=old_logp.detach().float(), log_ratio=lr,
                              kept=kept, advantages=adv, neg_weighted_adv=neg_wa, scales=scales, n=n,
                              metrics=metrics != "none", full_metrics=metrics == "full",
                              log_ratio_sum=lr_sum))
    token_loss, loss = out.token_loss, out.loss
    pg_loss = loss.detach()
    k3 = None
    if use_ref:
        d = torch.where(kept, ref_logp.float() - logp.float(), 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.expm1(d) - d
        if pen.coef > 0:
            term = k3
            if pen.bias_correction:  # k3 times the surrogate's ratio, with its gradient (TRL)
                ratio = out.kl_ratio
                if ratio is None:
                    r = torch.where(kept, logp.float() - old_logp.detach().float(), 0.0)
                    ratio = r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
                term = k3 * ratio
            token_loss = token_loss + pen.coef * term
            loss = loss + pen.coef * scaled_sum(term, scales)
    if metrics == "none":
        return LossOutput(loss=loss, token_loss=token_loss, metrics={}, mask=kept)
    with torch.no_grad():
        m = _metrics(plan, out, mm=mm, corr=corr, kept=kept, n=n, base=base, bad_adv=bad_adv, k3=k3,
                     agg=agg, full=metrics == "full")
        m["loss/pg_loss"] = pg_loss
        m["loss/loss"] = loss.detach()
    # the plan's metrics are detached 0-d float32 already; pg_loss / loss are when logp's dtype is
    return LossOutput(loss=loss, token_loss=token_loss, mask=kept,
                      metrics=m if pg_loss.dtype == torch.float32 and not pg_loss.dim() else as_metrics(m))


def _base_mask(corr: Correction | None, mm: Mismatch | None, mask: torch.Tensor) -> torch.Tensor:
    """The tokens the correction keeps (the record's valid ones without a correction). A
    library correction's mask is a subset of its record's valid tokens; a hand-made one (or one
    from another record) is intersected with them, so a non-finite token never gets through."""
    if corr is None:
        return mask if mm is None else mm.valid
    same = corr.source is not None and corr.source.valid is mm.valid
    return corr.mask if same else corr.mask & mm.valid


def _record_metrics(plan: MetricPlan, mm: Mismatch | None, corr: Correction | None, *,
                    full: bool) -> None:
    """The record's and the correction's metrics, registered before the learner side (which
    may reuse the record's buffers)."""
    if mm is not None:
        plan.ratio("loss/nonfinite_rollout", plan.difference(mm.input_count, mm.valid_count))
        add_mismatch_metrics(plan, mm, full=full)
    if corr is not None:
        corr.add_metrics(plan, full=full)


def _metrics(plan: MetricPlan, out, *, mm, corr, kept, n, base, bad_adv, k3, agg, full) -> dict:
    """Every stage's metrics on one ``MetricPlan`` (the record's and the correction's already
    registered): the loss's per-kept-token means and counts, resolved together in a few
    batched ops."""
    k_n = plan.add(n)
    sums = out.sums()
    if k3 is not None:
        sums["loss/kl_ref_k3_mean"] = k3.detach().sum()
    for name, value in sums.items():
        terms = value if isinstance(value, tuple) else ((value, 1.0),)
        num: dict[int, float] = {}
        for t, c in terms:
            k = k_n if isinstance(t, str) else plan.add(t)
            num[k] = num.get(k, 0.0) + c
        plan.ratio(name, num, k_n)
    n_base = corr.tokens if corr is not None and base is corr.mask else count(base)
    plan.ratio("loss/tokens", {k_n: 1.0})
    plan.ratio("loss/sequences", {plan.add(count_rows(kept)): 1.0})
    plan.ratio("loss/nonfinite_tokens", {plan.add(n_base): 1.0, k_n: -1.0})
    bad, coef, offset = bad_adv()
    plan.ratio("loss/nonfinite_advantage_seqs", {plan.add(bad): coef}, offset=offset)
    if full:
        for name, value in out.extra().items():
            plan.value(name, value)
    fallback = agg.normalizer_fallback()
    if fallback is not None:
        plan.value("loss/normalizer_fallback", fallback)
    m = plan.resolve()
    if full and mm is not None:
        m.update(as_metrics(mismatch_quantiles(mm, DEFAULT_QUANTILES)))
    return m
