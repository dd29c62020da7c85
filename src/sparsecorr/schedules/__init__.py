"""PLAN: cost model, calibration, schedule optimiser and online controller (Sparrow, METHODS §2).

calibrate (tail acceptance per budget × length bin) → fit_schedule (cheapest feasible step
function of context length, exact DP) → ``generate(..., budget=schedule)`` → TailController
(online adjustment from streaming sketches).
"""

from .calibrate import calibrate
from .controller import TailController
from .cost import HARDWARE, MODEL_PRESETS, CostModel
from .fit import fit_schedule, schedule_cost_matrix, solve_schedule
from .schedule import SPARROW_PRESETS, BudgetSchedule
from .table import CalibrationTable

__all__ = [
    "HARDWARE",
    "MODEL_PRESETS",
    "SPARROW_PRESETS",
    "BudgetSchedule",
    "CalibrationTable",
    "CostModel",
    "TailController",
    "calibrate",
    "fit_schedule",
    "schedule_cost_matrix",
    "solve_schedule",
]
