"""``sparsecorr demo`` (provided by sparsecorr-trl through an entry point): end to end, the
report, the plots, failure reporting and the messages when something is missing."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
import shutil
import warnings
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparsecorr import cli
from sparsecorr.cli import main
from sparsecorr.schedules import BudgetSchedule

pytest.importorskip("trl")
from sparsecorr_trl.demo import command, report
from sparsecorr_trl.demo import run as demo_run
from sparsecorr_trl.demo.plots import write_plots

QUICK = demo_run.DemoConfig.quick()
ARMS = set(demo_run.arm_names(QUICK))
#: the quick run's sparse samplers, each run with and without sparse_rl()
SAMPLERS = ("b8", "b16", "schedule", "topk12", "b16@24", "rkv16@24")
PNGS = report.PNGS
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group=cli.PLUGIN_GROUP)}
    assert eps.get("demo") == "sparsecorr_trl.demo.command", (
        "sparsecorr-trl is installed without its entry point: reinstall it (make venv)")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``sparsecorr demo --quick`` once for the tests below: (out dir, printed text)."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a warning the demo does not silence is recorded
        rc = main(["demo", "--quick", "--out", str(out)])
    assert rc == 0
    return out, buf.getvalue(), err.getvalue(), [str(w.message) for w in caught]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_demo_quick(quick_run):
    out, printed, _, _ = quick_run
    assert all(arm in printed for arm in ARMS)
    rows = _metrics(out)
    assert {r["arm"] for r in rows} == ARMS
    assert all(r["seed"] == 0 for r in rows)
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    assert all(0.0 <= r["dense_eval_reward"] <= 1.0 for r in rows)  # quick evaluates every step
    assert {r["step"] for r in rows if r["arm"] == "dense"} == {0, 1, 2}
    by_arm = {a: [r for r in rows if r["arm"] == a] for a in ARMS}
    # the study crosses every sparse sampler with the correction: same sampler, both corrections
    samplers = {r["sampler"] for r in rows} - {"dense", "dense@24"}
    assert samplers == set(SAMPLERS)
    for s in samplers:
        assert {r["correction"] for r in rows if r["sampler"] == s} >= {"none", "sparse_rl"}
    for arm in ("b8/none", "b8/sparse_rl"):
        assert {r["mean_budget"] for r in by_arm[arm]} == {8.0}
    for arm in ("rkv16@24/none", "rkv16@24/sparse_rl"):
        assert {r["mean_budget"] for r in by_arm[arm]} == {16.0}
    for arm, rs in by_arm.items():
        corrected = rs[0]["correction"] != "none"
        assert all(("sparsecorr/correction/kept_token_frac" in r) == corrected for r in rs), arm
    distill = [a for a in ARMS if a.endswith("+distill")]
    assert distill == ["topk12/sparse_rl+distill"]
    assert all(any(k.startswith("sparsecorr/distill/") for k in r) for r in by_arm[distill[0]])
    # the probe measures every sparse arm's sampler before training and at the last step,
    # corrected or not; DistillSparse also with the adapter off; dense has no sampler to probe
    for arm, rs in by_arm.items():
        probed = not rs[0]["sampler"].startswith("dense")
        assert ("probe_accept_q05_before" in rs[0]) == probed
        assert ("probe_accept_q05" in rs[-1]) == probed
        assert ("probe_accept_q05_noadapter" in rs[-1]) == arm.endswith("+distill")
        if probed:
            assert 0.0 <= rs[-1]["probe_accept_q05"] <= 1.0
            assert 0.0 <= rs[-1]["probe_rejected_frac"] <= 1.0
    assert all(r["kl_k3"] == r["kl_k3"] and r["tokens_per_s"] > 0 for r in rows)
    peak = {a: max(r["peak_kv_bytes"] for r in rs) for a, rs in by_arm.items()}
    assert peak["b8/none"] < peak["dense"]
    # every arm starts from the same shipped model on the same held-out prompts (the
    # long-response arms answer them with 24 tokens instead of 16)
    for long in (False, True):
        assert len({rs[0]["dense_eval_reward_before"] for a, rs in by_arm.items()
                    if ("@24" in a) == long}) == 1
    assert {len({r["step"] for r in rs}) for rs in by_arm.values()} == {3}
    schedule = BudgetSchedule.load(out / "schedule.json")
    assert len(schedule.budgets) >= 1
    text = (out / "report.md").read_text()
    assert "| arm |" in text and "## The claims" in text and "## What the correction buys" in text
    assert "## What each arm shows" in text
    for what in ("correction", "schedule", "DistillSparse"):
        assert f"What {what} buys" in text or f"What the {what} buys" in text
    for png in PNGS:
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
        assert f"![{png}]({png})" in text


def test_demo_does_not_show_trl_warnings_or_loading_bars(quick_run):
    """TRL 1.16 reads ``model.is_gradient_checkpointing`` (a transformers 5 FutureWarning) and
    transformers draws a "Loading weights" bar per ``from_pretrained``: the demo shows neither
    (recorded here with every warning filter set to "always")."""
    _, printed, err, caught = quick_run
    assert not [w for w in caught if "is_gradient_checkpointing" in w]
    assert "Loading weights" not in err + printed
    assert "is_gradient_checkpointing" not in err + printed


def _paired_diff(rows, a, b):
    """Per seed, final held-out greedy reward of arm a minus arm b, from the rows alone."""
    def final(arm, seed):
        vals = [r["dense_eval_reward"] for r in rows if r["arm"] == arm and r["seed"] == seed
                and r["dense_eval_reward"] == r["dense_eval_reward"]]
        return vals[-1]
    seeds = sorted({r["seed"] for r in rows if r["arm"] == a})
    return [final(a, s) - final(b, s) for s in seeds]


def test_quick_report_comes_from_metrics_jsonl(quick_run):
    """The report's numbers and sentences are those computed from metrics.jsonl: recomputed
    here from the rows alone, and the report's verdicts follow them."""
    out, printed, _, _ = quick_run
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
        probes = [r["probe_accept_q05"] for r in rs if "probe_accept_q05" in r]
        if probes:
            assert f"| {sum(probes) / len(probes):.3f} |" in line
        assert f"{before:.3f} -> {after:.3f}" in printed
    # the correction table: per sampler, uncorrected and corrected finals and their difference
    for s in SAMPLERS:
        (diff,) = _paired_diff(rows, f"{s}/sparse_rl", f"{s}/none")
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {s} |"))
        assert line.startswith(f"| {s} | {first[s + '/none'][1]:.3f} | "
                               f"{first[s + '/sparse_rl'][1]:.3f} | {diff:+.3f} |")
        assert ("above the one-seed margin" in line) == (diff > report.ONE_SEED_MARGIN)
    # the sentences are what claims() / findings() say about these rows, verbatim
    by = {s["arm"]: s for s in report.summarize(rows)}
    config = json.loads((out / "run.json").read_text())["config"]
    checked = report.claims(by, config)
    assert [name for name, _, _ in checked] == ["dense improves", "schedule matches dense",
                                                "uncorrected below dense",
                                                "correction rescues a sampler",
                                                "DistillSparse raises the tail",
                                                "correction under R-KV"]
    word = {True: "holds", False: "does not hold", None: "not checked"}
    for name, ok, sentence in checked:
        assert f"- **{name}: {word[ok]}.** {sentence}" in text
    for line in report.findings(by, config):
        assert f"- {line}" in text
    # and the verdicts follow the numbers as recomputed here
    (d0, d1), (_, u1) = first["dense"], first["b8/none"]
    assert checked[0][1] == (d1 - d0 > report.CLEAR_GAIN)
    assert checked[2][1] == (d1 - u1 > report.ONE_SEED_MARGIN)
    assert f"{d0:.3f} to {d1:.3f}" in checked[0][2]
    m = report.ONE_SEED_MARGIN
    dense_final = {s: first["dense@24" if "@24" in s else "dense"][1] for s in SAMPLERS}
    rescued = [s for s in SAMPLERS
               if dense_final[s] - first[f"{s}/none"][1] > m
               and dense_final[s] - first[f"{s}/sparse_rl"][1] <= m
               and _paired_diff(rows, f"{s}/sparse_rl", f"{s}/none")[0] > m]
    assert checked[3][1] == bool(rescued)
    dis = [r for r in rows if r["arm"] == "topk12/sparse_rl+distill" and "probe_accept_q05" in r]
    lift = sum(r["probe_accept_q05"] - r["probe_accept_q05_noadapter"] for r in dis) / len(dis)
    assert checked[4][1] == (lift > m)
    (rkv,) = _paired_diff(rows, "rkv16@24/sparse_rl", "rkv16@24/none")
    assert checked[5][1] == (rkv > m) and f"{rkv:+.3f}" in checked[5][2]
    # one seed decides nothing: no sentence or table of this report calls anything resolved
    assert "resolved" not in text.lower()
    # --report-only rebuilds the same report from the run's files
    assert main(["demo", "--report-only", "--out", str(out)]) == 0
    assert (out / "report.md").read_text() == text


