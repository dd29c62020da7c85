r"""``fit_schedule``: the cheapest budget per length bin that keeps the tail statistic ≥ tau.

Solved exactly by dynamic programming over (bin, budget option, number of distinct budgets so
far): with ``monotone=True`` a bin's budget is never smaller than the previous bin's (dense is
the largest option), and ``max_steps`` bounds the number of segments of the step function.
The cost of a budget in a bin is the cost model's decode cost of the decode steps whose total
context (prompt ``l_in`` + generated) falls in the bin when a `CostModel` is given (the same
quantity `CostModel.cost` sums for a schedule), else the KV read per token,
``min(budget, context)`` at the middle of the bin (dense: the context). A bin where no
candidate reaches tau falls back to dense, and so does an empty bin after the first calibrated
one; one warning names each kind ("no budget reaches tau" vs "no calibrated tokens"). Bins
*before* the first calibrated token hold only prompt positions (nothing is decoded there) and
accept any budget.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from .._checks import check_int, check_int_list, check_probability
from .cost import DEFAULT_L_IN, DEFAULT_N, CostModel
from .schedule import BudgetSchedule
from .table import CalibrationTable

__all__ = ["fit_schedule", "schedule_cost_matrix", "solve_schedule"]

DENSE = None


def schedule_cost_matrix(budgets: list[int], n_bins: int, bin_size: int,
                         cost_model: CostModel | None, *, n: int = DEFAULT_N,
                         l_in: int = DEFAULT_L_IN) -> np.ndarray:
    """``[n_bins, n_budgets + 1]`` cost of decoding each bin's tokens with each option (last =
    dense).

    With a cost model, bin ``i`` holds the decode steps ``t`` whose total context ``l_in + t``
    lies in ``[i * bin_size, (i + 1) * bin_size)``; a bin inside the prompt costs nothing (and
    ties break toward the smaller budget).
    """
    check_int_list("budgets", budgets)
    check_int("n_bins", n_bins, low=1)
    check_int("bin_size", bin_size, low=1)
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model: expected a CostModel or None, got {type(cost_model).__name__}")
    out = np.zeros((n_bins, len(budgets) + 1))
    for i in range(n_bins):
        if cost_model is None:  # KV read per token at the middle of the bin
            mid = (i + 0.5) * bin_size
            # equal reads (a budget >= the context) tie-break toward the smaller budget
            out[i, :-1] = np.minimum(budgets, mid) + 1e-9 * np.asarray(budgets, dtype=float)
            out[i, -1] = mid + 1e-9 * (max(budgets) + 1)
            continue
        t0, t1 = max(0, i * bin_size - l_in), max(0, (i + 1) * bin_size - l_in)
        if t1 == t0:  # the whole bin is prompt: nothing decoded, prefer the smaller budget
            out[i] = 1e-9 * np.arange(1, len(budgets) + 2)
            continue
        dense = cost_model.dense_steps(n=n, l_in=l_in, l_out=t1)[t0:]
        ctx = l_in + np.arange(t0, t1)
        out[i, -1] = dense.sum()
        for j, b in enumerate(budgets):
            sparse = cost_model.budget_steps(n=n, l_in=l_in, l_out=t1, budget=b)[t0:]
            out[i, j] = np.where(b >= ctx, dense, np.minimum(sparse, dense)).sum()
    return out


def solve_schedule(feasible: np.ndarray, cost: np.ndarray, *, monotone: bool = True,
                   max_steps: int | None = None) -> list[int]:
    """Exact minimum-cost choice of one option per bin (option index = column).

    Args:
        feasible: ``[n_bins, n_options]`` bool; options are ordered by size (the last, dense,
            must be feasible everywhere).
        cost: ``[n_bins, n_options]`` cost of each option in each bin.
        monotone: option indices never decrease along the bins.
        max_steps: at most this many segments (runs of equal options).

    Returns:
        the chosen option index per bin.
    """
    feasible, cost = np.asarray(feasible), np.asarray(cost)
    if feasible.ndim != 2 or feasible.dtype != bool or 0 in feasible.shape:
        raise ValueError(f"feasible: expected a non-empty 2-D bool array, got shape {feasible.shape} "
                         f"dtype {feasible.dtype}")
    if cost.shape != feasible.shape:
        raise ValueError(f"cost: expected the shape of feasible {feasible.shape}, got {cost.shape}")
    if not np.issubdtype(cost.dtype, np.number) or not np.isfinite(cost).all():
        raise ValueError("cost: expected finite numbers")
    if not feasible[:, -1].all():
        raise ValueError("feasible: expected the last option (dense) to be feasible in every bin")
    check_int("max_steps", max_steps, low=1, allow_none=True)
    n_bins, k1 = feasible.shape
    steps_cap = n_bins if max_steps is None else max_steps
    inf = math.inf
    best = np.full((n_bins, k1, steps_cap + 1), inf)
    back = np.zeros((n_bins, k1, steps_cap + 1, 2), dtype=int)
    best[0, feasible[0], 1] = cost[0, feasible[0]]
    for i in range(1, n_bins):
        for j in np.flatnonzero(feasible[i]):
            for jp in range(k1):
                if monotone and jp > j:
                    continue
                for s in range(1, steps_cap + 1):
                    prev = best[i - 1, jp, s]
                    s2 = s if jp == j else s + 1
                    if prev == inf or s2 > steps_cap:
                        continue
                    c = prev + cost[i, j]
                    if c < best[i, j, s2]:
                        best[i, j, s2], back[i, j, s2] = c, (jp, s)
    j, s = np.unravel_index(np.argmin(best[-1]), best[-1].shape)
    if best[-1, j, s] == inf:
        raise ValueError("max_steps: no schedule satisfies the constraints")
    choice = [0] * n_bins
    for i in range(n_bins - 1, -1, -1):
        choice[i] = int(j)
        if i:
            j, s = back[i, j, s]
    return choice


def fit_schedule(table: CalibrationTable, *, tau: float = 0.86, cost_model: CostModel | None = None,
                 monotone: bool = True, max_steps: int | None = None, min_tokens: int = 1,
                 n: int = DEFAULT_N, l_in: int = DEFAULT_L_IN) -> BudgetSchedule:
    """Cheapest feasible schedule (exact DP; see the module docstring).

    Args:
        table: calibration table (tail statistic per budget × bin).
        tau: stability threshold on the tail statistic (Sparrow: 0.86).
        cost_model: ranks options by decode cost; without it, by budget size.
        monotone: budgets never shrink as context grows.
        max_steps: at most this many distinct segments (None = unbounded).
        min_tokens: a cell with fewer tokens does not count as evidence (treated as infeasible).
        n: samples per prompt for the cost model (default ``DEFAULT_N`` = 8, as in
            `CostModel.speedup` and the CLI).
        l_in: prompt length for the cost model (default ``DEFAULT_L_IN`` = 512).

    Returns:
        the schedule; ``meta`` holds tau, the dense-fallback bins (``dense_fallback_bins``,
        of which ``uncalibrated_bins`` had no calibrated tokens) and, with a cost model, the
        predicted speedup for ``n_bins * bin_size`` generated tokens (``predicted_speedup``,
        with its inputs in ``speedup_inputs``): the number `sparsecorr cost` prints in its last
        row for the same model, ``n`` and ``l_in``.
    """
    if not isinstance(table, CalibrationTable):
        raise ValueError(f"table: expected a CalibrationTable, got {type(table).__name__}")
    check_probability("tau", tau)
    check_int("max_steps", max_steps, low=1, allow_none=True)
    check_int("min_tokens", min_tokens, low=0)
    check_int("n", n, low=1)
    check_int("l_in", l_in, low=0)
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model: expected a CostModel or None, got {type(cost_model).__name__}")
    vals, counts = table.values.numpy(), table.counts.numpy()
    feasible = (counts.T >= min_tokens) & (np.nan_to_num(vals.T, nan=-1.0) >= tau)  # [bins, budgets]
    n_bins, k = feasible.shape[0], len(table.budgets)
    # bins before the first calibrated token hold only prompt positions: nothing is decoded
    # there, so any budget is acceptable (without this, a monotone fit would be forced dense)
    seen = np.flatnonzero(counts.sum(axis=0) >= min_tokens)
    leading = int(seen[0]) if seen.size else 0
    feasible[:leading] = True
    feasible = np.concatenate([feasible, np.ones((n_bins, 1), dtype=bool)], axis=1)  # dense always
    cost = schedule_cost_matrix(table.budgets, n_bins, table.bin_size, cost_model, n=n, l_in=l_in)
    choice = solve_schedule(feasible, cost, monotone=monotone, max_steps=max_steps)
    budgets = [None if c == k else table.budgets[c] for c in choice]
    fallback = [i for i in range(n_bins) if not feasible[i, :k].any()]  # leading bins excluded
    calibrated = (counts >= min_tokens).any(axis=0)  # [bins]: some budget has evidence
    empty = [i for i in fallback if not calibrated[i]]
    below = [i for i in fallback if calibrated[i]]
    for bins, what in ((below, f"no budget reaches tau={tau}"), (empty, "no calibrated tokens")):
        if bins:
            warnings.warn(f"fit_schedule: {what} in bins {bins} (context "
                          f"{_ranges(bins, table.bin_size)}); they fall back to dense", stacklevel=2)
    meta = {"tau": tau, "q": table.q, "dense_fallback_bins": fallback, "uncalibrated_bins": empty,
            "monotone": monotone, "max_steps": max_steps}
    schedule = BudgetSchedule(bin_size=table.bin_size, budgets=tuple(budgets), meta=meta)
    if cost_model is not None:
        l_out = n_bins * table.bin_size
        meta["predicted_speedup"] = cost_model.speedup(schedule, n=n, l_in=l_in, l_out=l_out)
        meta["speedup_inputs"] = {"n": n, "l_in": l_in, "l_out": l_out,
                                  "intensity": cost_model.intensity}
    return schedule


def _ranges(bins: list[int], bin_size: int) -> str:
    return ", ".join(f"{i * bin_size}-{(i + 1) * bin_size}" for i in bins)
