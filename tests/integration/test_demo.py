"""``sparsecorr demo --quick`` end to end: outputs exist and are well-formed."""

from __future__ import annotations

import json

from sparsecorr.cli import main
from sparsecorr.schedules import BudgetSchedule

ARMS = {"dense", "sparse-uncorrected", "sparse-schedule-corrected"}


def test_demo_quick(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert all(arm in printed for arm in ARMS)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in rows} == ARMS
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    assert all(0.0 <= r["dense_eval_reward"] <= 1.0 for r in rows)
    assert {r["step"] for r in rows if r["arm"] == "dense"} == {0, 1, 2}
    # the uncorrected arm samples with the aggressive budget, the others record rollout stats
    assert {r["mean_budget"] for r in rows if r["arm"] == "sparse-uncorrected"} == {8.0}
    assert all(r["kl_k3"] == r["kl_k3"] and r["tokens_per_s"] > 0 for r in rows)
    sparse = [r for r in rows if r["arm"] == "sparse-uncorrected"]
    dense = [r for r in rows if r["arm"] == "dense"]
    assert max(r["peak_kv_bytes"] for r in sparse) < max(r["peak_kv_bytes"] for r in dense)
    schedule = BudgetSchedule.load(out / "schedule.json")
    assert len(schedule.budgets) >= 1
    report = (out / "report.md").read_text()
    assert "| arm |" in report and "Outcome:" in report and "dense greedy reward" in report
    for png in ("calibration.png", "curves.png", "memory_speed.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