def _rows(arm, seed, before, after, *, kv=None, kept=None, steps=3, reward=0.5, probe=None):
    """Synthetic rows of one arm and seed; ``probe``: (acceptance tail, rejected fraction)."""
    sampler, _, correction = arm.partition("/")
    rows = []
    for i in range(steps):
        row = {"arm": arm, "sampler": sampler, "correction": correction or "none", "seed": seed,
               "step": i, "reward": reward, "tokens_per_s": 5.0 if i == 0 else 100.0,
               "dense_eval_reward": after if i == steps - 1 else float("nan"),
               "peak_kv_bytes": kv or (1000 if arm == "dense" else 250),
               "kl_k3": 0.0 if arm == "dense" else 0.5, "mismatch_max": 0.0 if arm == "dense" else 9.0}
        if kept is not None:
            row["sparsecorr/correction/kept_token_frac"] = kept
        if probe is not None:
            row.update(probe_accept_q05=probe[0], probe_rejected_frac=probe[1],
                       probe_vetoed_frac=0.0, probe_ess=0.95, probe_log_ratio_q05=-1.0,
                       probe_reward=reward)
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


def test_interval_is_the_paired_t_interval():
    m, sd, lo, hi = report.interval([0.1, 0.2, 0.3])
    assert m == pytest.approx(0.2) and sd == pytest.approx(0.1)
    assert (lo, hi) == (pytest.approx(0.2 - 4.303 * 0.1 / 3 ** 0.5),
                        pytest.approx(0.2 + 4.303 * 0.1 / 3 ** 0.5))
    assert report.interval([0.1])[2] != report.interval([0.1])[2]  # one value: no interval


