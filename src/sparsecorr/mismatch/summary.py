r"""Every mismatch metric of a batch from its [`Mismatch`][sparsecorr.mismatch.Mismatch] record,
in a few fused reductions, optionally over ranks.

Names (all detached 0-d float32 tensors; no host synchronisation without a process group):

| name | level | meaning |
|---|---|---|
| ``mismatch/tokens`` | default | valid tokens (mask True, both log-probs finite) |
| ``mismatch/nonfinite_count`` | default | masked-in tokens dropped because a log-prob was NaN/inf |
| ``mismatch/log_ratio_mean``, ``_abs_max`` | default | \\(\\ell_t\\) = old_logp − rollout_logp (clamped ±20) |
| ``mismatch/kl_k1_mean``, ``kl_k3_mean`` | default | KL(sampler ‖ dense) estimators |
| ``mismatch/acceptance_mean`` | default | when the record carries ``acceptance`` |
| ``mismatch/log_ratio_abs_mean`` | full | mean \\(|\\ell_t|\\) |
| ``mismatch/ratio_min``, ``mismatch/ratio_max`` | full | extremes of \\(e^{\\ell_t}\\) (NaN when no token) |
| ``mismatch/kl_k2_mean``, ``mismatch/chi2_mean`` | full | \\(k_2\\) and the \\(\\chi^2\\) estimator |
| ``mismatch/log_ratio_qXX``, ``mismatch/acceptance_qXX`` | full | quantiles (each sorts the batch) |

``qXX`` is the level in percent: 0.05 → ``q05``, 0.5 → ``q50``, 0.999 → ``q99.9``. Means are
sums over valid tokens divided by their count; with \\(e_t = e^{\\ell_t} - 1\\) (0 outside the
valid tokens) \\(\\bar k_3 = (\\sum e_t - \\sum \\ell_t)/n\\) and \\(\\overline{\\chi^2} = \\sum e_t^2/n\\).
A rank with an empty shard takes part in every collective, so ranks stay in step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import check_choice, count, finite
from .._dist import all_gather_varlen
from .._masks import total
from .plan import MetricPlan
from .quantiles import masked_quantile
from .record import Mismatch, _extremes, measure
from .reduce import reduce_metrics

__all__ = ["LEVELS", "add_mismatch_metrics", "as_metrics", "mismatch_metrics", "mismatch_quantiles",
           "mismatch_sums", "quantile_name"]

LEVELS = ("default", "full")
DEFAULT_QUANTILES = (0.01, 0.05, 0.5)


def as_metrics(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached 0-d float32 tensors (a value already in that form is returned as is: no op)."""
    out = {}
    for k, v in values.items():
        if v.requires_grad or v.dtype != torch.float32 or v.dim() != 0:
            v = v.detach().float().reshape(())
        out[k] = v
    return out


def quantile_name(q: float) -> str:
    """``0.05 -> 'q05'``, ``0.5 -> 'q50'``, ``0.999 -> 'q99.9'``."""
    s = f"{round(q * 100, 6):g}"
    return "q" + (s.zfill(2) if "." not in s else s.zfill(len(s) + max(0, 2 - s.index("."))))


def _quantiles(x: torch.Tensor, valid: torch.Tensor, qs: Sequence[float], group) -> torch.Tensor:
    if group is None:
        return masked_quantile(x, valid, list(qs))
    vals = all_gather_varlen(x[valid].float(), group)
    return masked_quantile(vals, torch.ones_like(vals, dtype=torch.bool), list(qs))


