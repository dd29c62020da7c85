r"""The eFLOPs cost model of Sparrow (after Kinetics), for dense, budgeted and scheduled decoding.

Units: FLOP-equivalents. Compute counts FLOPs; memory traffic counts bytes, converted with a
hardware *intensity* \(I\) = peak FLOP/s ÷ memory bandwidth (bytes/s). Symbols (METHODS.md §2):
\(P\) matmul parameters (all layers plus the LM head), \(N\) samples sharing one prompt,
\(L_\text{in}\) prompt and \(L_\text{out}\) generated tokens, \(D\) = KV width of one layer
(KV heads × head dim), \(r\) = GQA ratio (query heads per KV head), \(B\) the budget, page size 16.

Per decode step \(t\) (context \(L_\text{in} + t\)), summed over the \(n_\ell\) layers, with
\(b\) bytes per KV element:

- dense: compute \(2PN + n_\ell\, 2 r N D (L_\text{in} + t)\); memory
  \(n_\ell\, b\, D\,(2 L_\text{in} + 2 N t)\) (the shared prompt's KV is read once for all N);
- budget \(B\): compute \(2PN + n_\ell\, 2rNDB\) plus page scoring
  \(n_\ell (2 N L_\text{in} D + r N D t / \text{page})\); memory
  \(n_\ell\, b\, (2NDB + 2 L_\text{in} D + N D t/\text{page})\).

Summed over \(t < L_\text{out}\) these are exactly the paper's closed forms (per layer as
printed there, times the layer count here). Assumptions: decode only (the prefill is the same
for every policy and excluded), weights read once per step for all N samples (their memory is
not counted, as in the paper), bf16 KV (\(b = 2\)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._checks import check_int, check_number

__all__ = ["DEFAULT_L_IN", "DEFAULT_N", "HARDWARE", "MAX_L_OUT", "MODEL_PRESETS", "CostModel"]

#: samples per prompt (N) and prompt length (L_in) every speedup uses unless told otherwise:
#: ``CostModel.speedup``, ``fit_schedule`` and the ``sparsecorr schedule`` / ``cost`` commands
#: share them, so the same schedule gets the same predicted speedup everywhere.
DEFAULT_N = 8
DEFAULT_L_IN = 512

#: longest generation the cost model evaluates (it keeps one float64 per decode step)
MAX_L_OUT = 10_000_000

#: intensity I = dense bf16 peak FLOP/s / HBM bandwidth (NVIDIA H100 SXM and H200 datasheets:
#: 989 TFLOP/s bf16 dense; 3.35 TB/s and 4.8 TB/s)
HARDWARE = {"h100": 989e12 / 3.35e12, "h200": 989e12 / 4.8e12}

#: Qwen3 configurations (Hugging Face model cards / config.json of Qwen3-1.7B/4B/8B)
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(num_hidden_layers=28, hidden_size=2048, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936),
    "qwen3-4b": dict(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936),
    "qwen3-8b": dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936),
}


@dataclass(frozen=True)
class CostModel:
    """eFLOPs of decoding (see the module docstring for the formulas and assumptions).

    Every field is checked on construction: sizes are positive, the intensity finite and >= 0.
    """

    params: float
    num_layers: int
    kv_dim: int
    gqa_ratio: float
    intensity: float = HARDWARE["h100"]
    kv_bytes: int = 2
    page_size: int = 16

    def __post_init__(self) -> None:
        check_number("params", self.params, low=0, low_open=True)
        check_int("num_layers", self.num_layers, low=1)
        check_int("kv_dim", self.kv_dim, low=1)
        check_number("gqa_ratio", self.gqa_ratio, low=0, low_open=True)
        check_number("intensity", self.intensity, low=0)
        check_int("kv_bytes", self.kv_bytes, low=1)
        check_int("page_size", self.page_size, low=1)

    @classmethod
    def from_config(cls, config: Any, *, intensity: float | str = "h100") -> CostModel:
        """From a transformers config (or a dict / preset name such as ``"qwen3-4b"``).

        Each size read from the config must be a positive int; errors name the field
        (``config.hidden_size: expected an int >= 1, got -5``).
        """
        if isinstance(config, str):
            if config not in MODEL_PRESETS:
                raise ValueError(f"config: expected a config or one of {sorted(MODEL_PRESETS)}, got {config!r}")
            config = MODEL_PRESETS[config]
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "vocab_size")
        missing = [k for k in required if get(k) is None]
        if missing:
            raise ValueError(f"config: needs {', '.join(required)}; missing {', '.join(missing)}")
        for k in (*required, "num_key_value_heads", "head_dim"):
            check_int(f"config.{k}", get(k), low=1, allow_none=k in ("num_key_value_heads", "head_dim"))
        h, layers = get("hidden_size"), get("num_hidden_layers")
        heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads") or get("num_attention_heads")
        hd = get("head_dim") or h // heads
        if hd < 1:
            raise ValueError(f"config.head_dim: hidden_size {h} // num_attention_heads {heads} is 0")
        inter, vocab = get("intermediate_size"), get("vocab_size")
        per_layer = h * heads * hd * 2 + 2 * h * kv_heads * hd + 3 * h * inter
        if isinstance(intensity, str):
            if intensity not in HARDWARE:
                raise ValueError(f"intensity: expected a number or one of {sorted(HARDWARE)}, got {intensity!r}")
            intensity = HARDWARE[intensity]
        return cls(params=float(layers * per_layer + h * vocab), num_layers=int(layers),
                   kv_dim=int(kv_heads * hd), gqa_ratio=heads / kv_heads, intensity=float(intensity))

    def with_intensity(self, intensity: float) -> CostModel:
        """The same model on other hardware (``intensity`` = FLOP/s ÷ bytes/s, finite, >= 0)."""
        return replace(self, intensity=intensity)

    def _steps(self, l_out: int) -> np.ndarray:
        return np.arange(l_out, dtype=np.float64)

    @staticmethod
    def _check_sizes(n: object, l_in: object, l_out: object) -> None:
        check_int("n", n, low=1)
        check_int("l_in", l_in, low=0)
        check_int("l_out", l_out, low=0, high=MAX_L_OUT,
                  why=" (the cost model keeps one value per decode step)")

    def dense_steps(self, *, n: int, l_in: int, l_out: int) -> np.ndarray:
        """Cost of each decode step of a dense rollout, ``[l_out]``."""
        self._check_sizes(n, l_in, l_out)
        t, nl, d, r = self._steps(l_out), self.num_layers, self.kv_dim, self.gqa_ratio
        comp = 2 * self.params * n + nl * 2 * r * n * d * (l_in + t)
        mem = nl * self.kv_bytes * d * (2 * l_in + 2 * n * t)
        return comp + self.intensity * mem

    def budget_steps(self, *, n: int, l_in: int, l_out: int, budget: np.ndarray | int) -> np.ndarray:
        """Cost of each decode step under a KV budget (per step, ``[l_out]`` or a scalar)."""
        self._check_sizes(n, l_in, l_out)
        t, nl, d, r, ps = self._steps(l_out), self.num_layers, self.kv_dim, self.gqa_ratio, self.page_size
        b = np.broadcast_to(np.asarray(budget, dtype=np.float64), t.shape)
        if b.size and (not np.isfinite(b).all() or (b < 0).any()):
            raise ValueError(f"budget: expected finite budgets >= 0, got {budget!r}")
        comp = 2 * self.params * n + nl * (2 * r * n * d * b + 2 * n * l_in * d + r * n * d * t / ps)
        mem = nl * self.kv_bytes * (2 * n * d * b + 2 * l_in * d + n * d * t / ps)
        return comp + self.intensity * mem

    def _per_step_budgets(self, budget: Any, l_in: int, l_out: int) -> np.ndarray:
        """Budget in force at each decode step (-1 = dense), vectorised for a BudgetSchedule."""
        from .schedule import BudgetSchedule

        if isinstance(budget, BudgetSchedule):
            table = np.array([-1 if x is None else x for x in budget.budgets], dtype=np.float64)
            idx = np.minimum((l_in + self._steps(l_out)) // budget.bin_size, len(table) - 1)
            return table[idx.astype(np.int64)]
        if not callable(getattr(budget, "budget_at", None)):
            raise ValueError(f"budget: expected None, an int or a schedule with budget_at(), got {budget!r}")
        per = [budget.budget_at(l_in + t) for t in range(l_out)]
        return np.array([-1 if x is None else x for x in per], dtype=np.float64)

    def cost(self, *, n: int, l_in: int, l_out: int, budget: Any = None) -> float:
        """Total decode cost: ``budget`` None (dense), an int, or a schedule (``budget_at``)."""
        if budget is None:
            return float(self.dense_steps(n=n, l_in=l_in, l_out=l_out).sum())
        if isinstance(budget, (int, np.integer)) and not isinstance(budget, bool):
            check_int("budget", budget, low=1)
            steps = self.budget_steps(n=n, l_in=l_in, l_out=l_out, budget=int(budget))
            return float(np.minimum(steps, self.dense_steps(n=n, l_in=l_in, l_out=l_out)).sum())
        dense = self.dense_steps(n=n, l_in=l_in, l_out=l_out)
        b = self._per_step_budgets(budget, l_in, l_out)
        sparse = self.budget_steps(n=n, l_in=l_in, l_out=l_out, budget=np.maximum(b, 0))
        # a budget at least as large as the context is dense; None is dense
        ctx = l_in + self._steps(l_out)
        use_dense = (b < 0) | (b >= ctx)
        return float(np.where(use_dense, dense, np.minimum(sparse, dense)).sum())

    def speedup(self, budget: Any, *, n: int = DEFAULT_N, l_in: int = DEFAULT_L_IN,
                l_out: int = 32768) -> float:
        """Dense cost ÷ cost under ``budget`` (an int or a schedule); ``l_out >= 1``.

        Defaults ``n = DEFAULT_N`` (8) and ``l_in = DEFAULT_L_IN`` (512) are shared with
        ``fit_schedule`` and the CLI.
        """
        check_int("l_out", l_out, low=1, high=MAX_L_OUT)
        ratio = self.cost(n=n, l_in=l_in, l_out=l_out) / self.cost(n=n, l_in=l_in, l_out=l_out, budget=budget)
        return ratio if math.isfinite(ratio) else float("nan")