def _claims(dense_after, sched_after, unc_after, *, sched_kv=400, mid=None, distill=None):
    """Synthetic study over three seeds; ``mid``: (uncorrected, corrected) finals of a sampler
    ``b16`` that finds rewards; ``distill``: (tail with, tail without the adapter)."""
    rows = []
    for seed, jitter in enumerate((-0.02, 0.0, 0.02)):
        rows += _rows("dense", seed, 0.3, dense_after + jitter)
        rows += _rows("b8/none", seed, 0.3, unc_after + jitter, reward=0.05, probe=(0.2, 0.4))
        rows += _rows("b8/sparse_rl", seed, 0.3, unc_after + jitter, kept=0.5, reward=0.05,
                      probe=(0.2, 0.4))
        rows += _rows("schedule/sparse_rl", seed, 0.3, sched_after + jitter, kv=sched_kv,
                      kept=0.9, probe=(0.8, 0.05))
        if mid is not None:
            rows += _rows("b16/none", seed, 0.3, mid[0] + jitter, probe=(0.6, 0.1))
            rows += _rows("b16/sparse_rl", seed, 0.3, mid[1] + 2 * jitter, kept=0.9,
                          probe=(0.6, 0.1))
        if distill is not None:
            rs = _rows("b8/sparse_rl+distill", seed, 0.3, unc_after, probe=(distill[0], 0.4))
            for r in rs:
                r["probe_accept_q05_noadapter"] = distill[1] + jitter
            rows += rs
    by = {s["arm"]: s for s in report.summarize(rows)}
    return {name: (ok, sentence) for name, ok, sentence in report.claims(by, {"tau": 0.5})}


