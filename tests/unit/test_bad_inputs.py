"""Every public function x every bad-input class that applies (issue #14).

Each row calls one public function with one bad input and states the outcome: either a
``ValueError`` whose message starts with the argument's name (``"chunk_size: expected ..."``),
or a documented well-defined result, checked by a predicate. The classes are

    shape, dtype, nan, inf, empty, all_masked, range (out-of-range hyperparameter), file

**Adding rows for another module.** Write a function returning a list of `Row` and decorate it
with ``@rows("module.name")``; list the module's public names in ``COVERED`` so the coverage test
checks that each has at least one row:

    @rows("sparsecorr.losses")
    def _losses() -> list[Row]:
        return [refused("sparse_grpo", "range", lambda: sparse_grpo(..., clip_eps=-1), "clip_eps")]
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch

from sparsecorr import mismatch, pruning, schedules
from tests.bad_inputs import CLASSES, REGISTRY, Row, check_row, missing_rows, refused, result, rows

#: public names that must have at least one row, by module
COVERED: dict[str, set[str]] = {
    "sparsecorr.mismatch": {
        "token_logprobs", "token_logprobs_and_entropy", "topk_logprobs", "truncate_logits",
        "truncated_token_logprobs", "acceptance_rate", "acceptance_rate_topk", "masked_quantile",
        "binned_quantile", "QuantileSketch", "BinnedQuantileSketch",
    },
    "sparsecorr.schedules": set(schedules.__all__) - {"HARDWARE", "MODEL_PRESETS", "SPARROW_PRESETS"},
    "sparsecorr.pruning": set(pruning.__all__) - {"POOLINGS", "RULES"},
}

# -- inputs ---------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")


def _logits(b=2, t=3, v=5, seed=0):
    return torch.randn(b, t, v, generator=torch.Generator().manual_seed(seed))


def _tokens(b=2, t=3, v=5):
    return torch.arange(b * t).reshape(b, t) % v


def _poke(x, value, index=(0, 1)):
    x = x.clone()
    x[index] = value
    return x


def _x(b=3, t=6):
    return torch.rand(b, t, generator=torch.Generator().manual_seed(1))


def _m(b=3, t=6, fill=True):
    return torch.full((b, t), fill, dtype=torch.bool)


def _finite_except(pos):
    """Predicate: non-finite exactly at ``pos`` of a ``[B, T]`` result, finite elsewhere."""
    def check(out):
        bad = ~torch.isfinite(out)
        expected = torch.zeros_like(bad)
        expected[pos] = True
        return torch.equal(bad, expected)
    return check


def _is_empty(shape):
    return lambda out: tuple(out.shape) == shape


def _all_nan(shape):
    return lambda out: tuple(out.shape) == shape and bool(torch.isnan(out).all())


# -- mismatch: log-probs, acceptance --------------------------------------------------------------
@rows("sparsecorr.mismatch")
def _logprob_rows() -> list[Row]:
    tl, tle, tk = mismatch.token_logprobs, mismatch.token_logprobs_and_entropy, mismatch.topk_logprobs
    ttl, trunc = mismatch.truncated_token_logprobs, mismatch.truncate_logits
    lg, tok = _logits(), _tokens()
    out = []
    for name, fn in (("token_logprobs", tl), ("token_logprobs_and_entropy", tle),
                     ("truncated_token_logprobs", ttl)):
        first = (lambda r: r[0]) if name == "token_logprobs_and_entropy" else (lambda r: r)
        out += [
            refused(name, "shape", lambda fn=fn: fn(lg, tok[:, :2]), "tokens"),
            refused(name, "dtype", lambda fn=fn: fn(lg, tok.float()), "tokens"),
            refused(name, "dtype", lambda fn=fn: fn(lg.long(), tok), "logits"),
            refused(name, "range", lambda fn=fn: fn(lg, tok, chunk_size=0), "chunk_size", "chunk0"),
            refused(name, "range", lambda fn=fn: fn(lg, tok, chunk_size=-1), "chunk_size", "chunk-1"),
            refused(name, "range", lambda fn=fn: fn(lg, tok, temperature=NAN), "temperature", "nan"),
            refused(name, "range", lambda fn=fn: fn(lg, tok, temperature=0.0), "temperature", "0"),
            refused(name, "range", lambda fn=fn: fn(lg, tok, temperature=INF), "temperature", "inf"),
            refused(name, "range", lambda fn=fn: fn(lg, _poke(tok, 7)), "tokens", "out-of-vocab"),
            refused(name, "range", lambda fn=fn: fn(lg, _poke(tok, -1)), "tokens", "negative id"),
            refused(name, "empty", lambda fn=fn: fn(lg[..., :0], tok), "logits", "V=0"),
            result(name, "empty", lambda fn=fn: fn(lg[:0], tok[:0]),
                   lambda r, first=first: tuple(first(r).shape) == (0, 3), "B=0"),
            result(name, "empty", lambda fn=fn: fn(lg[:, :0], tok[:, :0]),
                   lambda r, first=first: tuple(first(r).shape) == (2, 0), "T=0"),
            result(name, "nan", lambda fn=fn: fn(_poke(lg, NAN, (0, 1, 2)), tok),
                   lambda r, first=first: _finite_except((0, 1))(first(r)), "NaN logit: that position"),
        ]
    out += [
        result("token_logprobs", "inf", lambda: tl(_poke(lg, INF, (1, 2, 0)), tok),
               _finite_except((1, 2)), "+inf logit: that position"),
        result("token_logprobs", "inf", lambda: tl(_poke(lg, -INF, (0, 0, 4)), tok),
               lambda r: bool(torch.isfinite(r).all()), "-inf logit elsewhere is fine"),
        refused("topk_logprobs", "range", lambda: tk(lg, k=0), "k", "k0"),
        refused("topk_logprobs", "range", lambda: tk(lg, k=6), "k", "k>V"),
        refused("topk_logprobs", "range", lambda: tk(lg, k=2, chunk_size=0), "chunk_size"),
        refused("topk_logprobs", "range", lambda: tk(lg, k=2, temperature=NAN), "temperature"),
        refused("topk_logprobs", "dtype", lambda: tk(lg.long(), k=2), "logits"),
        result("topk_logprobs", "empty", lambda: tk(lg[:0], k=2),
               lambda r: tuple(r[0].shape) == (0, 3, 2) and tuple(r[1].shape) == (0, 3, 2), "B=0"),
        refused("truncated_token_logprobs", "range", lambda: ttl(lg, tok, top_k=0), "top_k"),
        refused("truncated_token_logprobs", "range", lambda: ttl(lg, tok, top_p=NAN), "top_p", "nan"),
        refused("truncated_token_logprobs", "range", lambda: ttl(lg, tok, top_p=1.5), "top_p", "1.5"),
        refused("truncate_logits", "range", lambda: trunc(lg[0], 0, None), "top_k"),
        refused("truncate_logits", "range", lambda: trunc(lg[0], None, NAN), "top_p"),
        refused("truncate_logits", "range", lambda: trunc(lg[0], None, 0.0), "top_p", "0"),
    ]
    return out


@rows("sparsecorr.mismatch")
def _acceptance_rows() -> list[Row]:
    ar, art = mismatch.acceptance_rate, mismatch.acceptance_rate_topk
    p, q = _logits(seed=0), _logits(seed=1)
    pl, pi = mismatch.topk_logprobs(p, k=3)
    ql, qi = mismatch.topk_logprobs(q, k=3)
    return [
        refused("acceptance_rate", "shape", lambda: ar(p, q[:, :2]), "q_logits"),
        refused("acceptance_rate", "dtype", lambda: ar(p.long(), q), "p_logits"),
        refused("acceptance_rate", "range", lambda: ar(p, q, chunk_size=0), "chunk_size"),
        refused("acceptance_rate", "range", lambda: ar(p, q, temperature=NAN), "temperature"),
        result("acceptance_rate", "empty", lambda: ar(p[:0], q[:0]), _is_empty((0, 3)), "B=0"),
        result("acceptance_rate", "nan", lambda: ar(_poke(p, NAN, (0, 1, 0)), q),
               _finite_except((0, 1)), "NaN logit: NaN acceptance there"),
        result("acceptance_rate", "inf", lambda: ar(p, _poke(q, INF, (1, 0, 0))),
               _finite_except((1, 0)), "+inf logit: NaN acceptance there"),
        refused("acceptance_rate_topk", "shape", lambda: art(pl, pi[..., :2], ql, qi), "p_ids"),
        refused("acceptance_rate_topk", "shape", lambda: art(pl, pi, ql[:1], qi[:1]), "q_logp"),
        refused("acceptance_rate_topk", "dtype", lambda: art(pl, pi.float(), ql, qi), "p_ids"),
        refused("acceptance_rate_topk", "empty", lambda: art(pl[..., :0], pi[..., :0], ql, qi), "p_logp", "k=0"),
        result("acceptance_rate_topk", "empty", lambda: art(pl[:0], pi[:0], ql[:0], qi[:0]),
               _is_empty((0, 3)), "B=0"),
        result("acceptance_rate_topk", "nan", lambda: art(_poke(pl, NAN, (1, 1, 2)), pi, ql, qi),
               _finite_except((1, 1)), "NaN log-prob: NaN acceptance there"),
        result("acceptance_rate_topk", "inf", lambda: art(pl, pi, _poke(ql, -INF, (0, 0, 1)), qi),
               lambda r: bool(torch.isfinite(r).all() and (r >= 0).all() and (r <= 1).all()),
               "-inf log-prob is zero probability"),
    ]


# -- mismatch: quantiles and sketches -------------------------------------------------------------
@rows("sparsecorr.mismatch")
def _quantile_rows() -> list[Row]:
    mq, bq = mismatch.masked_quantile, mismatch.binned_quantile
    x, m = _x(), _m()
    off = torch.tensor([0, 2, 4])
    ref = float(np.quantile(_x().reshape(-1)[1:].numpy(), 0.3))
    return [
        refused("masked_quantile", "dtype", lambda: mq(x, m.float(), 0.5), "mask"),
        refused("masked_quantile", "dtype", lambda: mq(x.long(), m, 0.5), "x"),
        refused("masked_quantile", "shape", lambda: mq(x, m[:, :2], 0.5), "mask"),
        refused("masked_quantile", "range", lambda: mq(x, m, 0.5, dim=5), "dim", "dim5"),
        refused("masked_quantile", "range", lambda: mq(x, m, 1.5), "q", "q1.5"),
        refused("masked_quantile", "range", lambda: mq(x, m, NAN), "q", "qnan"),
        refused("masked_quantile", "range", lambda: mq(x, m, []), "q", "no level"),
        result("masked_quantile", "nan", lambda: mq(_poke(x.reshape(1, -1), NAN, (0, 0)), m.reshape(1, -1), 0.3),
               lambda r: math.isclose(float(r), ref, rel_tol=1e-5), "NaN ignored"),
        result("masked_quantile", "inf", lambda: mq(_poke(x.reshape(1, -1), INF, (0, 0)), m.reshape(1, -1), 0.3),
               lambda r: math.isclose(float(r), ref, rel_tol=1e-5), "inf ignored"),
        result("masked_quantile", "all_masked", lambda: mq(x, _m(fill=False), 0.5), _all_nan(()), "NaN"),
        result("masked_quantile", "all_masked", lambda: mq(x, _m(fill=False), [0.1, 0.5], dim=1),
               _all_nan((3, 2)), "NaN per row"),
        result("masked_quantile", "empty", lambda: mq(x[:0], m[:0], 0.5, dim=0), _all_nan((6,)), "B=0 dim0"),
        result("masked_quantile", "empty", lambda: mq(x[:0], m[:0], 0.5), _all_nan(()), "B=0"),
        refused("binned_quantile", "shape", lambda: bq(x[0], m[0], 0.5), "x"),
        refused("binned_quantile", "shape", lambda: bq(x, m, 0.5, offset=off[:2]), "offset"),
        refused("binned_quantile", "dtype", lambda: bq(x, m, 0.5, offset=off.float()), "offset"),
        refused("binned_quantile", "range", lambda: bq(x, m, 0.5, offset=torch.tensor([0, -3, 1])),
                "offset", "negative offset"),
        refused("binned_quantile", "range", lambda: bq(x, m, 0.5, bin_size=0), "bin_size"),
        refused("binned_quantile", "range", lambda: bq(x, m, 0.5, n_bins=-1), "n_bins"),
        refused("binned_quantile", "range", lambda: bq(x, m, 2.0), "q"),
        result("binned_quantile", "empty", lambda: bq(x[:0], m[:0], 0.5, bin_size=2, n_bins=3),
               lambda r: _all_nan((3,))(r[0]) and r[1].tolist() == [0, 0, 0], "B=0: NaN, zero counts"),
        result("binned_quantile", "empty", lambda: bq(x[:, :0], m[:, :0], 0.5, bin_size=2, n_bins=3),
               lambda r: _all_nan((3,))(r[0]) and r[1].tolist() == [0, 0, 0], "T=0: NaN, zero counts"),
        result("binned_quantile", "empty", lambda: bq(x[:0], m[:0], 0.5, bin_size=2),
               lambda r: r[0].shape == (0,) and r[1].shape == (0,), "B=0, no n_bins: no bins"),
        result("binned_quantile", "all_masked", lambda: bq(x, _m(fill=False), 0.5, bin_size=2, n_bins=2),
               lambda r: _all_nan((2,))(r[0]) and r[1].tolist() == [0, 0], "NaN, zero counts"),
        result("binned_quantile", "nan", lambda: bq(_poke(x, NAN, (0, 0)), m, 0.5, bin_size=6, n_bins=1),
               lambda r: r[1].tolist() == [17] and bool(torch.isfinite(r[0]).all()), "NaN skipped"),
    ]


@rows("sparsecorr.mismatch")
def _sketch_rows() -> list[Row]:
    QS, BQS = mismatch.QuantileSketch, mismatch.BinnedQuantileSketch

    def top_bucket():
        s = QS(0.0, 1.0).update(torch.tensor([1e30, -1e30, 0.5]))
        return s

    def nonfinite():
        return QS().update(torch.tensor([NAN, INF, 0.5]))

    return [
        refused("QuantileSketch", "range", lambda: QS(1.0, 1.0), "lo, hi"),
        refused("QuantileSketch", "nan", lambda: QS(NAN, 1.0), "lo"),
        refused("QuantileSketch", "range", lambda: QS(n_buckets=0), "n_buckets"),
        refused("QuantileSketch", "range", lambda: QS(n_buckets=2**40), "n_bins, n_buckets", "too large"),
        refused("QuantileSketch", "dtype", lambda: QS().update(torch.ones(3, dtype=torch.long)), "x"),
        refused("QuantileSketch", "shape", lambda: QS().update(torch.ones(3), torch.ones(2, dtype=torch.bool)),
                "mask"),
        refused("QuantileSketch", "range", lambda: QS().quantile(1.5), "q"),
        result("QuantileSketch", "inf", top_bucket,
               lambda s: s.counts[-1] == 1 and s.counts[0] == 1 and float(s.n_clamped) == 2,
               "1e30 in the top bucket, counted"),
        result("QuantileSketch", "nan", nonfinite,
               lambda s: float(s.count) == 1 and float(s.n_nonfinite) == 2, "NaN/inf skipped, counted"),
        result("QuantileSketch", "empty", lambda: QS().update(torch.ones(0)).quantile([0.1, 0.5]),
               _all_nan((2,)), "NaN"),
        refused("BinnedQuantileSketch", "range", lambda: BQS(n_bins=10**7), "n_bins, n_buckets", "10**7 bins"),
        refused("BinnedQuantileSketch", "range", lambda: BQS(bin_size=0), "bin_size"),
        refused("BinnedQuantileSketch", "shape", lambda: BQS().update(torch.ones(3)), "x"),
        refused("BinnedQuantileSketch", "range",
                lambda: BQS(bin_size=2, n_bins=3).update(_x(), None, torch.tensor([0, -5, 0])),
                "offset", "negative offset"),
        refused("BinnedQuantileSketch", "dtype",
                lambda: BQS(bin_size=2, n_bins=3).update(_x(), None, torch.tensor([0.0, 1.0, 2.0])), "offset"),
        result("BinnedQuantileSketch", "empty", lambda: BQS(bin_size=2, n_bins=3).update(_x()[:0]).quantile(0.5),
               _all_nan((3,)), "NaN per bin"),
        result("BinnedQuantileSketch", "all_masked",
               lambda: BQS(bin_size=2, n_bins=3).update(_x(), _m(fill=False)).bin_counts,
               lambda c: c.tolist() == [0, 0, 0], "zero counts"),
    ]


# -- schedules ------------------------------------------------------------------------------------
def _tampered(kind: str, edit: Callable[[dict], None]) -> Callable[[], object]:
    """Round-trip a valid object through JSON with ``edit`` applied to the dict, then load it."""
    def call():
        if kind == "table":
            t = schedules.CalibrationTable(budgets=[8, 16], bin_size=10, n_bins=2)
            t.add(8, torch.full((1, 5), 0.9), torch.ones(1, 5, dtype=torch.bool))
            data = json.loads(json.dumps(t.to_dict()))
            edit(data)
            return schedules.CalibrationTable.from_dict(data)
        if kind == "schedule":
            data = schedules.BudgetSchedule(bin_size=10, budgets=(8, None)).to_dict()
            edit(data)
            return schedules.BudgetSchedule.from_dict(data)
        ctl = schedules.TailController(schedules.BudgetSchedule(10, (8, 16)), candidates=[8, 16])
        data = json.loads(json.dumps(ctl.state_dict()))
        edit(data)
        return schedules.TailController.from_state_dict(data)
    return call


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _del(key):
    return lambda d: d.pop(key)


@rows("sparsecorr.schedules")
def _schedule_file_rows() -> list[Row]:
    T = "CalibrationTable"
    return [
        refused(T, "range", lambda: schedules.CalibrationTable(budgets=[8], n_bins=10**7), "n_bins", "80 GB"),
        refused(T, "range", lambda: schedules.CalibrationTable(budgets=list(range(1, 10_000)), n_bins=20),
                "n_bins", "many budgets"),
        refused(T, "range", lambda: schedules.CalibrationTable(budgets=[8], q=1.5), "q"),
        refused(T, "nan", lambda: schedules.CalibrationTable(budgets=[8], q=NAN), "q", "q nan"),
        refused(T, "range", lambda: schedules.CalibrationTable(budgets=[]), "budgets"),
        refused(T, "range", lambda: schedules.CalibrationTable(budgets=[8, 0]), r"budgets\[1\]"),
        refused(T, "dtype", lambda: schedules.CalibrationTable(budgets=[True]), r"budgets\[0\]"),
        refused(T, "range", lambda: schedules.CalibrationTable(budgets=[8], bin_size=0), "bin_size"),
        refused(T, "dtype", lambda: schedules.CalibrationTable(budgets=[8]).add(
            8, torch.ones(1, 3, dtype=torch.long), _m(1, 3)), "acceptance"),
        refused(T, "range", lambda: schedules.CalibrationTable(budgets=[8]).add(
            8, torch.ones(1, 3), _m(1, 3), torch.tensor([-1])), "offset"),
        refused(T, "file", _tampered("table", _del("bin_size")), "bin_size", "missing bin_size"),
        refused(T, "file", _tampered("table", _set("q", "0.05")), "q", "q string"),
        refused(T, "file", _tampered("table", _set("q", 1.5)), "q", "q 1.5"),
        refused(T, "file", _tampered("table", _set("budgets", "8,16")), "budgets", "budgets string"),
        refused(T, "file", _tampered("table", _set("cells", [])), "cells", "cells list"),
        refused(T, "file", _tampered("table", lambda d: d["cells"].__setitem__("abc", [])), "cells.abc"),
        refused(T, "file", _tampered("table", lambda d: d["cells"]["8"].append([0, 0])), r"cells\.8\[1\]",
                "short entry"),
        refused(T, "file", _tampered("table", lambda d: d["cells"]["8"].append([0, 0, NAN])),
                r"cells\.8\[1\]", "NaN count"),
        refused(T, "file", _tampered("table", lambda d: d["cells"]["8"].append([0, 5000, 1])),
                r"cells\.8\[1\]", "bucket out of range"),
        refused(T, "file", _tampered("table", _set("n_buckets", 512)), "n_buckets"),
        refused(T, "file", _tampered("table", _set("meta", [])), "meta"),
        refused("BudgetSchedule", "range", lambda: schedules.BudgetSchedule(bin_size=0, budgets=(8,)), "bin_size"),
        refused("BudgetSchedule", "dtype", lambda: schedules.BudgetSchedule(bin_size=True, budgets=(8,)),
                "bin_size", "bool"),
        refused("BudgetSchedule", "empty", lambda: schedules.BudgetSchedule(bin_size=10, budgets=()), "budgets"),
        refused("BudgetSchedule", "range", lambda: schedules.BudgetSchedule(10, (8, 0)), r"budgets\[1\]"),
        refused("BudgetSchedule", "range", lambda: schedules.BudgetSchedule.from_pages([1, -2]), r"pages\[1\]"),
        refused("BudgetSchedule", "file", _tampered("schedule", _del("budgets")), "budgets", "missing"),
        refused("BudgetSchedule", "file", _tampered("schedule", _set("bin_size", "10")), "bin_size", "string"),
        refused("BudgetSchedule", "file", _tampered("schedule", _set("budgets", [8, 2.5])), r"budgets\[1\]"),
        refused("BudgetSchedule", "file", _tampered("schedule", _set("meta", 3)), "meta"),
        refused("TailController", "file", _tampered("controller", _del("comfort")), r"state\.comfort"),
        refused("TailController", "file", _tampered("controller", _set("comfort", [0])), r"state\.comfort",
                "wrong length"),
        refused("TailController", "file", _tampered("controller", _set("steps", "3")), r"state\.steps"),
        refused("TailController", "file", _tampered("controller", _set("tau", 2.0)), "tau", "tau 2"),
        refused("TailController", "file", _tampered("controller", lambda d: d["schedule"].__setitem__(
            "budgets", [8, -1])), r"state\.schedule\.budgets\[1\]"),
        refused("TailController", "file", lambda: schedules.TailController.from_state_dict([]), "state"),
    ]


def _table(empty: bool = False):
    t = schedules.CalibrationTable(budgets=[8, 16], bin_size=10, n_bins=2)
    if not empty:
        for b in (8, 16):
            t.add(b, torch.full((1, 20), 0.95), torch.ones(1, 20, dtype=torch.bool))
    return t


def _fit_warns(table, pattern):
    def call():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = schedules.fit_schedule(table, tau=0.9)
        return s, [str(w.message) for w in caught]
    return result("fit_schedule", "all_masked" if "calibrated" in pattern else "range", call,
                  lambda r: r[0].budgets == (None, None) and any(re.search(pattern, m) for m in r[1]),
                  pattern)


@rows("sparsecorr.schedules")
def _schedule_rows() -> list[Row]:
    CM, TC, BS = schedules.CostModel, schedules.TailController, schedules.BudgetSchedule
    cm = CM.from_config("qwen3-1.7b")
    ctl = lambda **k: TC(BS(10, (8, 16)), candidates=[8, 16], **k)  # noqa: E731
    fit = schedules.fit_schedule
    feasible = np.ones((2, 2), dtype=bool)
    return [
        refused("CostModel", "range", lambda: CM(params=-1.0, num_layers=2, kv_dim=8, gqa_ratio=1), "params"),
        refused("CostModel", "range", lambda: CM(params=1.0, num_layers=0, kv_dim=8, gqa_ratio=1), "num_layers"),
        refused("CostModel", "range", lambda: CM(params=1.0, num_layers=2, kv_dim=-8, gqa_ratio=1), "kv_dim"),
        refused("CostModel", "nan", lambda: CM(params=1.0, num_layers=2, kv_dim=8, gqa_ratio=NAN), "gqa_ratio"),
        refused("CostModel", "inf", lambda: CM(1.0, 2, 8, 1.0, intensity=INF), "intensity"),
        refused("CostModel", "range", lambda: CM.from_config({**schedules.MODEL_PRESETS["qwen3-4b"],
                                                               "hidden_size": -5}), r"config\.hidden_size"),
        refused("CostModel", "range", lambda: CM.from_config({}), "config", "empty config"),
        refused("CostModel", "range", lambda: cm.cost(n=0, l_in=0, l_out=8), "n"),
        refused("CostModel", "range", lambda: cm.cost(n=1, l_in=-1, l_out=8), "l_in"),
        refused("CostModel", "range", lambda: cm.cost(n=1, l_in=0, l_out=-8), "l_out"),
        refused("CostModel", "range", lambda: cm.cost(n=1, l_in=0, l_out=10**9), "l_out", "too long"),
        refused("CostModel", "range", lambda: cm.cost(n=1, l_in=0, l_out=8, budget=0), "budget"),
        refused("CostModel", "range", lambda: cm.speedup(512, l_out=0), "l_out", "speedup l_out 0"),
        refused("TailController", "range", lambda: ctl(tau=1.5), "tau"),
        refused("TailController", "nan", lambda: ctl(tau=NAN), "tau", "tau nan"),
        refused("TailController", "range", lambda: ctl(q=-0.1), "q"),
        refused("TailController", "nan", lambda: ctl(margin=NAN), "margin"),
        refused("TailController", "range", lambda: ctl(patience=0), "patience"),
        refused("TailController", "range", lambda: TC(BS(10, (8,)), candidates=[]), "candidates"),
        refused("TailController", "range", lambda: TC(BS(10, (8,)), candidates=[8, 0]), r"candidates\[1\]"),
        refused("TailController", "range", lambda: ctl().observe(_x(1, 4), _m(1, 4), torch.tensor([-2])), "offset"),
        result("TailController", "empty", lambda: (c := ctl(min_tokens=1), c.observe(_x(0, 4), _m(0, 4)),
                                                    c.step())[-1],
               lambda s: s.budgets == (8, 16), "no tokens: schedule unchanged"),
        refused("fit_schedule", "dtype", lambda: fit({"budgets": [8]}), "table"),
        refused("fit_schedule", "nan", lambda: fit(_table(), tau=NAN), "tau"),
        refused("fit_schedule", "range", lambda: fit(_table(), tau=1.5), "tau", "tau 1.5"),
        refused("fit_schedule", "range", lambda: fit(_table(), max_steps=0), "max_steps"),
        refused("fit_schedule", "range", lambda: fit(_table(), min_tokens=-1), "min_tokens"),
        refused("fit_schedule", "range", lambda: fit(_table(), n=0), "n"),
        refused("fit_schedule", "range", lambda: fit(_table(), l_in=-1), "l_in"),
        _fit_warns(_table(empty=True), r"no calibrated tokens in bins \[0, 1\]"),
        refused("schedule_cost_matrix", "empty", lambda: schedules.schedule_cost_matrix([], 2, 10, None), "budgets"),
        refused("schedule_cost_matrix", "range", lambda: schedules.schedule_cost_matrix([8], 0, 10, None), "n_bins"),
        refused("solve_schedule", "dtype", lambda: schedules.solve_schedule(feasible.astype(int), np.ones((2, 2))),
                "feasible"),
        refused("solve_schedule", "shape", lambda: schedules.solve_schedule(feasible, np.ones((2, 3))), "cost"),
        refused("solve_schedule", "nan", lambda: schedules.solve_schedule(feasible, np.full((2, 2), NAN)), "cost"),
        refused("solve_schedule", "range", lambda: schedules.solve_schedule(
            np.array([[True, False], [True, True]]), np.ones((2, 2))), "feasible", "dense infeasible"),
        refused("calibrate", "range", lambda: schedules.calibrate(
            None, _tokens(), policy=object(), budgets=[8], q=1.5, max_new_tokens=4), "q",
            "before the model is touched"),
        refused("calibrate", "range", lambda: schedules.calibrate(
            None, _tokens(), policy=object(), budgets=[8], n_bins=10**7, max_new_tokens=4), "n_bins"),
        refused("calibrate", "dtype", lambda: schedules.calibrate(
            None, _tokens().float(), policy=object(), budgets=[8], max_new_tokens=4), "prompts"),
        refused("calibrate", "empty", lambda: schedules.calibrate(
            None, _tokens()[:0], policy=object(), budgets=[8], max_new_tokens=4), "prompts"),
        refused("calibrate", "shape", lambda: schedules.calibrate(
            None, _tokens(), policy=object(), budgets=[8], max_new_tokens=4,
            attention_mask=torch.ones(2, 2)), "attention_mask"),
        refused("calibrate", "range", lambda: schedules.calibrate(
            None, _tokens(), policy=object(), budgets=[8], max_new_tokens=0), "max_new_tokens"),
    ]


# -- pruning --------------------------------------------------------------------------------------
def _trainer_after_nan():
    torch.manual_seed(0)
    trainer = pruning.QualityHeadTrainer(pruning.QualityHead(4, hidden_sizes=(8,)), min_updates=1)
    hidden = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    hidden[2, 1] = NAN
    rewards = torch.tensor([1.0, 0, 1, 0, NAN, 0, 1, INF])
    metrics = trainer.update(hidden, rewards)
    return trainer, metrics


@rows("sparsecorr.pruning")
def _pruning_rows() -> list[Row]:
    bk, QH, QHT, P = pruning.balanced_keep, pruning.QualityHead, pruning.QualityHeadTrainer, pruning.Pruner
    p = torch.tensor([0.1, 0.9, 0.5, 0.4])
    head = QH(4)
    return [
        refused("balanced_keep", "shape", lambda: bk(p[None], group_size=2), "p_success"),
        refused("balanced_keep", "dtype", lambda: bk(torch.ones(4, dtype=torch.long), group_size=2), "p_success"),
        refused("balanced_keep", "nan", lambda: bk(_poke(p, NAN, 1), group_size=2), "p_success"),
        refused("balanced_keep", "inf", lambda: bk(_poke(p, INF, 1), group_size=2), "p_success"),
        refused("balanced_keep", "range", lambda: bk(p, group_size=3), "group_size"),
        refused("balanced_keep", "range", lambda: bk(p, group_size=0), "group_size", "0"),
        refused("balanced_keep", "range", lambda: bk(p, group_size=2, keep_ratio=0.0), "keep_ratio"),
        refused("balanced_keep", "nan", lambda: bk(p, group_size=2, keep_ratio=NAN), "keep_ratio", "nan"),
        refused("balanced_keep", "range", lambda: bk(p, group_size=2, rule="best"), "rule"),
        result("balanced_keep", "empty", lambda: bk(torch.zeros(0), group_size=4),
               lambda k: k.dtype == torch.bool and k.shape == (0,), "empty keep"),
        result("balanced_keep", "empty", lambda: bk(torch.zeros(0), group_size=4, rule="target"),
               lambda k: k.shape == (0,), "empty keep target"),
        refused("expected_kept_variance", "dtype", lambda: pruning.expected_kept_variance(torch.ones(3, dtype=torch.long)), "p"),
        refused("expected_kept_variance", "empty", lambda: pruning.expected_kept_variance(torch.ones(3, 0)), "p"),
        refused("binary_auc", "shape", lambda: pruning.binary_auc(torch.ones(3), torch.ones(2)), "labels"),
        result("binary_auc", "nan", lambda: pruning.binary_auc(torch.tensor([0.1, NAN, 0.9]), torch.tensor([0, 0, 1])),
               lambda a: float(a) == 1.0, "NaN pair left out"),
        result("binary_auc", "empty", lambda: pruning.binary_auc(torch.ones(0), torch.ones(0)),
               lambda a: math.isnan(float(a)), "NaN"),
        refused("fit_temperature", "range", lambda: pruning.fit_temperature(torch.ones(3), torch.ones(3), iters=0),
                "iters"),
        result("fit_temperature", "empty", lambda: pruning.fit_temperature(torch.ones(0), torch.ones(0)),
               lambda t: t == 1.0, "T = 1"),
        result("fit_temperature", "nan", lambda: pruning.fit_temperature(torch.full((4,), NAN), torch.ones(4)),
               lambda t: t == 1.0, "all NaN: T = 1"),
        refused("QualityHead", "range", lambda: QH(0), "in_dim"),
        refused("QualityHead", "range", lambda: QH(4, pooling="max"), "pooling"),
        refused("QualityHead", "range", lambda: QH(4, dropout=1.5), "dropout"),
        refused("QualityHead", "range", lambda: QH(4, hidden_sizes=(8, 0)), r"hidden_sizes\[1\]"),
        refused("QualityHead", "shape", lambda: head(torch.ones(2, 3, 5)), "hidden"),
        refused("QualityHead", "shape", lambda: head(torch.ones(2, 3, 1, 4)), "hidden", "4-D"),
        refused("QualityHeadTrainer", "nan", lambda: QHT(head, lr=NAN), "lr"),
        refused("QualityHeadTrainer", "range", lambda: QHT(head, batch_size=0), "batch_size"),
        refused("QualityHeadTrainer", "range", lambda: QHT(head, min_auc=1.5), "min_auc"),
        refused("QualityHeadTrainer", "dtype", lambda: QHT("head"), "head"),
        refused("QualityHeadTrainer", "shape", lambda: QHT(head).update(torch.ones(3, 4), torch.ones(2)), "rewards"),
        result("QualityHeadTrainer", "nan", _trainer_after_nan,
               lambda r: float(r[1]["quality_head/dropped"]) == 3 and r[0].n_dropped == 3
               and all(bool(torch.isfinite(w).all()) for w in r[0].head.parameters()),
               "NaN hidden/reward rows dropped and counted, weights finite"),
        result("QualityHeadTrainer", "empty", lambda: QHT(QH(4)).update(torch.ones(0, 4), torch.ones(0)),
               lambda m: float(m["quality_head/loss"]) == 0 and float(m["quality_head/buffer"]) == 0,
               "nothing to train on"),
        refused("Pruner", "range", lambda: P(head, detect_len=0), "detect_len"),
        refused("Pruner", "range", lambda: P(head, keep_ratio=0.0), "keep_ratio"),
        refused("Pruner", "range", lambda: P(head, rule="x"), "rule"),
        refused("Pruner", "dtype", lambda: P("head"), "head"),
        refused("Pruner", "range", lambda: P(head).decide(torch.ones(4, 1, 4), group_size=None), "group_size"),
        refused("Pruner", "shape", lambda: P(head).decide(torch.ones(4, 4), group_size=2), "hidden"),
        result("Pruner", "nan", lambda: (pr := P(head, window=1), pr.decide(_poke(torch.ones(4, 1, 4), NAN, (1, 0, 2)),
                                                                          group_size=2))[0],
               lambda pr: pr.history[-1]["nonfinite"] == 1 and float(pr.last_p_success[1]) == 0.5,
               "NaN hidden: p = 0.5, counted"),
        refused("weighted_vote", "nan", lambda: pruning.weighted_vote(["a", "b"], [1.0, NAN]), "weights"),
        refused("weighted_vote", "range", lambda: pruning.weighted_vote(["a", "b"], [1.0, -1.0]), "weights"),
        refused("weighted_vote", "shape", lambda: pruning.weighted_vote(["a", "b"], [1.0]), "weights"),
        refused("weighted_vote", "dtype", lambda: pruning.weighted_vote([["a"], "b"], [1.0, 1.0]),
                r"answers\[0\]", "unhashable answer"),
        refused("weighted_vote", "dtype", lambda: pruning.weighted_vote("ab", [1.0, 1.0]), "answers", "a str"),
        refused("weighted_vote", "dtype", lambda: pruning.weighted_vote(["a", "b"], [1.0, "x"]), "weights",
                "a str weight"),
        refused("weighted_vote", "dtype", lambda: pruning.weighted_vote(["a", "b"], [True, 1.0]), "weights",
                "a bool weight"),
        refused("majority_vote", "dtype", lambda: pruning.majority_vote([{"x": 1}, "b"]), r"answers\[0\]",
                "unhashable answer"),
        result("weighted_vote", "empty", lambda: pruning.weighted_vote([], []), lambda r: r is None, "None"),
        result("majority_vote", "empty", lambda: pruning.majority_vote([]), lambda r: r is None, "None"),
        result("majority_vote", "all_masked", lambda: pruning.majority_vote([None, None]), lambda r: r is None,
               "no answers: None"),
    ]


# -- the tests ------------------------------------------------------------------------------------
ALL_ROWS = [row for fn in REGISTRY.values() for row in fn()]


@pytest.mark.parametrize("row", ALL_ROWS, ids=[r.id for r in ALL_ROWS])
def test_bad_input(row: Row) -> None:
    check_row(row)


def test_every_covered_public_name_has_rows() -> None:
    assert not missing_rows(ALL_ROWS, COVERED)


def test_rows_span_the_bad_input_classes() -> None:
    kinds = {r.kind for r in ALL_ROWS}
    assert kinds == set(CLASSES)


# -- generic cases, by parameter kind (issue 30) --------------------------------------------------
# Every public function or method with a ``dim``, a group size or an ``answers`` list is found by
# its signature; each kind has bad values every such function must refuse, naming the argument.
# A new function of one of these kinds fails `test_every_function_of_a_kind_has_a_valid_call`
# until it gets a valid call below, and from then on inherits every case of its kind.
#: the public API searched (integrations are searched when installed)
PUBLIC_MODULES = ("sparsecorr.mismatch", "sparsecorr.correction", "sparsecorr.losses",
                  "sparsecorr.pruning", "sparsecorr.schedules", "sparsecorr.decoding",
                  "sparsecorr_trl", "sparsecorr_openrlhf", "sparsecorr_verl")

#: parameter kind -> (names of that kind, bad values with a note)
KINDS: dict[str, tuple[re.Pattern, list[tuple[object, str]]]] = {
    "dim": (re.compile(r"^dim$"),
            [(5, "dim5"), (-6, "dim-6"), (True, "bool"), (1.5, "float"), ("1", "str")]),
    "group_size": (re.compile(r"^(group_size|num_generations)$"),
                   [(0, "0"), (-1, "-1"), (True, "bool"), (2.5, "float"), (3, "not dividing B=4"),
                    ("2", "str")]),
    "answers": (re.compile(r"^answers$"),
                [([["a"], "b"], "unhashable answer"), ("ab", "a str"), ({"a", "b"}, "a set")]),
}


def _public_callables() -> dict[str, Callable]:
    """``"module:Name"`` / ``"module:Name.method"`` -> callable, each object once."""
    found, seen = {}, set()
    for module_name in PUBLIC_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [(f"{name}.{m}", getattr(obj, m)) for m in dir(obj)
                            if not m.startswith("_") and callable(getattr(obj, m, None))
                            and getattr(getattr(obj, m), "__module__", "").startswith("sparsecorr")]
            for key, fn in members:
                if callable(fn) and id(fn) not in seen:
                    seen.add(id(fn))
                    found[f"{module_name}:{key}"] = fn
    return found


def discovered() -> dict[tuple[str, str], str]:
    """(kind, function key) -> the parameter's name, for every public callable of each kind."""
    out = {}
    for key, fn in _public_callables().items():
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        for kind, (pattern, _) in KINDS.items():
            for p in params:
                if pattern.match(p):
                    out[(kind, key)] = p
    return out


