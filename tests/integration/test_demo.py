"""``sparsecorr demo`` (provided by sparsecorr-trl through an entry point): end to end, the
report, the plots, failure reporting and the messages when something is missing."""

from __future__ import annotations

import contextlib
import io
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
PNGS = report.PNGS
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
AGGRESSIVE = ("sparse-uncorrected", "sparse-corrected", "sparse-distill")


def test_demo_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group=cli.PLUGIN_GROUP)}
    assert eps.get("demo") == "sparsecorr_trl.demo.command", (
        "sparsecorr-trl is installed without its entry point: reinstall it (make venv)")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``sparsecorr demo --quick`` once for the tests below: (out dir, printed text)."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["demo", "--quick", "--out", str(out)])
    assert rc == 0
    return out, buf.getvalue()


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_demo_quick(quick_run):
    out, printed = quick_run
    assert all(arm in printed for arm in ARMS)
    rows = _metrics(out)
    assert {r["arm"] for r in rows} == ARMS
    assert all(r["seed"] == 0 for r in rows)
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    assert all(0.0 <= r["dense_eval_reward"] <= 1.0 for r in rows)  # quick evaluates every step
    assert {r["step"] for r in rows if r["arm"] == "dense"} == {0, 1, 2}
    by_arm = {a: [r for r in rows if r["arm"] == a] for a in ARMS}
    # the aggressive arms sample with the aggressive budget; only the uncorrected one does not
    # correct
    for arm in AGGRESSIVE:
        assert {r["mean_budget"] for r in by_arm[arm]} == {8.0}
    for arm in ("sparse-corrected", "sparse-distill"):
        assert all("sparsecorr/correction/kept_token_frac" in r for r in by_arm[arm])
    assert not any("sparsecorr/correction/kept_token_frac" in r
                   for r in by_arm["sparse-uncorrected"])
    assert all(any(k.startswith("sparsecorr/distill/") for k in r)
               for r in by_arm["sparse-distill"])
    assert all(r["kl_k3"] == r["kl_k3"] and r["tokens_per_s"] > 0 for r in rows)
    peak = {a: max(r["peak_kv_bytes"] for r in rs) for a, rs in by_arm.items()}
    assert peak["sparse-uncorrected"] < peak["dense"]
    # every arm starts from the same shipped model on the same held-out prompts
    assert len({rs[0]["dense_eval_reward_before"] for rs in by_arm.values()}) == 1
    schedule = BudgetSchedule.load(out / "schedule.json")
    assert len(schedule.budgets) >= 1
    text = (out / "report.md").read_text()
    assert "| arm |" in text and "## The three claims" in text
    assert "## What each arm shows" in text
    for what in ("correction", "schedule", "DistillSparse"):
        assert f"What {what} buys" in text or f"What the {what} buys" in text
    for png in PNGS:
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
        assert f"![{png}]({png})" in text