def test_claims_follow_the_numbers():
    good = _claims(0.8, 0.79, 0.5)
    assert all(ok for name, (ok, _) in good.items() if name in (
        "dense improves", "schedule matches dense", "uncorrected below dense"))
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


def test_correction_claim_holds_only_where_the_numbers_show_the_regime():
    # a sampler that finds rewards, uncorrected below dense, corrected at dense's level
    rescued = _claims(0.8, 0.79, 0.5, mid=(0.6, 0.8))["correction rescues a sampler"]
    assert rescued[0] is True and "With b16, uncorrected training ends measurably below" in rescued[1]
    # the same, but the corrected arm's seeds scatter so the difference is not resolved
    # (jitter doubled on one arm only keeps it resolved: a shift of 0.2 over sd 0.02)
    harmless = _claims(0.8, 0.79, 0.5, mid=(0.8, 0.79))["correction rescues a sampler"]
    assert harmless[0] is False
    assert "b16: harmless" in harmless[1] and "b8: fails outright" in harmless[1]
    assert "none sits between the two" in harmless[1]
    both = _claims(0.8, 0.79, 0.5, mid=(0.5, 0.5))["correction rescues a sampler"]
    assert both[0] is False and "b16: both below dense" in both[1]
    # only a sampler that fails outright: said so, with the period of the task
    fails = _claims(0.8, 0.79, 0.5)["correction rescues a sampler"]
    assert fails[0] is False and "b8 fails outright" in fails[1] and "15 positions back" in fails[1]


def test_distill_claim_follows_the_tail_with_and_without_the_adapter():
    up = _claims(0.8, 0.79, 0.5, distill=(0.6, 0.2))["DistillSparse raises the tail"]
    assert up[0] is True and "from 0.200" in up[1] and "to 0.600" in up[1]
    assert "tau = 0.5 is reached" in up[1] and "resolved by the seeds" in up[1]
    flat = _claims(0.8, 0.79, 0.5, distill=(0.2, 0.2))["DistillSparse raises the tail"]
    assert flat[0] is False and "not resolved" in flat[1] and "tau = 0.5 is not reached" in flat[1]


def _study(seeds, *, rescued: bool):
    """Synthetic study: dense, an aggressive sampler that fails (b8), a sampler b16 whose
    uncorrected arm ends below dense and whose corrected arm reaches it (``rescued``) or not,
    the schedule, and DistillSparse at b16 raising the tail and the reward (or lowering them)."""
    rows = []
    for seed in seeds:
        j = 0.01 * seed
        rows += _rows("dense", seed, 0.3, 0.6 + j)
        rows += _rows("b8/none", seed, 0.3, 0.1 + j, reward=0.05, probe=(0.2, 0.4))
        rows += _rows("b8/sparse_rl", seed, 0.3, 0.1 + j, kept=0.5, reward=0.05, probe=(0.2, 0.4))
        rows += _rows("schedule/sparse_rl", seed, 0.3, 0.6 + j, kv=400, kept=0.9, probe=(0.8, 0.05))
        rows += _rows("b16/none", seed, 0.3, 0.4 + j, probe=(0.6, 0.1))
        rows += _rows("b16/sparse_rl", seed, 0.3, (0.6 if rescued else 0.38) + 2 * j, kept=0.9,
                      probe=(0.6, 0.1))
        rs = _rows("b16/sparse_rl+distill", seed, 0.3, (0.7 if rescued else 0.3) + j,
                   probe=(0.6 if rescued else 0.1, 0.1))
        for r in rs:
            r["probe_accept_q05_noadapter"] = 0.2 + j
        rows += rs
    return rows


def _write_study_report(out, rows, monkeypatch):
    """report.md of synthetic rows (the plots, drawn by test_each_plot_png_is_written, are
    skipped: they cost seconds and say nothing about the text)."""
    import torch

    monkeypatch.setattr(report, "write_plots", lambda *a, **k: [])

    table = SimpleNamespace(budgets=[8, 16], bin_size=8, q=0.05,
                            values=torch.tensor([[0.5, 0.2, float("nan")], [0.99, 0.95, 0.9]]))
    schedule = SimpleNamespace(budgets=[16, 16, None], bin_size=8)
    report.write_report(out, rows=rows, table=table, schedule=schedule,
                        config={"tau": 0.5, "aggressive_budget": 8, "prompt_len": 16},
                        calib_s=1.0, train_s=2.0)
    return (out / "report.md").read_text()


