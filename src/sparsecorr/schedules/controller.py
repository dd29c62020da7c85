r"""``TailController``: adjust a schedule online from streaming tail statistics.

Every step, the trainer feeds the per-token acceptance of its rollouts (with their prompt
lengths) into per-bin sketches. The acceptance is the one statistic calibration measures and
``tau`` is a threshold on: \(\alpha_t = 1 - \mathrm{TV}(p_t, q_t)\) between the dense and the
sparse next-token distributions, from their top-k log-probs
(``sparsecorr.mismatch.acceptance_rate_topk``, a lower bound; Sparrow, k = 20). The sampled
token's \(\min(1, p/q)\) has the same mean but is one noisy draw per token: its tail sits far
below \(\alpha\)'s and must not be fed here. Between steps, `TailController.step` reads each bin's
tail (``q`` quantile) and raises that bin's budget to the next candidate when the tail is below
``tau``, or lowers it by one candidate when it has stayed comfortably above (``tau + margin``)
for ``patience`` consecutive steps — never outside ``[min_budget, max_budget]``, and keeping
the schedule monotone. Every change is logged with the statistic that caused it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import check_int, check_int_list, check_number, check_probability
from .._checks import field as json_field
from ..mismatch import BinnedQuantileSketch
from .schedule import BudgetSchedule

__all__ = ["TailController"]


@dataclass
class TailController:
    """Online budget adjustment (see the module docstring).

    Args:
        schedule: the schedule to adjust (a new one is produced at every change).
        candidates: allowed budgets, ascending (the steps of a raise or a lowering).
        tau: threshold on the tail statistic (Sparrow: 0.86).
        q: tail level (0.05).
        margin: lower a bin only when its tail is above ``tau + margin``.
        patience: consecutive comfortable steps before lowering.
        min_tokens: bins with fewer tokens since the last step are left alone.
    """

    schedule: BudgetSchedule
    candidates: list[int]
    tau: float = 0.86
    q: float = 0.05
    margin: float = 0.05
    patience: int = 3
    min_tokens: int = 64
    log: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, BudgetSchedule):
            raise ValueError(f"schedule: expected a BudgetSchedule, got {type(self.schedule).__name__}")
        check_int_list("candidates", self.candidates)
        check_probability("tau", self.tau)
        check_probability("q", self.q)
        check_number("margin", self.margin, low=0)
        check_int("patience", self.patience, low=1)
        check_int("min_tokens", self.min_tokens, low=0)
        if not isinstance(self.log, list):
            raise ValueError(f"log: expected a list, got {type(self.log).__name__}")
        self.candidates = sorted(set(self.candidates))
        n = len(self.schedule.budgets)
        self._sketch = BinnedQuantileSketch(0.0, 1.0, bin_size=self.schedule.bin_size, n_bins=n,
                                            n_buckets=512)
        self._comfort = [0] * n
        self.steps = 0
        self.last_tails: list[float] = [float("nan")] * n

    def observe(self, acceptance: torch.Tensor, mask: torch.Tensor,
                offset: torch.Tensor | None = None) -> None:
        """Add per-token acceptance ``[B, T]`` (offset = prompt lengths ``[B]``)."""
        self._sketch.update(acceptance.float(), mask, offset)

    def _move(self, budget: int | None, up: bool) -> int | None:
        if budget is None:
            return None if up else self.candidates[-1]
        higher = [c for c in self.candidates if c > budget]
        lower = [c for c in self.candidates if c < budget]
        if up:
            return higher[0] if higher else None  # past the largest candidate: dense
        return lower[-1] if lower else budget

    def step(self) -> BudgetSchedule:
        """Update the schedule from the statistics gathered since the last step."""
        tails = self._sketch.quantile(self.q)
        counts = self._sketch.bin_counts
        #: the tail per bin seen by this step (NaN where fewer than ``min_tokens`` tokens)
        self.last_tails = [t if n >= self.min_tokens else float("nan")
                           for t, n in zip(tails.tolist(), counts.tolist())]
        budgets = list(self.schedule.budgets)
        for i, (tail, n) in enumerate(zip(tails.tolist(), counts.tolist())):
            if n < self.min_tokens:
                continue
            old = budgets[i]
            if tail < self.tau:
                budgets[i], self._comfort[i] = self._move(old, up=True), 0
                reason = "below tau"
            elif tail > self.tau + self.margin:
                self._comfort[i] += 1
                if self._comfort[i] < self.patience:
                    continue
                budgets[i], self._comfort[i] = self._move(old, up=False), 0
                reason = "above tau + margin"
            else:
                self._comfort[i] = 0
                continue
            if budgets[i] != old:
                self.log.append({"step": self.steps, "bin": i, "old": old, "new": budgets[i],
                                 "tail": tail, "tokens": int(n), "reason": reason})
        for i in range(1, len(budgets)):  # keep it monotone: never smaller than an earlier bin
            prev, cur = budgets[i - 1], budgets[i]
            if prev is None or (cur is not None and cur < prev):
                budgets[i] = prev
        self.schedule = BudgetSchedule(self.schedule.bin_size, tuple(budgets), meta=self.schedule.meta)
        self._sketch.reset()
        self.steps += 1
        return self.schedule

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.to_dict(), "candidates": self.candidates, "tau": self.tau,
                "q": self.q, "margin": self.margin, "patience": self.patience,
                "min_tokens": self.min_tokens, "comfort": list(self._comfort), "steps": self.steps,
                "log": list(self.log)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TailController:
        """Rebuild from `state_dict` (e.g. a hand-edited JSON checkpoint): every field is
        checked and a bad one is a ``ValueError`` naming it (``state.comfort: ...``)."""
        w = "state"
        try:
            schedule = BudgetSchedule.from_dict(json_field(state, "schedule", where=w, kind="dict"))
        except ValueError as exc:
            raise ValueError(f"state.schedule.{exc}") from None
        ctl = cls(schedule, list(json_field(state, "candidates", where=w, kind="list")),
                  tau=json_field(state, "tau", where=w, kind="number"),
                  q=json_field(state, "q", where=w, kind="number"),
                  margin=json_field(state, "margin", where=w, kind="number"),
                  patience=json_field(state, "patience", where=w, kind="int"),
                  min_tokens=json_field(state, "min_tokens", where=w, kind="int"),
                  log=list(json_field(state, "log", where=w, kind="list", default=[])))
        comfort = json_field(state, "comfort", where=w, kind="list")
        n = len(schedule.budgets)
        if len(comfort) != n or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                        for c in comfort):
            raise ValueError(f"state.comfort: expected {n} ints >= 0 (one per bin), got {comfort!r}")
        steps = json_field(state, "steps", where=w, kind="int")
        check_int("state.steps", steps, low=0)
        ctl._comfort, ctl.steps = list(comfort), steps
        return ctl