def mismatch_metrics(
    mismatch: Mismatch | torch.Tensor,
    rollout_logp: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    acceptance: torch.Tensor | None = None,
    level: str = "full",
    quantiles: Sequence[float] | None = None,
    group: object | None = None,
) -> dict[str, torch.Tensor]:
    """Mismatch metrics of a batch (names and levels in the module docstring).

    Args:
        mismatch: the batch's ``Mismatch`` record, or ``old_logp`` (then ``rollout_logp`` and
            ``mask`` are required and the record is built here).
        rollout_logp: the sampler's log-probs, only with tensors.
        mask: bool, True = the token counts, only with tensors.
        acceptance: per-token acceptance, only with tensors (a record carries its own).
        level: ``"default"`` (cheap: four reductions, what the loss logs every step) or
            ``"full"`` (everything, quantiles included).
        quantiles: levels of the log-ratio / acceptance quantiles (full level; default
            0.01, 0.05, 0.5). Given with ``level="default"``, they are added to it.
        group: optional ``torch.distributed`` process group: every metric is then over the
            union of the ranks' batches (quantiles gather the valid values; exact).

    Shapes:
        old_logp, rollout_logp, mask, acceptance: ``[B, T]`` -> dict of 0-d tensors.
    """
    check_choice("level", level, LEVELS)
    if isinstance(mismatch, Mismatch):
        if rollout_logp is not None or mask is not None or acceptance is not None:
            raise ValueError("rollout_logp, mask, acceptance: expected None with a Mismatch "
                             "record (it carries them), got tensors")
        mm = mismatch
    else:
        if rollout_logp is None or mask is None:
            raise ValueError("rollout_logp, mask: expected tensors when the first argument is "
                             f"old_logp, got rollout_logp={type(rollout_logp).__name__}, "
                             f"mask={type(mask).__name__}")
        mm = measure(mismatch, rollout_logp, mask, acceptance=acceptance)
    full = level == "full"
    qs = tuple(quantiles) if quantiles is not None else (DEFAULT_QUANTILES if full else ())
    with torch.no_grad():
        out = reduce_metrics(mismatch_sums(mm, full=full), group)
        out.update(mismatch_quantiles(mm, qs, group=group))
    return as_metrics(out)


def mismatch_quantiles(mm: Mismatch, quantiles: Sequence[float], *, group: object | None = None
                       ) -> dict[str, torch.Tensor]:
    """``mismatch/log_ratio_qXX`` (and ``mismatch/acceptance_qXX`` when the record carries an
    acceptance) at the given levels, exact, over the ranks of ``group``."""
    out: dict[str, torch.Tensor] = {}
    if not quantiles:
        return out
    for q, v in zip(quantiles, _quantiles(mm.log_ratio, mm.valid, quantiles, group)):
        out[f"mismatch/log_ratio_{quantile_name(q)}"] = v
    if mm.acceptance is not None:
        acc, ok = _acceptance_valid(mm)
        for q, v in zip(quantiles, _quantiles(acc, ok, quantiles, group)):
            out[f"mismatch/acceptance_{quantile_name(q)}"] = v
    return out


def mismatch_sums(mm: Mismatch, *, full: bool = False) -> dict[str, torch.Tensor]:
    """The record's moment metrics (module table) as 0-d sums and counts (``reduce_metrics``
    conventions): four reductions for the default level, four more for ``full``."""
    lr = mm.log_ratio  # [B, T], 0 off valid
    e = mm.ratio_m1  # [B, T], 0 off valid
    n = mm.tokens
    s_lr, s_e = total(lr), total(e)
    lo, hi = mm.log_ratio_extremes  # 0 off the valid tokens: max(-min, max) is exact
    out = {
        "mismatch/tokens": n,
        "mismatch/nonfinite_count": mm.nonfinite,
        "mismatch/log_ratio_mean": s_lr, "mismatch/log_ratio_mean#n": n,
        "mismatch/kl_k1_mean": -s_lr, "mismatch/kl_k1_mean#n": n,
        "mismatch/kl_k3_mean": s_e - s_lr, "mismatch/kl_k3_mean#n": n,
        # 0 (not NaN) on an empty batch: every entry is 0 there
        "mismatch/log_ratio_abs_max#max": torch.maximum(hi, lo.neg()),
        "mismatch/log_ratio_abs_max#n": torch.ones((), device=lr.device),
    }
    if full:
        mean = s_lr / n.clamp(min=1)  # lies inside [min, max] of the valid values
        r_lo, r_hi = _extremes(torch.where(mm.valid, lr, mean))
        out.update({
            "mismatch/log_ratio_abs_mean": total(lr.abs()), "mismatch/log_ratio_abs_mean#n": n,
            "mismatch/kl_k2_mean": 0.5 * total(lr.square()), "mismatch/kl_k2_mean#n": n,
            "mismatch/chi2_mean": total(e.square()), "mismatch/chi2_mean#n": n,
            "mismatch/ratio_min#min": torch.exp(r_lo), "mismatch/ratio_min#n": n,
            "mismatch/ratio_max#max": torch.exp(r_hi), "mismatch/ratio_max#n": n,
        })
    if mm.acceptance is not None:
        acc, ok = _acceptance_valid(mm)
        out["mismatch/acceptance_mean"] = total(torch.where(ok, acc, 0.0))
        out["mismatch/acceptance_mean#n"] = count(ok)
    return out