_V = 16  # the tiny model's vocabulary for generate's case


def _generate_with_pruner(group_size):
    from sparsecorr.decoding import StreamingLLM, generate
    from tests.models import tiny_model

    model = tiny_model("qwen3", vocab_size=_V)
    pruner = pruning.Pruner(pruning.QualityHead(model.config.hidden_size), detect_len=2, window=1)
    return generate(model, torch.randint(3, _V, (4, 3)), policy=StreamingLLM(sink=1), budget=4,
                    max_new_tokens=2, pruner=pruner, group_size=group_size)


def _vote_weights(answers):
    return [1.0] * len(answers)


#: (kind, function key) -> a valid call taking the value of that parameter (B = 4 rows where a
#: group size applies, 2-D inputs where a dim does)
VALID_CALLS: dict[tuple[str, str], Callable[[object], object]] = {
    ("dim", "sparsecorr.mismatch:masked_quantile"): lambda v: mismatch.masked_quantile(_x(), _m(), 0.5, dim=v),
    ("dim", "sparsecorr.mismatch:effective_sample_size"):
        lambda v: mismatch.effective_sample_size(_x(), _m(), dim=v),
    ("group_size", "sparsecorr.losses:group_advantages"):
        lambda v: importlib.import_module("sparsecorr.losses").group_advantages(torch.rand(4), group_size=v),
    ("group_size", "sparsecorr.pruning:balanced_keep"): lambda v: pruning.balanced_keep(torch.rand(4), group_size=v),
    ("group_size", "sparsecorr.pruning:Pruner.decide"):
        lambda v: pruning.Pruner(pruning.QualityHead(4), window=1).decide(torch.ones(4, 1, 4), group_size=v),
    ("group_size", "sparsecorr.decoding:generate"): _generate_with_pruner,
    ("answers", "sparsecorr.pruning:weighted_vote"): lambda v: pruning.weighted_vote(v, _vote_weights(v)),
    ("answers", "sparsecorr.pruning:majority_vote"): pruning.majority_vote,
}