def test_quick_report_comes_from_metrics_jsonl(quick_run):
    """The report's numbers and sentences are those computed from metrics.jsonl: recomputed
    here from the rows alone, and the report's verdicts follow them."""
    out, printed = quick_run
    rows = _metrics(out)
    text = (out / "report.md").read_text()
    first = {}
    for arm in ARMS:
        rs = [r for r in rows if r["arm"] == arm]
        before = rs[0]["dense_eval_reward_before"]
        after = [r["dense_eval_reward"] for r in rs if r["dense_eval_reward"] == r["dense_eval_reward"]][-1]
        first[arm] = (before, after)
        peak = max(r["peak_kv_bytes"] for r in rs)
        late = [r["reward"] for r in rs[len(rs) // 2:]]
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {arm} |"))
        assert f"{before:.3f} -> {after:.3f}" in line  # one seed: no spread
        assert f"{sum(late) / len(late):.3f}" in line and f"| {peak} (" in line
        assert f"{before:.3f} -> {after:.3f}" in printed
    # the sentences are what claims() / findings() say about these rows, verbatim
    by = {s["arm"]: s for s in report.summarize(rows)}
    checked = report.claims(by)
    assert [name for name, _, _ in checked] == ["dense improves", "schedule matches dense",
                                                "uncorrected below dense"]
    word = {True: "holds", False: "does not hold", None: "not checked"}
    for name, ok, sentence in checked:
        assert f"- **{name}: {word[ok]}.** {sentence}" in text
    for line in report.findings(by):
        assert f"- {line}" in text
    # and the verdicts follow the numbers as recomputed here
    (d0, d1), (_, u1) = first["dense"], first["sparse-uncorrected"]
    assert checked[0][1] == (d1 - d0 > report.CLEAR_GAIN)
    assert checked[2][1] == (d1 - u1 > report.ONE_SEED_MARGIN)
    assert f"{d0:.3f} to {d1:.3f}" in checked[0][2]
    # --report-only rebuilds the same report from the run's files
    assert main(["demo", "--report-only", "--out", str(out)]) == 0
    assert (out / "report.md").read_text() == text


def _rows(arm, seed, before, after, *, kv=None, kept=None, steps=3):
    rows = []
    for i in range(steps):
        row = {"arm": arm, "seed": seed, "step": i, "reward": 0.5, "tokens_per_s": 5.0 if i == 0 else 100.0,
               "dense_eval_reward": after if i == steps - 1 else float("nan"),
               "peak_kv_bytes": kv or (1000 if arm == "dense" else 250),
               "kl_k3": 0.0 if arm == "dense" else 0.5, "mismatch_max": 0.0 if arm == "dense" else 9.0}
        if kept is not None:
            row["sparsecorr/correction/kept_token_frac"] = kept
        rows.append(row)
    rows[0]["dense_eval_reward_before"] = before
    return rows


def test_summary_over_seeds():
    rows = _rows("dense", 0, 0.3, 0.6) + _rows("dense", 1, 0.3, 0.8)
    (s,) = report.summarize(rows)
    assert s["seeds"] == [0, 1] and s["tokens_per_s"] == pytest.approx(100.0)  # warm-up excluded
    assert s["dense_after"] == pytest.approx(0.7) and s["gain"] == pytest.approx(0.4)
    assert s["dense_after_sd"] == pytest.approx(0.1414, abs=1e-4)
    assert report.pm(s["dense_after"], s["dense_after_sd"]) == "0.700 ± 0.141"
    (one,) = report.summarize(_rows("dense", 0, 0.3, 0.6))
    assert report.pm(one["dense_after"], one["dense_after_sd"]) == "0.600"


def _claims(dense_after, sched_after, unc_after, *, sched_kv=400):
    rows = []
    for seed, jitter in enumerate((-0.02, 0.0, 0.02)):
        rows += _rows("dense", seed, 0.3, dense_after + jitter)
        rows += _rows("sparse-uncorrected", seed, 0.3, unc_after + jitter)
        rows += _rows("sparse-corrected", seed, 0.3, unc_after + jitter, kept=0.5)
        rows += _rows("sparse-schedule-corrected", seed, 0.3, sched_after + jitter, kv=sched_kv,
                      kept=0.9)
    by = {s["arm"]: s for s in report.summarize(rows)}
    return {name: (ok, sentence) for name, ok, sentence in report.claims(by)}


def test_claims_follow_the_numbers():
    good = _claims(0.8, 0.79, 0.5)
    assert all(ok for ok, _ in good.values())
    assert "a clear margin" in good["dense improves"][1]
    assert "reaches 0.99" in good["schedule matches dense"][1]
    assert "40% of its peak KV" in good["schedule matches dense"][1]
    assert "measurably below" in good["uncorrected below dense"][1]
    above = _claims(0.6, 0.8, 0.5)  # reaching more than dense is reaching what dense reaches
    assert above["schedule matches dense"][0]
    assert "above dense by more than the seeds' spread" in above["schedule matches dense"][1]
    bad = _claims(0.32, 0.2, 0.32, sched_kv=800)
    assert not any(ok for ok, _ in bad.values())
    assert "not a clear margin" in bad["dense improves"][1]
    assert "below dense by more than the seeds' spread" in bad["schedule matches dense"][1]
    assert "above 50%" in bad["schedule matches dense"][1]
    assert "at this scale it did not end measurably below dense" in bad["uncorrected below dense"][1]


def test_each_plot_png_is_written(tmp_path):
    import torch

    # the plots read only these fields of a CalibrationTable / BudgetSchedule
    table = SimpleNamespace(budgets=[8, 16], bin_size=8, q=0.05,
                            values=torch.tensor([[0.5, 0.2, float("nan")], [0.99, 0.95, 0.9]]))
    schedule = SimpleNamespace(budgets=[16, 16, None], bin_size=8)
    rows = (_rows("dense", 0, 0.3, 0.6) + _rows("dense", 1, 0.3, 0.7)
            + _rows("sparse-uncorrected", 0, 0.3, 0.2) + _rows("sparse-uncorrected", 1, 0.3, 0.1))
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
                              budgets=(8,), bin_size=8, eval_prompts=4)
    with pytest.raises(demo_run.DemoError, match=r"training arm sparse-uncorrected \(seed 0\) failed"):
        demo_run.run_demo(cfg, tmp_path, progress=False)
    text = (tmp_path / "report.md").read_text()
    assert "failed during training arm sparse-uncorrected (seed 0)" in text and "simulated crash" in text
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


def test_sizes_and_the_full_flag(monkeypatch, capsys):
    full, default, quick = demo_run.DemoConfig.full(), demo_run.DemoConfig(), demo_run.DemoConfig.quick()
    assert len(full.seeds) >= 3 and len(default.seeds) == len(quick.seeds) == 1
    assert full.steps == default.steps and quick.steps < default.steps
    seen = {}
    monkeypatch.setattr(demo_run, "run_demo", lambda cfg, out: seen.setdefault("cfg", cfg) and [])
    assert main(["demo", "--full", "--out", "x"]) == 0 and seen["cfg"] == full
    with pytest.raises(SystemExit):
        main(["demo", "--quick", "--full"])
    capsys.readouterr()


def test_shipped_model_has_a_partial_skill_that_eviction_hurts():
    """The issue's premise: the shipped model is partly trained (greedy reward 0.2-0.5 on the
    demo's held-out prompts), and the aggressive KV budget takes most of it away."""
    import torch
    from sparsecorr_trl.demo.task import demo_model, make_prompts, recall_reward
    from sparsecorr_trl.demo.train import dense_eval_reward

    from sparsecorr.decoding import generate
    from sparsecorr.decoding.policies import StreamingLLM

    cfg = demo_run.DemoConfig()
    model = demo_model().eval()
    held_out = make_prompts(cfg.eval_prompts, cfg.prompt_len, seed=99_991)
    dense = dense_eval_reward(model, held_out, max_new_tokens=cfg.max_new_tokens)
    assert 0.2 <= dense <= 0.5
    with torch.no_grad():
        batch = generate(model, held_out, policy=StreamingLLM(sink=1), budget=cfg.aggressive_budget,
                         temperature=0.0, max_new_tokens=cfg.max_new_tokens, logprobs_topk=0)
    sparse = float(recall_reward(held_out, batch.tokens, batch.mask).mean())
    assert sparse < dense / 2
