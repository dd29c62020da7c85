r"""Metrics resolved in a handful of batched ops: ``MetricPlan``.

Every metric of the loss path is either a ratio of sums over tokens (a mean, a fraction, a
count) or an extreme. Computing each with its own arithmetic costs a few tiny tensor ops per
metric (each with a fixed dispatch cost that dominates small batches). A plan collects the 0-d
reductions once (integer counts converted to float32, exact below 2^24), then resolves every
ratio with one float32 ``stack``, one gather of the terms the numerators combine, one
``index_add_`` forming the numerators, one gather of the denominators and one division (no
dense product: a zero coefficient times a sum that overflowed to inf would make every metric
NaN), and every extreme with one stack — whatever the number of metrics. With a process group the sums are
all-reduced in one collective and the extremes in another, on every rank alike (a rank with an
empty shard takes part and contributes nothing).

Example:
    >>> import torch
    >>> from sparsecorr.mismatch import MetricPlan
    >>> plan = MetricPlan()
    >>> n = plan.add(torch.tensor(4.0))
    >>> s = plan.add(torch.tensor(6.0))
    >>> plan.ratio("mean", {s: 1.0}, n)
    >>> plan.ratio("neg_mean", {s: -1.0}, n)
    >>> plan.ratio("count", {n: 1.0})
    >>> {k: float(v) for k, v in plan.resolve().items()}
    {'mean': 1.5, 'neg_mean': -1.5, 'count': 4.0}
"""

from __future__ import annotations

import torch

from .._dist import all_reduce_max, all_reduce_sum

__all__ = ["MetricPlan"]


