"""``sparsecorr demo`` (provided by sparsecorr-trl through an entry point): end to end, the
report, the plots, failure reporting and the messages when something is missing."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from sparsecorr import cli
from sparsecorr.cli import main
from sparsecorr.schedules import BudgetSchedule

pytest.importorskip("trl")
from sparsecorr_trl.demo import command, report
from sparsecorr_trl.demo import run as demo_run

ARMS = set(demo_run.ARM_NAMES)
PNGS = ("calibration.png", "curves.png", "memory_speed.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group=cli.PLUGIN_GROUP)}
    assert eps.get("demo") == "sparsecorr_trl.demo.command", (
        "sparsecorr-trl is installed without its entry point: reinstall it (make venv)")


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
    by_arm = {a: [r for r in rows if r["arm"] == a] for a in ARMS}
    # both aggressive arms sample with the aggressive budget; only the corrected one corrects
    for arm in ("sparse-uncorrected", "sparse-corrected"):
        assert {r["mean_budget"] for r in by_arm[arm]} == {8.0}
    assert all("sparsecorr/correction/kept_token_frac" in r for r in by_arm["sparse-corrected"])
    assert not any("sparsecorr/correction/kept_token_frac" in r
                   for r in by_arm["sparse-uncorrected"])
    assert all(r["kl_k3"] == r["kl_k3"] and r["tokens_per_s"] > 0 for r in rows)
    peak = {a: max(r["peak_kv_bytes"] for r in rs) for a, rs in by_arm.items()}
    assert peak["sparse-uncorrected"] < peak["dense"]
    schedule = BudgetSchedule.load(out / "schedule.json")
    assert len(schedule.budgets) >= 1
    text = (out / "report.md").read_text()
    assert "| arm |" in text and "## What each arm shows" in text
    assert "What the correction buys" in text and "What the schedule buys" in text
    for png in PNGS:
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
        assert f"![{png}]({png})" in text


def _rows(arm, rewards, tps, *, kept=None):
    rows = []
    for i, (rew, t) in enumerate(zip(rewards, tps)):
        row = {"arm": arm, "step": i, "reward": rew, "dense_eval_reward": rew, "tokens_per_s": t,
               "peak_kv_bytes": 1000 if arm == "dense" else 250, "kl_k3": 0.0 if arm == "dense" else 0.5}
        if kept is not None:
            row["sparsecorr/correction/kept_token_frac"] = kept
        rows.append(row)
    rows[0]["dense_eval_reward_before"] = 0.9
    return rows


def test_summary_excludes_the_warm_up_step():
    (s,) = report.summarize(_rows("dense", [0.9, 0.9, 0.9], [5.0, 100.0, 120.0]))
    assert s["tokens_per_s"] == pytest.approx(110.0)
    assert s["reward_first"] == 0.9 and s["dense_after"] == 0.9


def test_verdict_follows_the_numbers():
    def by(unc_after, cor_after, kept):
        rows = (_rows("dense", [0.9, 0.9], [100, 100])
                + _rows("sparse-uncorrected", [0.9, unc_after], [100, 100])
                + _rows("sparse-corrected", [0.9, cor_after], [100, 100], kept=kept)
                + _rows("sparse-schedule-corrected", [0.9, 0.9], [100, 100], kept=1.0))
        return " ".join(report.verdict({s["arm"]: s for s in report.summarize(rows)}))

    damaged = by(0.3, 0.88, 0.7)
    assert "damaged it" in damaged and "0.880, higher than without correction" in damaged
    fine = by(0.9, 0.9, 0.01)
    assert "no damage shows at this scale" in fine and "about the same as without correction" in fine
    assert "discarding these rollouts" in fine and "discarding" not in damaged


def test_each_plot_png_is_written(tmp_path):
    import torch

    # the plots read only these fields of a CalibrationTable / BudgetSchedule
    table = SimpleNamespace(budgets=[8, 16], bin_size=8, q=0.05,
                            values=torch.tensor([[0.5, 0.2, float("nan")], [0.99, 0.95, 0.9]]))
    schedule = SimpleNamespace(budgets=[16, 16, None], bin_size=8)
    rows = (_rows("dense", [0.9, 0.95, 1.0], [10, 100, 100])
            + _rows("sparse-uncorrected", [0.1, 0.1, 0.2], [10, 150, 150]))
    files = report.write_plots(tmp_path, rows, table, schedule, 0.86)
    assert files == list(PNGS)
    for png in PNGS:
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC
    assert not list(tmp_path.glob(".*.tmp.png"))


def test_failure_report_names_the_step_and_keeps_finished_arms(tmp_path, monkeypatch):
    real = demo_run.train_arm

    def train_arm(arm, **kw):
        if arm.name == "sparse-uncorrected":
            raise RuntimeError("simulated crash")
        return real(arm, **kw)

    monkeypatch.setattr(demo_run, "train_arm", train_arm)
    cfg = demo_run.DemoConfig(steps=1, prompts_per_step=1, group=2, max_new_tokens=8,
                              budgets=(8,), bin_size=8)
    with pytest.raises(demo_run.DemoError, match="training arm sparse-uncorrected failed"):
        demo_run.run_demo(cfg, tmp_path, progress=False)
    text = (tmp_path / "report.md").read_text()
    assert "failed during training arm sparse-uncorrected" in text and "simulated crash" in text
    assert "Calibration finished" in text and "| dense |" in text


def test_missing_dependency_is_named_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(command.REQUIREMENTS, "no_such_module_xyz", "no-such-dist")
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no-such-dist" in err and "pip install 'sparsecorr[demo]'" in err
    assert not out.exists()  # nothing ran


def test_demo_without_the_glue_says_which_extra(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_plugin_modules", lambda: {})
    assert main(["demo", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "sparsecorr demo: not installed: pip install 'sparsecorr[demo]'"
    assert "integrations/" not in err and "-e " not in err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "demo" in capsys.readouterr().out


def test_broken_plugin_is_reported_not_raised(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_plugin_modules", lambda: {"demo": "no_such_pkg_xyz.command"})
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'sparsecorr[demo]'" in err and "no_such_pkg_xyz" in err
