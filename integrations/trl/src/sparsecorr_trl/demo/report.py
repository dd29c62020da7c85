r"""The demo's report: report.md with a per-arm summary over seeds (mean and spread), what the
correction buys per sampler (paired over seeds), DistillSparse's tail with and without its
adapter, the claims checked against the numbers, and the plots (`plots`).

Every number and every verdict in report.md is computed from the rows written to
``metrics.jsonl`` (`summarize`, `correction_effects`, `distill_effect`, `claims`, `findings`);
nothing in the verdicts is fixed in advance. The spread over seeds is their sample standard
deviation (undefined for one seed, where a fixed margin stands in and the report says so). A
difference between two arms is *resolved* by the seeds when its paired 95 % t-interval over the
seeds, \(\bar d \pm t_{0.975, n-1}\, s_d / \sqrt{n}\), excludes 0; a one-seed report has no
interval and never calls anything resolved. `deciding_table` prints, seed by seed, the
comparison the correction claim rests on; `halves_table` gives each deciding verdict (every pair
over 4 or more seeds: what the correction buys, the uncorrected arm against dense, the corrected
arm against dense) on each half of the seeds and pooled (`halves`).
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean, stdev

from sparsecorr._io import atomic_write_text

from .halves import split_rows, verdict_cell
from .plots import PNGS, write_plots
from .verdicts import (
    CLEAR_GAIN,
    FAIL_FRACTION,
    KV_FRACTION,
    ONE_SEED_MARGIN,
    claims,
    correction_effects,
    dense_of,
    distill_effect,
    interval,
    pm,
    spread,
)

__all__ = ["CLEAR_GAIN", "FAIL_FRACTION", "KV_FRACTION", "METRICS", "ONE_SEED_MARGIN", "PNGS",
           "REPRODUCIBILITY", "claims", "correction_effects", "correction_table",
           "deciding_effect", "deciding_table", "distill_effect", "findings", "halves_table",
           "halves_text", "interval", "pm",
           "seeds_text", "spread", "summarize", "summarize_seed", "summary_table", "tail_table",
           "write_failure_report", "write_report"]

_NAN = float("nan")
#: probe statistics (row key -> summary name), averaged over the probes after training steps
PROBES = {"probe_reward": "p_reward", "probe_accept_q05": "p_accept",
          "probe_log_ratio_q05": "p_log_ratio", "probe_rejected_frac": "p_rejected",
          "probe_vetoed_frac": "p_vetoed", "probe_ess": "p_ess",
          "probe_accept_q05_noadapter": "p_accept_noadapter"}
#: per-seed metrics summarised per arm as mean and spread
METRICS = ("dense_before", "dense_after", "gain", "reward_first", "reward_last_half",
           "tokens_per_s", "peak_kv_bytes", "mismatch", "tail", "worst", "kept_frac",
           *PROBES.values())


def _mean(values) -> float:
    vals = [v for v in values if v is not None and v == v]
    return mean(vals) if vals else _NAN


def _sd(values) -> float:
    vals = [v for v in values if v is not None and v == v]
    return stdev(vals) if len(vals) >= 2 else _NAN


def _last(rows: list[dict], key: str) -> float:
    vals = [r.get(key, _NAN) for r in rows]
    vals = [v for v in vals if v is not None and v == v]
    return vals[-1] if vals else _NAN


def summarize_seed(rs: list[dict]) -> dict:
    """One arm and seed: the dense model's held-out greedy reward before and after training
    (and the gain), sampled reward (first step, last-half mean over the steps that sampled),
    tokens/s (mean over the steps after the first, which includes warm-up), peak KV bytes, mean
    k3 mismatch, the trainer-logged tail of the mismatch (5% quantile of ``log(old/rollout)``,
    logged only with a correction, and the worst token's ``|log(old/rollout)|``), the
    correction's kept-token fraction, and the sampler probe's statistics (`PROBES`, mean over
    the probes taken after training steps)."""
    timed = rs[1:] if len(rs) > 1 else rs
    before = rs[0].get("dense_eval_reward_before", _NAN)
    after = _last(rs, "dense_eval_reward")
    out = {"steps": len(rs), "dense_before": before, "dense_after": after,
           "gain": after - before, "reward_first": rs[0]["reward"],
           "reward_last_half": _mean(r["reward"] for r in rs[len(rs) // 2:]),
           "tokens_per_s": _mean(r["tokens_per_s"] for r in timed),
           "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs),
           "mismatch": _mean(r.get("kl_k3", _NAN) for r in rs),
           "tail": _mean(r.get("mismatch_tail", _NAN) for r in rs),
           "worst": _mean(r.get("mismatch_max", _NAN) for r in rs),
           "kept_frac": _mean(r.get("sparsecorr/correction/kept_token_frac", _NAN) for r in rs)}
    out.update({name: _mean(r.get(key, _NAN) for r in rs) for key, name in PROBES.items()})
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Per arm (in order of appearance): ``sampler`` and ``correction`` (from the rows),
    ``seeds`` (list), ``per_seed`` ({seed: summary}) and, for each of `METRICS`, the mean over
    seeds (``name``) and the spread (``name_sd``)."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        per_seed = {seed: summarize_seed([r for r in mine if r.get("seed", 0) == seed])
                    for seed in dict.fromkeys(r.get("seed", 0) for r in mine)}
        s = {"arm": arm, "sampler": mine[0].get("sampler", arm),
             "correction": mine[0].get("correction", ""), "seeds": list(per_seed),
             "per_seed": per_seed}
        for m in METRICS:
            vals = [p[m] for p in per_seed.values()]
            s[m], s[f"{m}_sd"] = _mean(vals), _sd(vals)
        out.append(s)
    return out


def _compare(a: float, b: float, margin: float) -> str:
    """'higher than' / 'lower than' / 'about the same as': a vs b within ``margin``."""
    if math.isnan(a) or math.isnan(b):
        return "not comparable to"
    return "higher than" if a > b + margin else "lower than" if a < b - margin else "about the same as"


def findings(by: dict[str, dict], config: dict) -> list[str]:
    """What the correction, the schedule and DistillSparse buy, one sentence each, from the
    dense model's held-out greedy reward at the end (not the sampled reward, which for a sparse
    arm measures the sampler); 'about the same' is within the spread of the two arms
    compared."""
    lines = []
    for e in correction_effects(by):
        lines.append(
            f"What the correction buys with sampler {e['sampler']} (same sampler, sparse_rl() vs "
            f"none): final greedy reward {pm(e['cor'], e['cor_sd'])} vs {pm(e['unc'], e['unc_sd'])}, "
            f"difference {e['diff_text']}; {e['regime_text']}.")
    agg = f"b{config.get('aggressive_budget', 8)}"
    for c in ("sparse_rl", "none"):
        sch, cor = by.get(f"schedule/{c}"), by.get(f"{agg}/{c}")
        if sch and cor:
            tol, _ = spread(by, sch["arm"], cor["arm"])
            lines.append(
                f"What the schedule buys (fitted schedule vs aggressive budget {agg}, both "
                f"{c}): final greedy reward {pm(sch['dense_after'], sch['dense_after_sd'])}, "
                f"{_compare(sch['dense_after'], cor['dense_after'], tol)} the aggressive arm's "
                f"{pm(cor['dense_after'], cor['dense_after_sd'])}; sampled reward (last half) "
                f"{sch['reward_last_half']:.3f} vs {cor['reward_last_half']:.3f}; peak KV "
                f"{sch['peak_kv_bytes']:.0f} B vs {cor['peak_kv_bytes']:.0f} B.")
    d = distill_effect(by)
    if d is not None:
        lines.append(f"What DistillSparse buys: {d['text']}")
    return lines


def tail_table(table) -> str:
    """Markdown table of the calibrated tail statistic per budget (rows) and context bin."""
    vals = table.values
    head = "| budget | " + " | ".join(f"{j * table.bin_size}+" for j in range(vals.shape[1])) + " |"
    rows = [head, "|---" * (vals.shape[1] + 1) + "|"]
    for i, b in enumerate(table.budgets):
        rows.append(f"| {b} | " + " | ".join(f"{float(v):.3f}" for v in vals[i]) + " |")
    return "\n".join(rows)


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}%"


def summary_table(summ: list[dict]) -> str:
    """Markdown table: one row per arm, mean ± spread over seeds."""
    lines = ["| arm | seeds | held-out greedy reward before -> after | gain | sampled reward "
             "(last half) | peak KV bytes (% of its dense arm) | acceptance 5% tail (probe) | "
             "band-rejected tokens (probe) | kept tokens (trainer) | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    dense = {s["arm"]: s["peak_kv_bytes"] for s in summ if s["sampler"].startswith("dense")}
    for s in summ:
        ref = dense.get(dense_of(s["sampler"]), _NAN)
        lines.append(
            f"| {s['arm']} | {len(s['seeds'])} | {pm(s['dense_before'], s['dense_before_sd'])} -> "
            f"{pm(s['dense_after'], s['dense_after_sd'])} | {pm(s['gain'], s['gain_sd'])} | "
            f"{pm(s['reward_last_half'], s['reward_last_half_sd'])} | {s['peak_kv_bytes']:.0f} "
            f"({100 * s['peak_kv_bytes'] / ref:.0f}%) | {pm(s['p_accept'], s['p_accept_sd'])} | "
            f"{_pct(s['p_rejected'])} | {_pct(s['kept_frac'])} | {s['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def deciding_effect(by: dict[str, dict]) -> dict | None:
    """The comparison the correction claim rests on (one of `correction_effects`): a rescued
    sampler; else, among the pairs over the most seeds, one whose uncorrected arm ends below
    dense and corrected not, then the largest difference. None without a pair."""
    effects = correction_effects(by)
    if not effects:
        return None
    return max(effects, key=lambda e: (e["regime"] == "rescued", len(e["seeds"]),
                                       e["regime"].startswith("rescued"),
                                       e["diff"] if e["diff"] == e["diff"] else -math.inf))


def deciding_table(by: dict[str, dict], e: dict) -> str:
    """Markdown table, one row per seed of the comparison ``e`` (a `correction_effects` item):
    the final held-out greedy reward of its dense arm and of both arms, and their difference
    (corrected minus uncorrected)."""
    arms = (e["dense_arm"], e["unc_arm"], e["cor_arm"])
    lines = [f"| seed | {' | '.join(arms)} | difference |", "|---|---|---|---|---|"]
    for seed in e["seeds"]:
        vals = [by[a]["per_seed"].get(seed, {}).get("dense_after", _NAN) for a in arms]
        cells = " | ".join("-" if v != v else f"{v:.3f}" for v in vals)
        lines.append(f"| {seed} | {cells} | {vals[2] - vals[1]:+.3f} |")
    return "\n".join(lines)


def seeds_text(summ: list[dict]) -> str:
    """Which arms ran over which seeds (one sentence)."""
    groups: dict[tuple, list[str]] = {}
    for s in summ:
        groups.setdefault(tuple(s["seeds"]), []).append(s["arm"])
    if len(groups) == 1:
        (seeds,) = groups
        return f"Every arm ran over {_count(seeds)}."
    parts = [f"{', '.join(arms)} over {_count(seeds)}"
             for seeds, arms in sorted(groups.items(), key=lambda g: -len(g[0]))]
    return ("The arms the claims rest on ran over the most seeds, the others over fewer: "
            + "; ".join(parts) + ".")


def _count(seeds: tuple) -> str:
    n = len(seeds)
    return f"{n} seed{'s' if n != 1 else ''} ({', '.join(str(x) for x in seeds)})"


def correction_table(by: dict[str, dict]) -> str:
    """Markdown table: per sampler, the final reward uncorrected and with ``sparse_rl()``, the
    paired difference with its interval, and the probe's mismatch statistics of the
    uncorrected arm (what ``sparse_rl()`` would have done to the rollouts it trained on)."""
    effects = correction_effects(by)
    one = all(e["lo"] != e["lo"] for e in effects)
    lines = ["| sampler | uncorrected | sparse_rl() | difference (paired) | 95% interval | "
             + ("vs one-seed margin" if one else "resolved") + " | vs dense (none / sparse_rl) | sampled reward at step 1 | acceptance "
             "5% tail | log-ratio 5% tail | band-rejected | vetoed seqs | ESS |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in effects:
        u = by[e["unc_arm"]]
        lo_hi = "-" if e["lo"] != e["lo"] else f"[{e['lo']:+.3f}, {e['hi']:+.3f}]"
        lines.append(
            f"| {e['sampler']} | {pm(e['unc'], e['unc_sd'])} | {pm(e['cor'], e['cor_sd'])} | "
            f"{pm(e['diff'], e['diff_sd'], signed=True)} | {lo_hi} | {e['resolved_text']} | "
            f"{e['unc_vs_dense']} / {e['cor_vs_dense']} | {u['reward_first']:.3f} | "
            f"{pm(u['p_accept'], u['p_accept_sd'])} | {pm(u['p_log_ratio'], u['p_log_ratio_sd'], 2)} | "
            f"{_pct(u['p_rejected'])} | {_pct(u['p_vetoed'])} | {pm(u['p_ess'], u['p_ess_sd'])} |")
    return "\n".join(lines)


def _header(config, table, schedule, calib_s, train_s, notes) -> list[str]:
    return [
        "# sparsecorr demo report", "",
        f"Config: `{config}`", "",
        f"Wall time: calibration {calib_s:.1f} s, training {train_s:.1f} s.", "",
        f"Calibration over budgets {list(table.budgets)}; schedule fitted at "
        f"tau={config['tau']}: budgets per bin {list(schedule.budgets)} (None = dense).", "",
        *[f"Note: {n}" for n in notes], *([""] if notes else []),
        f"Lower q={table.q} quantile of the acceptance per budget and context bin:", "",
        tail_table(table), ""]


#: what a run's numbers can and cannot be trusted for (the report's last section)
REPRODUCIBILITY = (
    "- A run of one seed is deterministic on one machine: the same code, torch build and "
    "thread count give the same rows again.",
    "- It is not deterministic across machines: CPU kernels differ in the last bits of a "
    "float, the training trajectories of one seed part after a few steps, and its final "
    "reward can differ by several hundredths from one machine to another.",
    "- So the unit of evidence is the spread over seeds, not one seed's value: a difference "
    "counts only when its 95% interval over all its seeds excludes 0, and a one-seed run "
    "decides nothing (`--full` runs the arms the claims rest on over 16 seeds, and the report "
    "gives each deciding verdict on each half of them and pooled).")


def halves_table(by: dict[str, dict]) -> str:
    """Markdown table: per deciding pair (`halves.split_rows`) and comparison, the paired
    difference with its 95 % interval on each half of the seeds and pooled; "" without one."""
    rows = split_rows(by)
    if not rows:
        return ""
    parts = list(dict.fromkeys(v["part"] for _, vs in rows for v in vs))
    lines = ["| comparison | " + " | ".join(parts) + " |", "|---" * (len(parts) + 1) + "|"]
    for _, vs in rows:
        for label in dict.fromkeys(v["label"] for v in vs):
            cells = {v["part"]: verdict_cell(v) for v in vs if v["label"] == label}
            lines.append(f"| {label} | " + " | ".join(cells.get(p, "-") for p in parts) + " |")
    return "\n".join(lines)


def halves_text(by: dict[str, dict]) -> list[str]:
    """One sentence per deciding pair: the pooled correction effect and collapse, whether each
    half agrees with the pooled verdict, said plainly whichever way they fall."""
    out = []
    for e, vs in split_rows(by):
        pooled = {v["comparison"]: v for v in vs if v["part"].endswith("(pooled)")}
        halves = [v for v in vs if not v["part"].endswith("(pooled)")]
        cor, col = pooled["correction"], pooled["collapse"]
        disagree = sorted({v["part"] for v in halves
                           if v["comparison"] in ("correction", "collapse")
                           and v["resolved"] != pooled[v["comparison"]]["resolved"]})
        out.append(
            f"{e['sampler']}, pooled over {len(cor['seeds'])} seeds: the correction's effect "
            f"({e['cor_arm']} minus {e['unc_arm']}) is {verdict_cell(cor)}; the uncorrected arm "
            f"minus {e['dense_arm']} is {verdict_cell(col)}, so the collapse the correction is "
            f"said to rescue is "
            + ("resolved" if col["resolved"] == -1 else "not itself resolved at this sparsity")
            + ". " + (f"On {' and on '.join(disagree)} alone a verdict differs from the pooled "
                      f"one (half the seeds give a wider interval), so the pooled verdict rests "
                      f"on all {len(cor['seeds'])} seeds, not on either half." if disagree else
                      "Each half of the seeds gives the same verdicts as the pooled seeds."))
    return out


def _deciding_section(by: dict, one: bool) -> list[str]:
    e = deciding_effect(by)
    if e is None:
        return []
    n = len(e["seeds"])
    verdict = (f"one seed: {e['diff']:+.3f}, no interval, so nothing is decided" if one else
               f"{pm(e['diff'], e['diff_sd'], signed=True)} over {n} seeds, 95% interval "
               f"[{e['lo']:+.3f}, {e['hi']:+.3f}]: "
               + ("resolved" if e["resolved"] else "not resolved"))
    split = halves_table(by)
    return ["## The deciding comparison, seed by seed", "",
            f"The correction claim rests on sampler {e['sampler']} ({e['regime']}): the final "
            f"held-out greedy reward per seed of {e['dense_arm']}, {e['unc_arm']} and "
            f"{e['cor_arm']}, and the paired difference ({verdict}).", "",
            deciding_table(by, e),
            *(["", "## The deciding verdicts per half of the seeds and pooled", "",
               "Every sampler pair that ran over 4 or more seeds: the paired difference of the "
               "final held-out greedy reward with its 95% t-interval, on each half of the seeds "
               "and on all of them.", "", split, "", *[f"- {t}" for t in halves_text(by)]]
              if split else [])]


def write_report(out: Path, *, rows, table, schedule, config, calib_s: float,
                 train_s: float = _NAN, notes: list[str] | tuple[str, ...] = ()) -> str:
    """Write plots and report.md into ``out``; return the summary table (markdown).

    A plot that fails is reported in report.md (the table and verdicts are still written)."""
    summ = summarize(rows)
    try:
        files, plot_note = write_plots(out, rows, table, schedule, config["tau"], summ), ""
    except Exception as exc:  # the numbers are worth writing even without plots
        files, plot_note = [], f"Plots failed: {type(exc).__name__}: {exc}"
    tbl = summary_table(summ)
    by = {s["arm"]: s for s in summ}
    checked = claims(by, config)
    lines = findings(by, config)
    if all(b is None for b in schedule.budgets):
        lines.append("No calibrated budget reached tau in any bin, so the fitted schedule is "
                     "dense everywhere and the schedule arms sample densely.")
    verdict_word = {True: "holds", False: "does not hold", None: "not checked"}
    one = all(len(s["seeds"]) < 2 for s in summ)
    text = "\n".join([
        *_header(config, table, schedule, calib_s, train_s, notes),
        "## Summary", "",
        "The held-out greedy reward is the dense model's (adapter off for DistillSparse) on "
        "the same held-out prompts for every arm and seed; values are mean ± spread (sample "
        "standard deviation) over seeds. The probe columns sample the arm's own sampler on the "
        "held-out prompts during training (the same way for corrected and uncorrected arms).", "",
        seeds_text(summ), "",
        tbl, "",
        "tokens/s is the wall-clock throughput of the rollout step: it moves with the load of "
        "the machine, so compare arms only from a run on otherwise idle cores.", "",
        "## What the correction buys", "",
        "Per sampler, the final held-out greedy reward without and with sparse_rl() (same "
        "seeds, prompts and evaluation), their paired difference over seeds (corrected minus "
        "uncorrected) and "
        + ("how it compares with a fixed margin (one seed: no interval)" if one else
           "whether the seeds resolve it")
        + "; the mismatch columns are the probe of the uncorrected arm's sampler (what "
        "sparse_rl() would have done to its rollouts).", "",
        correction_table(by), "",
        *_deciding_section(by, one), "",
        "## The claims", "",
        *[f"- **{name}: {verdict_word[ok]}.** {sentence}" for name, ok, sentence in checked], "",
        "## What each arm shows", "", *[f"- {line}" for line in lines], "",
        "## Plots", "", *([plot_note] if plot_note else [f"![{f}]({f})" for f in files]), "",
        "## Reproducibility", "", *REPRODUCIBILITY, ""])
    atomic_write_text(out / "report.md", text)
    return tbl


def write_failure_report(out: Path, *, stage: str, error: BaseException, done: dict) -> Path:
    """report.md for a run that failed at ``stage``: the error and whatever finished."""
    lines = ["# sparsecorr demo report", "", f"**The demo failed during {stage}:** "
             f"`{type(error).__name__}: {error}`", "", f"Config: `{done.get('config')}`", ""]
    if "table" in done:
        lines += ["Calibration finished:", "", tail_table(done["table"]), "",
                  f"Fitted schedule: {list(done['schedule'].budgets)} (None = dense).", ""]
    else:
        lines += ["Calibration did not finish.", ""]
    if done.get("rows"):
        lines += ["Arms that finished:", "", summary_table(summarize(done["rows"])), ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path
