"""One call for every mismatch metric of a batch, with stable names, optionally over ranks.

Names (all detached 0-d float32 tensors; no host synchronisation without a process group):

| name | meaning |
|---|---|
| ``mismatch/tokens`` | valid tokens (mask True, both log-probs finite) |
| ``mismatch/nonfinite_count`` | masked-in tokens dropped because a log-prob was NaN/inf |
| ``mismatch/log_ratio_mean``, ``_abs_mean``, ``_abs_max`` | \\(\\ell_t\\) = old_logp − rollout_logp (clamped ±20) |
| ``mismatch/log_ratio_qXX`` | quantiles of \\(\\ell_t\\) (one per requested level) |
| ``mismatch/ratio_min``, ``mismatch/ratio_max`` | extremes of \\(e^{\\ell_t}\\) |
| ``mismatch/kl_k1_mean``, ``kl_k2_mean``, ``kl_k3_mean`` | KL(sampler ‖ dense) estimators |
| ``mismatch/chi2_mean`` | \\(\\chi^2\\) estimator |
| ``mismatch/acceptance_mean``, ``mismatch/acceptance_qXX`` | when ``acceptance`` is given |

``qXX`` is the level in percent: 0.05 → ``q05``, 0.5 → ``q50``, 0.999 → ``q99.9``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import check_float_tensor, check_mask, check_same_shape, count
from .._checks import finite as _finite
from .._dist import all_gather_varlen, all_reduce_max, all_reduce_min, all_reduce_sum
from .metrics import log_ratio as _log_ratio
from .quantiles import masked_quantile

__all__ = ["mismatch_metrics", "quantile_name"]


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
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    acceptance: torch.Tensor | None = None,
    quantiles: Sequence[float] = (0.01, 0.05, 0.5),
    group: object | None = None,
) -> dict[str, torch.Tensor]:
    """Mismatch metrics of a batch (names in the module docstring).

    Args:
        old_logp: dense log-probs of the sampled tokens.
        rollout_logp: sparse sampler log-probs of the same tokens.
        mask: bool, True = the token counts.
        acceptance: optional per-token acceptance rate (e.g. from
            :func:`~sparsecorr.mismatch.acceptance_rate_topk`).
        quantiles: levels reported for the log-ratio and the acceptance.
        group: optional ``torch.distributed`` process group: every metric is then over the
            union of the ranks' batches (quantiles gather the valid values; exact).

    Shapes:
        old_logp, rollout_logp, mask, acceptance: ``[B, T]`` -> dict of 0-d tensors.
    """
    check_float_tensor("old_logp", old_logp)
    check_float_tensor("rollout_logp", rollout_logp)
    check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp)
    check_mask(mask, old_logp)
    with torch.no_grad():
        finite = _finite(old_logp) & _finite(rollout_logp)
        valid = mask & finite
        lr = _log_ratio(old_logp, rollout_logp, valid)
        n = all_reduce_sum(count(valid), group)
        denom = n.clamp(min=1)

        def mean(x: torch.Tensor) -> torch.Tensor:
            return all_reduce_sum(torch.where(valid, x, 0.0).sum(), group) / denom

        big = torch.tensor(float("inf"), device=lr.device)
        ratio = lr.exp()
        out = {
            "mismatch/tokens": n,
            "mismatch/nonfinite_count": all_reduce_sum(count(mask & ~finite), group),
            "mismatch/log_ratio_mean": mean(lr),
            "mismatch/log_ratio_abs_mean": mean(lr.abs()),
            "mismatch/log_ratio_abs_max": all_reduce_max(torch.where(valid, lr.abs(), 0.0).amax(), group),
            "mismatch/ratio_min": all_reduce_min(torch.where(valid, ratio, big).amin(), group),
            "mismatch/ratio_max": all_reduce_max(torch.where(valid, ratio, -big).amax(), group),
            "mismatch/kl_k1_mean": mean(-lr),
            "mismatch/kl_k2_mean": mean(0.5 * lr.square()),
            "mismatch/kl_k3_mean": mean(torch.expm1(lr) - lr),
            "mismatch/chi2_mean": mean(torch.expm1(lr).square()),
        }
        empty = n == 0
        for key in ("mismatch/ratio_min", "mismatch/ratio_max"):
            out[key] = torch.where(empty, float("nan"), out[key])
        if quantiles:
            for q, v in zip(quantiles, _quantiles(lr, valid, quantiles, group)):
                out[f"mismatch/log_ratio_{quantile_name(q)}"] = v
        if acceptance is not None:
            check_float_tensor("acceptance", acceptance)
            check_same_shape(old_logp=old_logp, acceptance=acceptance)
            acc_valid = valid & _finite(acceptance)
            acc = acceptance.float()
            n_acc = all_reduce_sum(count(acc_valid), group)
            out["mismatch/acceptance_mean"] = all_reduce_sum(
                torch.where(acc_valid, acc, 0.0).sum(), group) / n_acc.clamp(min=1)
            if quantiles:
                for q, v in zip(quantiles, _quantiles(acc, acc_valid, quantiles, group)):
                    out[f"mismatch/acceptance_{quantile_name(q)}"] = v
    return {k: v.detach().float().reshape(()) for k, v in out.items()}