def add_mismatch_metrics(plan: MetricPlan, mm: Mismatch, *, full: bool = False) -> None:
    """Register the record's moment metrics (module table) on ``plan``: four reductions for the
    default level, four more for ``full``."""
    lr = mm.log_ratio
    e = mm.ratio_m1  # 0 outside the valid tokens; shared with the corrections' weights
    n = plan.add(mm.valid_count)
    s_lr, s_e = plan.add(mm.log_ratio_sum), plan.add(e.sum())
    plan.ratio("mismatch/tokens", {n: 1.0})
    plan.ratio("mismatch/nonfinite_count", plan.difference(mm.input_count, mm.valid_count))
    plan.ratio("mismatch/log_ratio_mean", {s_lr: 1.0}, n)
    plan.ratio("mismatch/kl_k1_mean", {s_lr: -1.0}, n)
    plan.ratio("mismatch/kl_k3_mean", {s_e: 1.0, s_lr: -1.0}, n)
    # log-ratios are 0 off the valid tokens, so max(-min, max) over all entries is exact
    lo, hi = mm.log_ratio_extremes  # no [B, T] buffer (|lr| would be one)
    abs_max = torch.maximum(hi, lo.neg())
    plan.extreme("mismatch/log_ratio_abs_max", abs_max, empty=n, fill=0.0, local_exact=True)
    if full:
        flat_lr, flat_e = lr.reshape(-1), e.reshape(-1)
        s_abs = plan.add(lr.abs().sum())
        s_k2 = plan.add(torch.dot(flat_lr, flat_lr))
        s_chi = plan.add(torch.dot(flat_e, flat_e))
        plan.ratio("mismatch/log_ratio_abs_mean", {s_abs: 1.0}, n)
        plan.ratio("mismatch/kl_k2_mean", {s_k2: 0.5}, n)
        plan.ratio("mismatch/chi2_mean", {s_chi: 1.0}, n)
        mean = lr.sum() / mm.tokens.clamp(min=1)  # lies inside [min, max] of the valid values
        lo, hi = _extremes(torch.where(mm.valid, lr, mean))
        plan.extreme("mismatch/ratio_min", lo.neg(), empty=n, sign=-1.0, exp=True)
        plan.extreme("mismatch/ratio_max", hi, empty=n, exp=True)
    if mm.acceptance is not None:
        acc, ok = _acceptance_valid(mm)
        k_ok = plan.add(count(ok))
        plan.ratio("mismatch/acceptance_mean", {plan.add(torch.where(ok, acc, 0.0).sum()): 1.0}, k_ok)


def _acceptance_valid(mm: Mismatch) -> tuple[torch.Tensor, torch.Tensor]:
    acc = mm.acceptance.detach().float()
    return acc, mm.valid & finite(acc)
