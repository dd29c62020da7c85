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
from functools import lru_cache

import torch

from .._checks import check_choice, count
from .._dist import all_gather_varlen, all_reduce_max, all_reduce_sum
from .quantiles import masked_quantile
from .record import Mismatch, measure

__all__ = ["LEVELS", "as_metrics", "mismatch_metrics", "quantile_name"]

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


def _extremes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.numel() == 0:
        z = torch.zeros((), device=x.device)
        return z, z
    return torch.aminmax(x)


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
        out = _moments(mm, full, group)
        if qs:
            for q, v in zip(qs, _quantiles(mm.log_ratio, mm.valid, qs, group)):
                out[f"mismatch/log_ratio_{quantile_name(q)}"] = v
        if mm.acceptance is not None:
            out.update(_acceptance(mm, qs, group))
    return as_metrics(out)


@lru_cache(maxsize=8)
def _combination(full: bool, device: torch.device) -> torch.Tensor:
    """Rows turning the stacked sums into the numerators of the means (one matmul)."""
    # sums: [tokens, nonfinite, sum lr, sum e, (sum |lr|, sum lr^2, sum e^2)]
    rows = [[0, 0, 1, 0], [0, 0, -1, 0], [0, 0, -1, 1]]
    if full:
        rows = [[*r, 0, 0, 0] for r in rows] + [[0] * 4 + [1, 0, 0], [0] * 4 + [0, 0.5, 0],
                                                [0] * 4 + [0, 0, 1]]
    return torch.tensor(rows, dtype=torch.float32, device=device)


def _moments(mm: Mismatch, full: bool, group) -> dict[str, torch.Tensor]:
    """Counts, means and extremes: one stack of sums (one all-reduce), one matmul for the
    means, one stack of extremes (one all-reduce)."""
    lr = mm.log_ratio
    e = torch.expm1(lr)  # 0 outside the valid tokens
    sums = [mm.tokens, mm.nonfinite, lr.sum(), e.sum()]
    lo, hi = _extremes(lr)
    ext = [lo.neg(), hi]
    if full:
        flat_lr, flat_e = lr.reshape(-1), e.reshape(-1)
        sums += [lr.abs().sum(), torch.dot(flat_lr, flat_lr), torch.dot(flat_e, flat_e)]
        mean = sums[2] / mm.tokens.clamp(min=1)  # lies inside [min, max] of the valid values
        vlo, vhi = _extremes(torch.where(mm.valid, lr, mean))
        ext += [vlo.neg(), vhi]
    s = torch.stack(sums)
    x = torch.stack(ext)
    if group is not None:
        s = all_reduce_sum(s, group)
        # a shard without valid tokens must not move the extremes of the others
        x = all_reduce_max(torch.where(mm.tokens > 0, x, float("-inf")), group)
    parts = s.unbind()
    n = parts[0]
    means = (_combination(full, s.device) @ s / n.clamp(min=1)).unbind()
    # single process: log-ratios are 0 off the valid tokens, so max(-min, max) is exact
    abs_max = x[:2].amax() if group is None else torch.where(n > 0, x[:2].amax(), 0.0)
    out = {
        "mismatch/tokens": n,
        "mismatch/nonfinite_count": parts[1],
        "mismatch/log_ratio_mean": means[0],
        "mismatch/log_ratio_abs_max": abs_max,
        "mismatch/kl_k1_mean": means[1],
        "mismatch/kl_k3_mean": means[2].clamp(min=0.0),
    }
    if full:
        nan = torch.full((), float("nan"), device=n.device)
        out.update({
            "mismatch/log_ratio_abs_mean": means[3],
            "mismatch/ratio_min": torch.where(n > 0, (-x[2]).exp(), nan),
            "mismatch/ratio_max": torch.where(n > 0, x[3].exp(), nan),
            "mismatch/kl_k2_mean": means[4],
            "mismatch/chi2_mean": means[5],
        })
    return out


def _acceptance(mm: Mismatch, qs: Sequence[float], group) -> dict[str, torch.Tensor]:
    acc = mm.acceptance.detach().float()
    ok = mm.valid & (acc.abs() < float("inf"))
    total = all_reduce_sum(torch.stack([torch.where(ok, acc, 0.0).sum(), count(ok)]), group)
    out = {"mismatch/acceptance_mean": total[0] / total[1].clamp(min=1)}
    for q, v in zip(qs, _quantiles(acc, ok, qs, group) if qs else ()):
        out[f"mismatch/acceptance_{quantile_name(q)}"] = v
    return out
