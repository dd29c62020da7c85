"""The demo's deciding verdicts on each half of the seeds and pooled, the collapse check of the
correction claim and the R-KV claim, on synthetic metrics (no training: milliseconds)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")
from sparsecorr_trl.demo import halves, report, verdicts

T975_15 = 2.131  # t_{0.975, 15}
T975_7 = 2.365  # t_{0.975, 7}


def _rows(arm, seed, after, *, dense=False):
    sampler, _, correction = arm.partition("/")
    rows = []
    for i in range(2):
        row = {"arm": arm, "sampler": sampler, "correction": correction or "none", "seed": seed,
               "step": i, "reward": 0.3, "tokens_per_s": 100.0, "peak_kv_bytes": 1000 if dense else 250,
               "dense_eval_reward": after if i == 1 else float("nan"), "kl_k3": 0.1}
        if not dense:
            row.update(probe_accept_q05=0.4, probe_rejected_frac=0.2, probe_vetoed_frac=0.0,
                       probe_ess=0.97, probe_log_ratio_q05=-1.5, probe_reward=0.3)
        rows.append(row)
    rows[0]["dense_eval_reward_before"] = 0.19
    return rows


def _study(finals: dict[str, list[float]]) -> dict:
    """arm -> final greedy reward per seed (seed = index) -> ``by`` as the report builds it."""
    rows = []
    for arm, vals in finals.items():
        for seed, v in enumerate(vals):
            rows += _rows(arm, seed, v, dense=arm.startswith("dense"))
    return {s["arm"]: s for s in report.summarize(rows)}


def _noise(seed, n=16, sd=0.05):
    rng = random.Random(seed)
    return [rng.gauss(0.0, sd) for _ in range(n)]


def _ci(d):
    n = len(d)
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))
    t = {16: T975_15, 8: T975_7}[n]
    return m, m - t * sd / math.sqrt(n), m + t * sd / math.sqrt(n)


def test_seed_halves_are_the_two_halves_and_the_pool():
    assert halves.seed_halves(list(range(16))) == [
        ("seeds 0-7", list(range(8))), ("seeds 8-15", list(range(8, 16))),
        ("seeds 0-15 (pooled)", list(range(16)))]
    assert halves.seed_halves([3, 1, 2]) == [("seeds 1-3 (pooled)", [1, 2, 3])]
    assert halves.seed_halves([0, 2, 4, 6])[0] == ("seeds 0, 2", [0, 2])


def test_split_verdicts_are_the_paired_intervals_on_each_half():
    d, u, c = _noise(1), _noise(2), _noise(3)
    dense = [0.30 + x for x in d]
    unc = [0.25 + x for x in u]
    cor = [0.30 + (0.1 if s >= 8 else 0.0) + x for s, x in enumerate(c)]
    by = _study({"dense@64": dense, "b16@64/none": unc, "b16@64/sparse_rl": cor})
    ((e, vs),) = halves.split_rows(by)
    assert e["sampler"] == "b16@64" and len(vs) == 9
    for v in vs:
        a, b = {"correction": (cor, unc), "collapse": (unc, dense), "gap": (cor, dense)}[v["comparison"]]
        diffs = [a[s] - b[s] for s in v["seeds"]]
        m, lo, hi = _ci(diffs)
        assert (v["mean"], v["lo"], v["hi"]) == (pytest.approx(m), pytest.approx(lo), pytest.approx(hi))
        assert v["resolved"] == (1 if lo > 0 else -1 if hi < 0 else 0)
    labels = {v["label"] for v in vs}
    assert labels == {"b16@64: sparse_rl - none", "b16@64: none - dense@64",
                      "b16@64: sparse_rl - dense@64"}


def test_a_pair_over_3_seeds_is_not_split():
    by = _study({"dense": [0.6, 0.61, 0.62], "b8/none": [0.1, 0.1, 0.11],
                 "b8/sparse_rl": [0.1, 0.12, 0.1]})
    assert halves.split_rows(by) == [] and report.halves_table(by) == ""


def _deciding(collapse_gap: float, effect: float, *, rkv_effect: float = 0.0):
    n = _noise(7, sd=0.03)
    dense = [0.30 + x for x in _noise(5, sd=0.03)]
    return _study({
        "dense": [0.6 + x for x in _noise(9, sd=0.02)],
        "dense@64": dense,
        "b16@64/none": [d - collapse_gap + x for d, x in zip(dense, n)],
        "b16@64/sparse_rl": [d - collapse_gap + effect + x for d, x in zip(dense, _noise(8, sd=0.03))],
        "rkv16@64/none": [d - collapse_gap + x for d, x in zip(dense, _noise(10, sd=0.03))],
        "rkv16@64/sparse_rl": [d - collapse_gap + rkv_effect + x
                               for d, x in zip(dense, _noise(11, sd=0.03))]})


def test_rescue_claim_needs_the_collapse_resolved():
    # the collapse is large: uncorrected below dense, the correction lifts it back: holds
    _, ok, text = verdicts._correction_rescues(_deciding(0.12, 0.12), 15)
    assert ok is True and "the collapse the correction is said to rescue is resolved" in text
    # uncorrected below dense by more than the spread (0.105 > sd 0.103 of each arm), but the
    # two move against each other seed by seed, so the paired interval of their difference
    # holds 0 (half-width 2.131 * 0.207 / 4 = 0.110): the effect is resolved, the collapse not
    z = [0.1 if s % 2 else -0.1 for s in range(16)]
    unc = [0.195 - x for x in z]
    by = _study({"dense": [0.6 + x for x in _noise(9, sd=0.02)],
                 "dense@64": [0.30 + x for x in z], "b16@64/none": unc,
                 "b16@64/sparse_rl": [u + 0.2 + x for u, x in zip(unc, _noise(8, sd=0.005))]})
    (e,) = verdicts.correction_effects(by)
    assert e["regime"] == "rescued"
    m, _, lo, hi = verdicts.collapse_interval(by, e)
    assert lo < 0 < hi
    _, ok, text = verdicts._correction_rescues(by, 15)
    assert ok is False
    assert "not itself resolved at this sparsity" in text
    assert f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}] over 16 seeds" in text


def test_a_rescue_that_stops_short_of_dense_is_partly_rescued():
    """Uncorrected far below dense, corrected within the seeds' (large, shared) spread of dense
    but below it on every seed: the paired interval says the correction closes part of the gap,
    so the regime is 'partly rescued' and the rescue claim does not hold; the R-KV claim (the
    correction's own effect) still does, and says both intervals."""
    shared = _noise(5, sd=0.1)
    dense = [0.35 + x for x in shared]
    pair = {"rkv16@64/none": [d - 0.15 + x for d, x in zip(dense, _noise(7, sd=0.01))],
            "rkv16@64/sparse_rl": [d - 0.05 + x for d, x in zip(dense, _noise(8, sd=0.01))]}
    by = _study({"dense": [0.6 + x for x in _noise(9, sd=0.02)], "dense@64": dense, **pair})
    (e,) = verdicts.correction_effects(by)
    assert (e["unc_vs_dense"], e["cor_vs_dense"], e["resolved"]) == ("below", "within", 1)
    assert e["regime"] == "partly rescued"
    _, ok, text = verdicts._correction_rescues(by, 15)
    assert ok is False and "rkv16@64: partly rescued" in text
    assert "corrected training still ends below dense (resolved)" in text
    _, ok, text = verdicts._rkv_correction(by)
    assert ok is True and "recovers part of the gap" in text
    # the same pair reaching dense on average: rescued, and the claim holds
    pair["rkv16@64/sparse_rl"] = [d + x for d, x in zip(dense, _noise(8, sd=0.01))]
    by = _study({"dense": [0.6 + x for x in _noise(9, sd=0.02)], "dense@64": dense, **pair})
    assert verdicts.correction_effects(by)[0]["regime"] == "rescued"
    assert verdicts._correction_rescues(by, 15)[1] is True


def test_rkv_claim_follows_its_pair():
    by = _deciding(0.12, 0.12, rkv_effect=0.15)
    name, ok, text = verdicts._rkv_correction(by)
    assert (name, ok) == ("correction under R-KV", True)
    assert text.startswith("With R-KV's sampler rkv16@64") and "resolved by the seeds" in text
    name, ok, text = verdicts._rkv_correction(_deciding(0.12, 0.12, rkv_effect=0.0))
    assert ok is False and "not resolved by the seeds" in text
    assert verdicts._rkv_correction(_study({"dense": [0.5, 0.6]}))[1] is None
    names = [c[0] for c in verdicts.claims(by, {"tau": 0.5})]
    assert names[-1] == "correction under R-KV" and len(names) == 6


def test_the_report_gives_each_deciding_verdict_per_half_and_pooled(tmp_path, monkeypatch):
    import torch

    by_rows = _deciding(0.03, 0.08, rkv_effect=0.0)
    rows = []
    for s in by_rows.values():
        for seed, p in s["per_seed"].items():
            rows += _rows(s["arm"], seed, p["dense_after"], dense=s["arm"].startswith("dense"))
    monkeypatch.setattr(report, "write_plots", lambda *a, **k: [])
    table = SimpleNamespace(budgets=[8, 16], bin_size=8, q=0.05,
                            values=torch.tensor([[0.5, 0.2], [0.99, 0.95]]))
    schedule = SimpleNamespace(budgets=[16, 16], bin_size=8)
    report.write_report(tmp_path, rows=rows, table=table, schedule=schedule,
                        config={"tau": 0.5, "aggressive_budget": 8, "prompt_len": 16},
                        calib_s=1.0, train_s=2.0)
    text = (tmp_path / "report.md").read_text()
    section = text[text.index("## The deciding verdicts per half"):text.index("## The claims")]
    assert "| comparison | seeds 0-7 | seeds 8-15 | seeds 0-15 (pooled) |" in section
    by = {s["arm"]: s for s in report.summarize(rows)}
    for _, vs in halves.split_rows(by):
        for label in {v["label"] for v in vs}:
            cells = [halves.verdict_cell(v) for v in vs if v["label"] == label]
            assert f"| {label} | " + " | ".join(cells) + " |" in section
    col = next(v for e, vs in halves.split_rows(by) if e["sampler"] == "b16@64" for v in vs
               if v["comparison"] == "collapse" and v["part"].endswith("(pooled)"))
    said = ("is resolved" if col["resolved"] == -1 else "is not itself resolved at this sparsity")
    assert f"so the collapse the correction is said to rescue {said}" in section
    assert section.count("- b16@64, pooled over 16 seeds") == 1
    assert section.count("- rkv16@64, pooled over 16 seeds") == 1
    assert "**correction under R-KV:" in text