def _tables(spec: tuple, n_sums: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The numerators' terms of a plan's ``M`` ratios as (sum index, coefficient, ratio index)
    ``[E]`` each, the denominators' sum indices ``[M]`` and the offsets ``[M]`` (index ``K`` is
    the constant 1 appended to the sums)."""
    cols, coefs, rows = [], [], []
    for i, (terms, _, _) in enumerate(spec):
        for k, c in terms:
            cols.append(k)
            coefs.append(c)
            rows.append(i)
    dens = [n_sums if d is None else d for _, d, _ in spec]
    offs = [o for _, _, o in spec]
    return (torch.tensor(cols, dtype=torch.long, device=device),
            torch.tensor(coefs, dtype=torch.float32, device=device),
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(dens, dtype=torch.long, device=device),
            torch.tensor(offs, dtype=torch.float32, device=device))


def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), device=device)


def _extreme_tables(spec: tuple, n_sums: int, device: torch.device):
    """Count indices ``[E]`` (``n_sums``: the constant 1), signs ``[E]`` and fill values ``[E]``."""
    idx = torch.tensor([n_sums if e is None else e for e, _, _ in spec], dtype=torch.long)
    signs = torch.tensor([s for _, s, _ in spec])
    fills = torch.tensor([f for _, _, f in spec])
    return idx.to(device), signs.to(device), fills.to(device)


class MetricPlan:
    """Collects 0-d reductions (``add``) and metrics defined on them (``ratio``, ``extreme``,
    ``value``); ``resolve()`` returns every metric as a detached 0-d float32 tensor. Which sums
    are registered, and in what order, must not depend on the data (a rank's NaNs, an empty
    veto): ``resolve(group)`` all-reduces them as one vector on every rank."""

    def __init__(self) -> None:
        self._sums: list[torch.Tensor] = []
        self._ratios: list[tuple[str, tuple, int | None, float]] = []
        self._extremes: list[tuple[str, torch.Tensor, int | None, float, float]] = []
        self._exp: set[str] = set()
        self._local_exact: set[str] = set()
        self._values: dict[str, torch.Tensor] = {}

    def add(self, x: torch.Tensor) -> int:
        """Register a 0-d sum (a float sum over tokens, or an integer count); returns its key."""
        if x.dim():
            x = x.reshape(())
        if x.dtype != torch.float32:  # one stack of float32 only (a mixed one costs 3x more)
            x = x.float()
        self._sums.append(x)
        return len(self._sums) - 1

    def difference(self, a: torch.Tensor, b: torch.Tensor) -> dict[int, float]:
        """The terms of ``a - b`` for ``ratio``: two sums, even when ``a`` is ``b`` (the sums a
        plan registers must not depend on the data: ``resolve(group)`` all-reduces them as one
        vector, and every rank must contribute the same layout)."""
        return {self.add(a): 1.0, self.add(b): -1.0}

    def ratio(self, name: str, num: dict[int, float], den: int | None = None, *,
              offset: float = 0.0) -> None:
        r"""``name = offset + (\sum_k c_k s_k) / s_{den}`` (``den=None``: no division; a zero
        denominator gives ``offset``, as every numerator here is then 0 too)."""
        self._ratios.append((name, tuple(num.items()), den, offset))

    def extreme(self, name: str, x: torch.Tensor, *, empty: int | None = None, sign: float = 1.0,
                fill: float = float("nan"), exp: bool = False, local_exact: bool = False) -> None:
        """``name = sign * x`` where ``x`` is a 0-d maximum (pass ``-min`` with ``sign=-1`` for a
        minimum); ``fill`` (NaN) when the sum ``empty`` (a count) is 0. Max-reduced over ranks.
        ``exp``: report ``exp`` of it (a ratio extreme from a log-ratio extreme).
        ``local_exact``: ``x`` is already the metric on one process, ``fill`` included (then
        only a process group needs the batched form)."""
        if x.dim() or x.dtype != torch.float32:
            x = x.reshape(()).float()
        self._extremes.append((name, x, empty, sign, fill))
        if exp:
            self._exp.add(name)
        if local_exact:
            self._local_exact.add(name)

    def value(self, name: str, x: torch.Tensor) -> None:
        """A metric computed elsewhere, passed through (as a detached 0-d float32 tensor)."""
        if x.requires_grad or x.dtype != torch.float32 or x.dim():
            x = x.detach().float().reshape(())
        self._values[name] = x

    def resolve(self, group: object | None = None) -> dict[str, torch.Tensor]:
        """Every metric as a detached 0-d float32 tensor (``as_metrics`` would return them as
        they are)."""
        out: dict[str, torch.Tensor] = {}
        n = len(self._sums)
        local = full = None
        if self._sums:
            # float32 (``add`` converted the counts), the constant 1 last
            local = torch.stack([*self._sums, _one(self._sums[0].device)]).detach()
            full = local
            if group is not None:
                full = all_reduce_sum(local, group)
                full[-1] = 1.0  # the constant, summed over the ranks: back to 1
        if self._ratios:
            spec = tuple((terms, den, off) for _, terms, den, off in self._ratios)
            cols, coefs, rows, dens, off = _tables(spec, n, full.device)
            num = torch.zeros_like(off).index_add_(0, rows, full[cols] * coefs)
            vals = torch.addcdiv(off, num, full[dens].clamp_(min=1e-30)).unbind()
            out.update(zip((r[0] for r in self._ratios), vals))
        extremes = self._extremes
        if group is None and self._local_exact:
            out.update((e[0], e[1].detach() if e[1].requires_grad else e[1])
                       for e in extremes if e[0] in self._local_exact)
            extremes = [e for e in extremes if e[0] not in self._local_exact]
        if extremes:
            ext = torch.stack([x for _, x, *_ in extremes]).detach()
            spec = tuple((e, sign, fill) for _, _, e, sign, fill in extremes)
            idx, signs, fills = _extreme_tables(spec, n, ext.device)
            if group is not None:  # a shard without tokens must not move the others' extremes
                local_counts = local[idx] if local is not None else torch.ones_like(ext)
                ext = all_reduce_max(torch.where(local_counts > 0, ext, float("-inf")), group)
            present = full[idx] > 0 if full is not None else torch.ones_like(ext, dtype=torch.bool)
            vals = torch.where(present, ext * signs, fills).unbind()
            out.update((e[0], v.exp() if e[0] in self._exp else v) for e, v in zip(extremes, vals))
        out.update(self._values)
        return out