def _generic_cases():
    for (kind, key), call in VALID_CALLS.items():
        for value, note in KINDS[kind][1]:
            yield pytest.param(kind, key, call, value, id=f"{key}-{kind}-{note}")


def test_every_function_of_a_kind_has_a_valid_call() -> None:
    found = discovered()
    assert set(found) == set(VALID_CALLS), (
        f"missing a valid call: {sorted(set(found) - set(VALID_CALLS))}; "
        f"no longer public: {sorted(set(VALID_CALLS) - set(found))}")
    kinds = {kind for kind, _ in found}
    assert kinds == set(KINDS)  # each kind has at least one function: the search works


@pytest.mark.parametrize(("kind", "key", "call", "value"), list(_generic_cases()))
def test_generic_bad_value_is_refused_by_name(kind, key, call, value) -> None:
    name = discovered()[(kind, key)] if kind != "answers" else "answers"
    check_row(refused(key, "range" if kind != "answers" else "dtype", lambda: call(value), rf"{name}\b"))


def test_measure_reads_column_advantages_as_per_sequence() -> None:
    """``measure(..., advantages=adv[:, None])`` (``[B, 1]``) is accepted and means ``[B]``
    (documented in docs/guarantees.md; issue 30)."""
    from sparsecorr import correction

    old, roll = -torch.rand(3, 5) * 3, -torch.rand(3, 5) * 3
    adv, m = torch.tensor([1.0, -1.0, -0.5]), torch.ones(3, 5, dtype=torch.bool)
    col = mismatch.measure(old, roll, m, advantages=adv[:, None])
    row = mismatch.measure(old, roll, m, advantages=adv)
    for delta in (0.0, 0.5, 1e3):
        opsm = correction.get_preset("opsm", delta=delta)
        assert torch.equal(opsm(col).mask, opsm(row).mask)
