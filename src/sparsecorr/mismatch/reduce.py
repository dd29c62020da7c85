r"""Metrics as data: every stage returns a ``dict[str, Tensor]`` of 0-d sums and counts, and
[`reduce_metrics`][sparsecorr.mismatch.reduce_metrics] turns it into the reported metrics.

The keys of a sums dict follow one convention:

| key | value | reported as |
|---|---|---|
| ``name`` alone | a 0-d sum or count | itself (summed over ranks) |
| ``name`` and ``name#n`` | a sum and its count | ``sum / count`` (0 when the count is 0) |
| ``name#max`` and ``name#n`` | a maximum and its count | the maximum (max over ranks; NaN when the count is 0) |
| ``name#min`` and ``name#n`` | a minimum and its count | the minimum (min over ranks; NaN when the count is 0) |

With a process group the sums and counts are stacked into one vector and all-reduced once
(the extremes in one more collective), then divided: a mean over ranks is the ratio of the
global sums, not the mean of per-rank means. Every rank must build the same keys (which
keys exist may depend on options, never on the data).

Example:
    >>> import torch
    >>> from sparsecorr.mismatch import reduce_metrics
    >>> d = {"loss/ratio_mean": torch.tensor(6.0), "loss/ratio_mean#n": torch.tensor(4.0),
    ...      "loss/tokens": torch.tensor(4.0)}
    >>> {k: float(v) for k, v in reduce_metrics(d).items()}
    {'loss/ratio_mean': 1.5, 'loss/tokens': 4.0}
"""

from __future__ import annotations

import torch

from .._dist import all_reduce_max, all_reduce_sum, is_distributed

__all__ = ["reduce_metrics"]

N, MAX, MIN = "#n", "#max", "#min"


def _sum_reduced(d: dict[str, torch.Tensor], group: object | None) -> dict[str, torch.Tensor]:
    keys = [k for k in d if not (k.endswith(MAX) or k.endswith(MIN))]
    if not is_distributed(group) or not keys:
        return {k: d[k].detach().reshape(()).float() for k in keys}

    total = all_reduce_sum(torch.stack([d[k].detach().reshape(()).float() for k in keys]), group)
    return dict(zip(keys, total.unbind()))


def _ext_reduced(d: dict[str, torch.Tensor], group: object | None) -> dict[str, torch.Tensor]:
    """The extremes, max-reduced over ranks (minimums negated); a rank without tokens (its
    ``#n`` is 0) contributes ``-inf``."""
    keys = [k for k in d if k.endswith(MAX) or k.endswith(MIN)]
    if not is_distributed(group) or not keys:
        return {k: d[k].detach().reshape(()).float() for k in keys}
    signs = [1.0 if k.endswith(MAX) else -1.0 for k in keys]
    vals = torch.stack([
        torch.where(d[k[: -len(MAX)] + N] > 0, s * d[k].detach().reshape(()).float(), float("-inf"))
        for k, s in zip(keys, signs)])
    vals = all_reduce_max(vals, group)
    return {k: s * v for k, s, v in zip(keys, signs, vals.unbind())}


def reduce_metrics(d: dict[str, torch.Tensor], group: object | None = None) -> dict[str, torch.Tensor]:
    """The reported metrics of a sums dict (conventions in the module docstring): detached 0-d
    float32 tensors, no host synchronisation without a process group.

    Args:
        d: the sums and counts of one or more stages (merge them with ``{**a, **b}``).
        group: optional ``torch.distributed`` process group: every sum and count is summed
            over its ranks in one all-reduce before dividing.
    """
    sums, ext = _sum_reduced(d, group), _ext_reduced(d, group)
    out: dict[str, torch.Tensor] = {}
    for key in d:
        if key.endswith(N):
            continue
        if key.endswith(MAX) or key.endswith(MIN):
            name = key[: -len(MAX)]
            v = torch.where(sums[name + N] > 0, ext[key], float("nan"))
        elif key + N in d:
            name, v = key, sums[key] / sums[key + N].clamp(min=1e-30)
        else:
            name, v = key, sums[key]
        out[name] = v.detach().reshape(()).float()
    return out