@pytest.mark.parametrize("rescued", [True, False])
def test_a_one_seed_report_never_says_resolved(tmp_path, monkeypatch, rescued):
    """One seed has no interval: whatever the numbers (here a sampler the correction lifts by
    far more than the margin, and DistillSparse raising tail and reward, or neither), no
    sentence or table of the report calls anything resolved, and it says one seed decides
    nothing."""
    text = _write_study_report(tmp_path, _study([0], rescued=rescued), monkeypatch)
    assert "resolved" not in text.lower()
    assert "one seed decides nothing" in text
    assert "| vs one-seed margin |" in text
    assert "## Reproducibility" in text and "not deterministic across machines" in text
    assert "## The deciding comparison, seed by seed" in text
    if rescued:
        assert "| 0 | 0.600 | 0.400 | 0.600 | +0.200 |" in text


def test_a_multi_seed_report_prints_the_deciding_comparison_per_seed(tmp_path, monkeypatch):
    seeds = list(range(8))
    rows = _study(seeds, rescued=True)
    # an arm outside the claims runs over fewer seeds: the report says which ran over what
    rows = [r for r in rows if r["arm"] != "b8/sparse_rl" or r["seed"] < 3]
    text = _write_study_report(tmp_path, rows, monkeypatch)
    by = {s["arm"]: s for s in report.summarize(rows)}
    e = report.deciding_effect(by)
    assert (e["sampler"], e["regime"], e["seeds"]) == ("b16", "rescued", seeds)
    section = text[text.index("## The deciding comparison"):text.index("## The claims")]
    assert "| seed | dense | b16/none | b16/sparse_rl | difference |" in section
    for seed in seeds:
        j = 0.01 * seed
        assert f"| {seed} | {0.6 + j:.3f} | {0.4 + j:.3f} | {0.6 + 2 * j:.3f} | {0.2 + j:+.3f} |" in section
    assert f"over 8 seeds, 95% interval [{e['lo']:+.3f}, {e['hi']:+.3f}]: resolved" in section
    assert "b8/sparse_rl over 3 seeds (0, 1, 2)" in text and "over 8 seeds (0, 1, 2, 3" in text
    # b8's pair is compared on the 3 seeds both arms ran
    assert next(x for x in report.correction_effects(by) if x["sampler"] == "b8")["seeds"] == [0, 1, 2]


def test_full_runs_the_claims_arms_over_16_seeds():
    full = demo_run.DemoConfig.full()
    names = demo_run.arm_names(full)
    assert set(full.claim_arms) <= set(names)
    assert {"dense@64", "b16@64/none", "b16@64/sparse_rl", "rkv16@64/none",
            "rkv16@64/sparse_rl"} <= set(full.claim_arms)
    for arm in names:
        seeds = full.seeds_of(arm)
        assert seeds == tuple(range(16)) if arm in full.claim_arms else len(seeds) == 3, arm
    # the R-KV arms sample with RKV as its authors score it (R-KV's defaults), compressing at
    # every step past the budget like the StreamingLLM arms, on the deciding comparison's length
    from sparsecorr.decoding import get_policy
    from sparsecorr.decoding.policies import RKV

    arms = {a.name: a for a in demo_run.demo_arms(full, Path("s.json"), sink=1)}
    for c in ("none", "sparse_rl"):
        rkv, b16 = arms[f"rkv16@64/{c}"], arms[f"b16@64/{c}"]
        assert (rkv.max_new_tokens, rkv.config["budget"]) == (b16.max_new_tokens, b16.config["budget"])
        assert rkv.config["correction"] == c and rkv.sampler == "rkv16@64"
        policy = get_policy(rkv.config["policy"], **rkv.config["policy_kwargs"])
        assert policy == RKV(buffer=0) and (policy.scoring, policy.variant) == ("r_kv", "r_kv")
    bad = demo_run.DemoConfig(claim_arms=("no_such_arm",), claim_seeds=(0, 1))
    with pytest.raises(ValueError, match="claim_arms"):
        demo_run._check_claim_arms(bad, demo_run.arm_names(bad))


