import itertools
import json
import math
import warnings

import pytest
import torch

from sparsecorr.schedules import (
    SPARROW_PRESETS,
    BudgetSchedule,
    CalibrationTable,
    CostModel,
    TailController,
    fit_schedule,
)


def test_sparrow_presets_are_the_published_pages():
    s = BudgetSchedule.preset("sparrow-qwen3-1.7b-0.86")
    assert s.to_pages() == [29, 61, 93, 93, 125, 157, 189, 221, 221] + [253] * 11
    assert s.budgets[0] == (29 + 3) * 16 and s.bin_size == 2000
    assert len(SPARROW_PRESETS["sparrow-qwen3-4b-0.86"]) == 20
    assert BudgetSchedule.preset("sparrow-qwen3-8b-0.86").to_pages()[-3:] == [385, 445, 445]
    assert s.budget_at(0) == 512 and s.budget_at(1999) == 512 and s.budget_at(10**6) == 256 * 16
    assert "Sparrow" in s.meta["citation"]["paper"] and s.meta["citation"]["arxiv"]
    assert s.meta["tau"] == 0.86 and s.meta["model"] == "Qwen/Qwen3-1.7B"
    assert sorted(SPARROW_PRESETS) == [f"sparrow-qwen3-{k}-0.86" for k in ("1.7b", "4b", "8b")]