def test_each_plot_png_is_written(tmp_path):
    import torch

    # the plots read only these fields of a CalibrationTable / BudgetSchedule
    table = SimpleNamespace(budgets=[8, 16], bin_size=8, q=0.05,
                            values=torch.tensor([[0.5, 0.2, float("nan")], [0.99, 0.95, 0.9]]))
    schedule = SimpleNamespace(budgets=[16, 16, None], bin_size=8)
    rows = (_rows("dense", 0, 0.3, 0.6) + _rows("dense", 1, 0.3, 0.7)
            + _rows("b8/none", 0, 0.3, 0.2, probe=(0.2, 0.4))
            + _rows("b8/none", 1, 0.3, 0.1, probe=(0.3, 0.3)))
    files = write_plots(tmp_path, rows, table, schedule, 0.86, report.summarize(rows))
    assert files == list(PNGS)
    for png in PNGS:
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC
    assert not list(tmp_path.glob(".*.tmp.png"))


def test_failure_report_names_the_step_and_keeps_finished_arms(tmp_path, monkeypatch):
    real = demo_run.train_arm

    def train_arm(arm, **kw):
        if arm.name == "b8/none":
            raise RuntimeError("simulated crash")
        return real(arm, **kw)

    monkeypatch.setattr(demo_run, "train_arm", train_arm)
    cfg = demo_run.DemoConfig(steps=1, prompts_per_step=1, group=2, max_new_tokens=8,
                              budgets=(8,), bin_size=8, eval_prompts=4, probe_every=0)
    with pytest.raises(demo_run.DemoError, match=r"training arm b8/none \(seed 0\) failed"):
        demo_run.run_demo(cfg, tmp_path, progress=False)
    text = (tmp_path / "report.md").read_text()
    assert "failed during training arm b8/none (seed 0)" in text and "simulated crash" in text
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


ROOT = Path(__file__).resolve().parents[2]
FULL_RUN = ROOT / "docs" / "assets" / "demo" / "full-run"


def test_docs_full_run_is_rebuilt_from_its_shipped_metrics(tmp_path):
    """docs/getting-started.md's `--full` run: every table row, every claim and every number
    with two or more decimals in that section is what the report code computes from the run's
    shipped files (docs/assets/demo/full-run: metrics.jsonl.gz, calibration.json,
    schedule.json, run.json), rebuilt here with ``--report-only``."""
    for name in ("calibration.json", "schedule.json", "run.json"):
        shutil.copy(FULL_RUN / name, tmp_path / name)
    (tmp_path / "metrics.jsonl").write_bytes(gzip.decompress((FULL_RUN / "metrics.jsonl.gz").read_bytes()))
    config = json.loads((tmp_path / "run.json").read_text())["config"]
    # the shipped run is a --full run: its claims' arms over its claim seeds, the others over 3
    full = demo_run.DemoConfig.full()
    assert config["seeds"] == list(full.seeds) and len(config["claim_seeds"]) >= 8
    assert set(config["claim_arms"]) <= set(full.claim_arms)
    assert main(["demo", "--report-only", "--out", str(tmp_path)]) == 0
    rebuilt = (tmp_path / "report.md").read_text()
    docs = (ROOT / "docs" / "getting-started.md").read_text()
    section = docs[docs.index("### One `--full` run"):]
    tables = [ln for ln in section.splitlines() if ln.startswith("|")]
    pattern = r"- \*\*[^*]+: (holds|does not hold|not checked)\.\*\* "
    claimed = [ln for ln in section.splitlines() if re.match(pattern, ln)]
    assert len(tables) > 20
    assert len(claimed) == len([ln for ln in rebuilt.splitlines() if re.match(pattern, ln)]) == 6
    assert "| seed | dense@64 | b16@64/none | b16@64/sparse_rl | difference |" in tables
    last = config["claim_seeds"][-1]
    assert sum(ln.startswith(f"| {last} |") for ln in tables) == 1  # the deciding table
    for line in tables + claimed:
        assert line in rebuilt, line
    for number in re.findall(r"(?<![\w.])[-+]?\d+\.\d{2,}(?![\d.])", section):  # not versions
        assert number in rebuilt, number