def test_schedule_json_roundtrip_and_field_errors(tmp_path):
    s = BudgetSchedule(bin_size=100, budgets=(64, 128, None), meta={"tau": 0.86})
    path = s.save(tmp_path / "s.json")
    assert BudgetSchedule.load(path) == s and BudgetSchedule.load(path).meta == {"tau": 0.86}
    data = json.loads(path.read_text())
    for key, value, field in [("budgets", [64, -1], r"budgets\[1\]"), ("bin_size", 0, "bin_size"),
                              ("format", "v0", "format"), ("budgets", "64", "budgets")]:
        bad = dict(data, **{key: value})
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=field):
            BudgetSchedule.load(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        BudgetSchedule.load(tmp_path / "broken.json")
    assert "dense" in s.table()


def _table(tails, bin_size=10, n=400):
    """A table whose tail acceptance per (budget, bin) is ~tails[budget][bin]."""
    budgets = sorted(tails)
    table = CalibrationTable(budgets=budgets, bin_size=bin_size, n_bins=len(next(iter(tails.values()))))
    for b, per_bin in tails.items():
        for i, t in enumerate(per_bin):
            acc = torch.full((1, n), float(t))
            table.add(b, acc, torch.ones(1, n, dtype=torch.bool), torch.tensor([i * bin_size]))
    return table


def test_fit_picks_cheapest_feasible_monotone_and_warns_on_dense_fallback():
    table = _table({8: [0.99, 0.80, 0.70], 16: [0.99, 0.95, 0.80], 32: [0.99, 0.99, 0.85]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = fit_schedule(table, tau=0.9)
    assert s.budgets == (8, 16, None)
    assert s.meta["dense_fallback_bins"] == [2]
    assert any("bins [2]" in str(w.message) for w in caught)
    assert fit_schedule(table, tau=0.9, max_steps=2).budgets in [(16, 16, None), (8, None, None)]


def test_table_json_roundtrip_merge_and_errors(tmp_path):
    a, b = _table({8: [0.9, 0.8]}), _table({8: [0.9, 0.8], 16: [0.95, 0.9]})
    path = a.save(tmp_path / "t.json")
    back = CalibrationTable.load(path)
    torch.testing.assert_close(back.values, a.values, equal_nan=True)
    merged = back.merge(b)
    assert merged.budgets == [8, 16] and int(merged.counts[0].sum()) == 1600
    data = json.loads(path.read_text())
    data["cells"]["8"][0][0] = 99
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"cells\.8"):
        CalibrationTable.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="q"):
        a.merge(CalibrationTable(budgets=[8], bin_size=10, n_bins=2, q=0.5))


def test_cost_model_matches_closed_forms():
    cm = CostModel(params=1e9, num_layers=2, kv_dim=256, gqa_ratio=4, intensity=100.0)
    n, l_in, l_out, b = 4, 100, 50, 32
    d, r, nl, ps = 256, 4, 2, 16
    dense = 2 * 1e9 * n * l_out + nl * r * (2 * l_in + l_out - 1) * l_out * n * d
    dense_mem = nl * 2 * (2 * l_in * l_out * d + n * (l_out - 1) * l_out * d)
    assert cm.cost(n=n, l_in=l_in, l_out=l_out) == pytest.approx(dense + 100 * dense_mem)
    t_sum = (l_out - 1) * l_out / 2
    sparse = (2 * n * 1e9 * l_out + nl * (2 * r * n * d * b * l_out + 2 * n * l_in * d * l_out
                                           + r * n * d * t_sum / ps))
    sparse_mem = nl * 2 * (2 * n * d * b * l_out + 2 * l_in * d * l_out + n * d * t_sum / ps)
    steps = cm.budget_steps(n=n, l_in=l_in, l_out=l_out, budget=b)
    assert steps.sum() == pytest.approx(sparse + 100 * sparse_mem)


@pytest.mark.parametrize("size", ["1.7b", "4b", "8b"])
def test_cost_model_against_the_paper(size):
    """Predicted rollout speedup of each Sparrow preset on its Qwen3 config at 32k generation:
    the model's speedup grows with length (the paper's qualitative claim); the values are
    recorded in the docs next to Sparrow's measured 2.21x / 2.41x / 2.06x."""
    cm = CostModel.from_config(f"qwen3-{size}", intensity="h100")
    s = BudgetSchedule.preset(f"sparrow-qwen3-{size}-0.86")
    speedups = [cm.speedup(s, n=8, l_in=512, l_out=lo) for lo in (4096, 8192, 16384, 32768)]
    assert all(a < b for a, b in itertools.pairwise(speedups))
    assert speedups[-1] > 2.0


def test_larger_models_need_larger_budgets_for_the_same_tau():
    mean = {k: sum(BudgetSchedule.preset(k).budgets) / 20 for k in SPARROW_PRESETS}
    assert mean["sparrow-qwen3-4b-0.86"] > mean["sparrow-qwen3-1.7b-0.86"]
    assert mean["sparrow-qwen3-8b-0.86"] > mean["sparrow-qwen3-1.7b-0.86"]
    # bin by bin the claim holds at long context (>= 14k tokens) only; 8B vs 4B is not monotone
    small, *large = (BudgetSchedule.preset(f"sparrow-qwen3-{k}-0.86").budgets for k in ("1.7b", "4b", "8b"))
    for big in large:
        assert all(b >= a for a, b in zip(small[7:], big[7:], strict=True))
        assert any(b > a for a, b in zip(small[7:], big[7:], strict=True))


def test_controller_raises_lowers_logs_and_checkpoints():
    s = BudgetSchedule(bin_size=10, budgets=(16, 16))
    ctl = TailController(s, candidates=[8, 16, 32], tau=0.9, margin=0.05, patience=2, min_tokens=5)
    mask = torch.ones(1, 20, dtype=torch.bool)
    acc = torch.cat([torch.full((1, 10), 0.99), torch.full((1, 10), 0.5)], 1)
    ctl.observe(acc, mask)
    assert ctl.step().budgets == (16, 32)  # bin 1 below tau: raised
    assert ctl.log[-1]["bin"] == 1 and ctl.log[-1]["reason"] == "below tau"
    ctl.observe(acc, mask)
    s2 = ctl.step()  # bin 0 comfortable twice: lowered; bin 1 still low: raised to dense
    assert s2.budgets == (8, None)
    back = TailController.from_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert back.schedule == ctl.schedule and back.log == ctl.log and back.steps == 2


def test_cost_model_errors():
    with pytest.raises(ValueError, match="config"):
        CostModel.from_config("qwen9")
    with pytest.raises(ValueError, match="intensity"):
        CostModel.from_config("qwen3-4b", intensity="tpu")
    assert math.isclose(CostModel.from_config("qwen3-4b").gqa_ratio, 4.0)


def test_prompt_only_leading_bins_do_not_force_dense():
    """Bins before the first generated token (prompt positions only) accept any budget."""
    table = CalibrationTable(budgets=[8, 16], bin_size=10, n_bins=4)
    for b in (8, 16):  # generated tokens start at position 20 (a 20-token prompt)
        table.add(b, torch.full((1, 20), 0.99), torch.ones(1, 20, dtype=torch.bool), torch.tensor([20]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no dense-fallback warning either
        s = fit_schedule(table, tau=0.9)
    assert s.budgets == (8, 8, 8, 8)


def test_dp_cost_matrix_is_the_cost_models_sum_for_the_schedule():
    """Bin i of the DP costs the decode steps whose total context (prompt + generated) falls in
    bin i: summed over a schedule it is exactly CostModel.cost of that schedule."""
    from sparsecorr.schedules import schedule_cost_matrix

    cm = CostModel.from_config("qwen3-1.7b")
    budgets, n_bins, bin_size = [64, 256], 4, 300
    for l_in in (0, 120, 700):
        cost = schedule_cost_matrix(budgets, n_bins, bin_size, cm, n=3, l_in=l_in)
        for choice in itertools.product(range(3), repeat=n_bins):
            sched = BudgetSchedule(bin_size, tuple(None if c == 2 else budgets[c] for c in choice))
            total = sum(cost[i, c] for i, c in enumerate(choice))
            want = cm.cost(n=3, l_in=l_in, l_out=n_bins * bin_size - l_in, budget=sched)
            assert total == pytest.approx(want, rel=1e-9, abs=1e-3), (l_in, choice)


def test_fit_warnings_name_the_reason_and_point_at_the_caller():
    table = CalibrationTable(budgets=[8, 16], bin_size=10, n_bins=4)
    for b, level in ((8, 0.5), (16, 0.5)):  # bins 0-1 calibrated but below tau; 2-3 empty
        table.add(b, torch.full((1, 20), level), torch.ones(1, 20, dtype=torch.bool))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = fit_schedule(table, tau=0.9)
    messages = [str(w.message) for w in caught]
    assert messages == [
        "fit_schedule: no budget reaches tau=0.9 in bins [0, 1] (context 0-10, 10-20); they fall back to dense",
        "fit_schedule: no calibrated tokens in bins [2, 3] (context 20-30, 30-40); they fall back to dense",
    ]
    assert all(w.filename == __file__ for w in caught)  # the user's line, not the library's
    assert s.meta["dense_fallback_bins"] == [0, 1, 2, 3] and s.meta["uncalibrated_bins"] == [2, 3]


def test_loading_a_hand_edited_file_names_the_field_and_the_file(tmp_path):
    table = _table({8: [0.9, 0.8]})
    path = table.save(tmp_path / "calibration.json")
    data = json.loads(path.read_text())
    for edit, field in ((lambda d: d.pop("n_bins"), "n_bins: missing"),
                        (lambda d: d.__setitem__("q", 1.5), "q: expected a number in"),
                        (lambda d: d["cells"]["8"].append([0, 0]), r"cells\.8\[\d+\]: expected"),
                        (lambda d: d.__setitem__("budgets", [8, "16"]), r"budgets\[1\]: expected")):
        bad = json.loads(json.dumps(data))
        edit(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=field + r".*\(in the calibration table .*bad\.json\)"):
            CalibrationTable.load(tmp_path / "bad.json")
    s = BudgetSchedule(bin_size=10, budgets=(8, None)).save(tmp_path / "s.json")
    bad = json.loads(s.read_text())
    bad["bin_size"] = "10"
    s.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bin_size: expected an int, got '10' \(in the schedule file .*s\.json\)"):
        BudgetSchedule.load(s)


def test_table_size_is_checked_before_allocating():
    import time

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"n_bins: .*8 KiB.*10,000,000 bins = 76\.3 GiB"):
        CalibrationTable(budgets=[8], n_bins=10**7)
    assert time.perf_counter() - t0 < 1.0
    CalibrationTable(budgets=list(range(1, 19)), n_bins=20)  # Sparrow's grid is fine


def test_cost_model_refuses_negative_sizes_and_shares_the_default_inputs():
    from sparsecorr.schedules.cost import DEFAULT_L_IN, DEFAULT_N

    with pytest.raises(ValueError, match="kv_dim: expected an int >= 1, got -8"):
        CostModel(params=1e9, num_layers=2, kv_dim=-8, gqa_ratio=1)
    cm = CostModel.from_config("qwen3-4b")
    s = BudgetSchedule.preset("sparrow-qwen3-4b-0.86")
    assert cm.speedup(s) == cm.speedup(s, n=DEFAULT_N, l_in=DEFAULT_L_IN, l_out=32768)
    table = _table({512: [0.99] * 4}, bin_size=2000)
    fitted = fit_schedule(table, tau=0.9, cost_model=cm)
    assert fitted.meta["speedup_inputs"] == {"n": DEFAULT_N, "l_in": DEFAULT_L_IN, "l_out": 8000,
                                             "intensity": cm.intensity}
    assert fitted.meta["predicted_speedup"] == cm.speedup(fitted, l_out=8000)
