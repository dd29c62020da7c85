"""The demo's report: PNG plots and report.md with a per-arm summary over seeds (mean and
spread), the issue's three claims checked against the numbers, and what each arm shows.

Every number and every verdict in report.md is computed from the rows written to
``metrics.jsonl`` (`summarize`, `claims`, `findings`); nothing in the verdicts is fixed in
advance. The spread over seeds is their sample standard deviation (undefined for one seed,
where a fixed margin stands in and the report says so).
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean, stdev

from sparsecorr._io import atomic_write_text

#: one look per arm, distinct in colour, marker and line style so overlapping series stay visible
STYLES = {
    "dense": {"color": "#333333", "marker": "o", "linestyle": "-"},
    "sparse-uncorrected": {"color": "#d62728", "marker": "s", "linestyle": "--"},
    "sparse-corrected": {"color": "#1f77b4", "marker": "^", "linestyle": "-."},
    "sparse-schedule-corrected": {"color": "#2ca02c", "marker": "D", "linestyle": ":"},
    "sparse-distill": {"color": "#9467bd", "marker": "v", "linestyle": (0, (5, 1))},
}
PNGS = ("calibration.png", "curves.png", "mismatch.png", "memory_speed.png")
#: dense GRPO must raise the held-out greedy reward by more than this (and than twice the
#: spread of its gain over seeds) for the first claim
CLEAR_GAIN = 0.05
#: margin standing in for the spread over seeds when a run has one seed
ONE_SEED_MARGIN = 0.02
#: the scheduled arm's peak KV must be at most this fraction of dense's
KV_FRACTION = 0.5
_NAN = float("nan")
#: per-seed metrics summarised per arm as mean and spread
METRICS = ("dense_before", "dense_after", "gain", "reward_first", "reward_last_half",
           "tokens_per_s", "peak_kv_bytes", "mismatch", "tail", "worst", "kept_frac")


def _mean(values) -> float:
    vals = [v for v in values if v == v]
    return mean(vals) if vals else _NAN


def _sd(values) -> float:
    vals = [v for v in values if v == v]
    return stdev(vals) if len(vals) >= 2 else _NAN


def _last(rows: list[dict], key: str) -> float:
    vals = [r.get(key, _NAN) for r in rows]
    vals = [v for v in vals if v is not None and v == v]
    return vals[-1] if vals else _NAN


def summarize_seed(rs: list[dict]) -> dict:
    """One arm and seed: the dense model's held-out greedy reward before and after training
    (and the gain), sampled reward (first step, last-half mean), tokens/s (mean over the steps
    after the first, which includes warm-up), peak KV bytes, mean k3 mismatch, the tail of the
    mismatch (mean over steps of the 5% quantile of ``log(old/rollout)``, logged only with a
    correction, and of the worst token's ``|log(old/rollout)|``) and the correction's kept-token
    fraction."""
    timed = rs[1:] if len(rs) > 1 else rs
    before = rs[0].get("dense_eval_reward_before", _NAN)
    after = _last(rs, "dense_eval_reward")
    return {"steps": len(rs), "dense_before": before, "dense_after": after,
            "gain": after - before, "reward_first": rs[0]["reward"],
            "reward_last_half": mean(r["reward"] for r in rs[len(rs) // 2:]),
            "tokens_per_s": _mean(r["tokens_per_s"] for r in timed),
            "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs),
            "mismatch": _mean(r.get("kl_k3", _NAN) for r in rs),
            "tail": _mean(r.get("mismatch_tail", _NAN) for r in rs),
            "worst": _mean(r.get("mismatch_max", _NAN) for r in rs),
            "kept_frac": _mean(r.get("sparsecorr/correction/kept_token_frac", _NAN) for r in rs)}


def summarize(rows: list[dict]) -> list[dict]:
    """Per arm (in order of appearance): ``seeds`` (list), ``per_seed`` ({seed: summary}) and,
    for each of `METRICS`, the mean over seeds (``name``) and the spread (``name_sd``)."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        per_seed = {}
        for seed in dict.fromkeys(r.get("seed", 0) for r in rows if r["arm"] == arm):
            per_seed[seed] = summarize_seed([r for r in rows if r["arm"] == arm
                                             and r.get("seed", 0) == seed])
        s = {"arm": arm, "seeds": list(per_seed), "per_seed": per_seed}
        for m in METRICS:
            vals = [p[m] for p in per_seed.values()]
            s[m], s[f"{m}_sd"] = _mean(vals), _sd(vals)
        out.append(s)
    return out


def pm(x: float, sd: float, digits: int = 3) -> str:
    """``x ± sd`` (just ``x`` when the spread is undefined, one seed)."""
    if x != x:
        return "n/a"
    return f"{x:.{digits}f}" if sd != sd else f"{x:.{digits}f} ± {sd:.{digits}f}"


def _paired(by: dict, a: str, b: str, key: str, op) -> list[float]:
    """``op(a's key, b's key)`` per seed both arms ran."""
    pa, pb = by[a]["per_seed"], by[b]["per_seed"]
    return [op(pa[s][key], pb[s][key]) for s in pa if s in pb]


def spread(by: dict, *arms: str) -> tuple[float, bool]:
    """The tolerance for 'within the seeds' spread': the largest spread over seeds of the
    final greedy reward among ``arms``; `ONE_SEED_MARGIN` when there is one seed (second
    value False then)."""
    sds = [by[a]["dense_after_sd"] for a in arms if a in by]
    sds = [v for v in sds if v == v]
    return (max(sds), True) if sds else (ONE_SEED_MARGIN, False)


def _tol_text(tol: float, from_seeds: bool) -> str:
    return (f"the seeds' spread, {tol:.3f}" if from_seeds else
            f"a fixed margin of {tol:.3f}: one seed, so no spread is measured")


def claims(by: dict[str, dict]) -> list[tuple[str, bool | None, str]]:
    """The issue's three claims checked against the numbers: ``(name, holds, sentence)``;
    ``holds`` is None when an arm the claim needs did not run."""
    out: list[tuple[str, bool | None, str]] = []
    d = by.get("dense")
    if d is None:
        return [("dense improves", None, "The dense arm did not run: no claim can be checked.")]
    n = len(d["seeds"])
    seeds = f"{n} seed{'s' if n != 1 else ''}"
    gain_sd = d["gain_sd"] if d["gain_sd"] == d["gain_sd"] else 0.0
    need = max(CLEAR_GAIN, 2 * gain_sd)
    ok = d["gain"] > need
    out.append(("dense improves", ok,
                f"Dense GRPO moved the held-out greedy reward from {pm(d['dense_before'], d['dense_before_sd'])} "
                f"to {pm(d['dense_after'], d['dense_after_sd'])} (gain {pm(d['gain'], d['gain_sd'])}, "
                f"{seeds}): " + ("a clear margin" if ok else "not a clear margin")
                + f" (a clear margin is more than {need:.3f}: {CLEAR_GAIN} and twice the gain's "
                  f"spread)."))
    sch = by.get("sparse-schedule-corrected")
    if sch is None:
        out.append(("schedule matches dense", None, "The scheduled arm did not run."))
    else:
        tol, from_seeds = spread(by, "dense", "sparse-schedule-corrected")
        diff = sch["dense_after"] - d["dense_after"]
        ratio = _paired(by, "sparse-schedule-corrected", "dense", "dense_after",
                        lambda a, b: a / b if b else _NAN)
        kv = sch["peak_kv_bytes"] / max(1.0, d["peak_kv_bytes"])
        # 'reaches what dense reaches': within the spread, or above dense by more than it
        within, above, small = abs(diff) <= tol, diff > tol, kv <= KV_FRACTION
        where = ("within" if within else "above dense by more than" if above else
                 "below dense by more than")
        ok = (within or above) and small
        out.append(("schedule matches dense", ok,
                    f"The scheduled + corrected arm reaches {pm(_mean(ratio), _sd(ratio), 2)} of "
                    f"dense's final reward ({pm(sch['dense_after'], sch['dense_after_sd'])} vs "
                    f"{pm(d['dense_after'], d['dense_after_sd'])}) with {100 * kv:.0f}% of its "
                    f"peak KV: the difference {diff:+.3f} is {where} {_tol_text(tol, from_seeds)}, "
                    f"and the peak KV is " + ("at most" if small else "above")
                    + f" {100 * KV_FRACTION:.0f}% of dense's; the claim "
                    + ("holds" if ok else "does not hold") + " in this run."))
    unc = by.get("sparse-uncorrected")
    if unc is None:
        out.append(("uncorrected below dense", None, "The uncorrected arm did not run."))
    else:
        tol, from_seeds = spread(by, "dense", "sparse-uncorrected")
        gap = _paired(by, "dense", "sparse-uncorrected", "dense_after", lambda a, b: a - b)
        below = d["dense_after"] - unc["dense_after"] > tol
        out.append(("uncorrected below dense", below,
                    f"The uncorrected aggressive arm ends at "
                    f"{pm(unc['dense_after'], unc['dense_after_sd'])}, "
                    + (f"below dense by {pm(_mean(gap), _sd(gap))}: measurably below (more than "
                       f"{_tol_text(tol, from_seeds)})." if below else
                       f"{pm(_mean(gap), _sd(gap))} under dense: at this scale it did not end "
                       f"measurably below dense (the gap is not more than "
                       f"{_tol_text(tol, from_seeds)}).")))
    return out


def _compare(a: float, b: float, margin: float) -> str:
    """'higher than' / 'lower than' / 'about the same as': a vs b within ``margin``."""
    if math.isnan(a) or math.isnan(b):
        return "not comparable to"
    return "higher than" if a > b + margin else "lower than" if a < b - margin else "about the same as"


def findings(by: dict[str, dict]) -> list[str]:
    """What the correction, the schedule and DistillSparse buy, from the dense model's held-out
    greedy reward at the end (not the sampled reward, which for a sparse arm measures the
    sampler); 'about the same' is within the spread of the two arms compared."""
    lines = []
    unc, cor = by.get("sparse-uncorrected"), by.get("sparse-corrected")
    if unc and cor:
        tol, _ = spread(by, "sparse-uncorrected", "sparse-corrected")
        kept = "" if cor["kept_frac"] != cor["kept_frac"] else (
            f" It kept {100 * cor['kept_frac']:.1f}% of the sampled tokens"
            + (": it protects the model by discarding these rollouts, so there is little to "
               "learn from them." if cor["kept_frac"] < 0.05 else "."))
        lines.append(
            f"What the correction buys (same aggressive rollouts + sparse_rl()): final greedy "
            f"reward {pm(cor['dense_after'], cor['dense_after_sd'])}, "
            f"{_compare(cor['dense_after'], unc['dense_after'], tol)} without correction "
            f"({pm(unc['dense_after'], unc['dense_after_sd'])}).{kept}")
    sch = by.get("sparse-schedule-corrected")
    if cor and sch:
        tol, _ = spread(by, "sparse-schedule-corrected", "sparse-corrected")
        lines.append(
            f"What the schedule buys (fitted schedule vs aggressive budget, both with "
            f"sparse_rl()): final greedy reward {pm(sch['dense_after'], sch['dense_after_sd'])}, "
            f"{_compare(sch['dense_after'], cor['dense_after'], tol)} the aggressive arm's "
            f"{pm(cor['dense_after'], cor['dense_after_sd'])}; sampled reward (last half) "
            f"{sch['reward_last_half']:.3f} vs {cor['reward_last_half']:.3f}; peak KV "
            f"{sch['peak_kv_bytes']:.0f} B vs {cor['peak_kv_bytes']:.0f} B.")
    dis = by.get("sparse-distill")
    if cor and dis:
        tol, _ = spread(by, "sparse-distill", "sparse-corrected")
        lines.append(
            f"What DistillSparse buys (aggressive budget + sparse_rl(), with the sampler's LoRA "
            f"adapter vs without): final greedy reward {pm(dis['dense_after'], dis['dense_after_sd'])}, "
            f"{_compare(dis['dense_after'], cor['dense_after'], tol)} without it "
            f"({pm(cor['dense_after'], cor['dense_after_sd'])}); sampled reward (last half) "
            f"{dis['reward_last_half']:.3f} vs {cor['reward_last_half']:.3f}; mismatch 5% tail "
            f"{dis['tail']:.2f} vs {cor['tail']:.2f} (log-ratio, 0 = none).")
    return lines


def _style_axes(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _calibration_plot(path: Path, table, schedule, tau: float) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    markers = "osD^vP*X"
    for i, b in enumerate(table.budgets):
        ax[0].plot([j * table.bin_size for j in range(table.values.shape[1])],
                   table.values[i].tolist(), marker=markers[i % len(markers)],
                   linestyle=["-", "--", "-.", ":"][i % 4], label=f"budget {b}")
    ax[0].axhline(tau, color="k", ls="--", lw=1, label=f"tau = {tau}")
    ax[0].set(xlabel="context length (bin start, tokens)",
              ylabel=f"q = {table.q} tail of acceptance", title="calibrated tail profile")
    ax[0].legend()
    xs = [j * schedule.bin_size for j in range(len(schedule.budgets))]
    dense = max([b for b in schedule.budgets if b is not None] + list(table.budgets)) * 1.25
    ys = [dense if b is None else b for b in schedule.budgets]
    ax[1].step(xs, ys, where="post", marker="o")
    for x, b, y in zip(xs, schedule.budgets, ys):
        if b is None:
            ax[1].annotate("dense", (x, y), textcoords="offset points", xytext=(0, 6), ha="left")
    ax[1].set(xlabel="context length (bin start, tokens)", ylabel="KV budget (tokens)",
              title="fitted schedule (points marked 'dense' keep every token)")
    for a in ax:
        _style_axes(a)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _series(rows: list[dict], arm: str, key: str, *, before: bool = False):
    """Steps and, over seeds, the mean, min and max of ``key`` at each step (NaN skipped)."""
    by_step: dict[int, list[float]] = {}
    for r in rows:
        if r["arm"] != arm:
            continue
        if before and r["step"] == 0:
            v = r.get("dense_eval_reward_before", _NAN)
            if v == v:
                by_step.setdefault(0, []).append(v)
        v = r.get(key, _NAN)
        if v is not None and v == v:
            by_step.setdefault(r["step"] + 1, []).append(v)
    xs = sorted(by_step)
    return (xs, [mean(by_step[x]) for x in xs], [min(by_step[x]) for x in xs],
            [max(by_step[x]) for x in xs])


def _band_plot(ax, rows: list[dict], key: str, *, before: bool = False) -> None:
    for arm in dict.fromkeys(r["arm"] for r in rows):
        xs, ys, lo, hi = _series(rows, arm, key, before=before)
        st = STYLES.get(arm, {})
        ax.plot(xs, ys, label=arm, markersize=5, fillstyle="none", markeredgewidth=1.3,
                linewidth=1.8, **st)
        if any(a != b for a, b in zip(lo, hi)):
            ax.fill_between(xs, lo, hi, color=st.get("color", "gray"), alpha=0.15, linewidth=0)


def _n_seeds(rows: list[dict]) -> int:
    return len({r.get("seed", 0) for r in rows})


def _curves_plot(path: Path, rows: list[dict]) -> None:
    import matplotlib.pyplot as plt

    n = _n_seeds(rows)
    band = f"line: mean of {n} seeds, band: min-max" if n > 1 else "one seed"
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.6))
    _band_plot(ax[0], rows, "dense_eval_reward", before=True)
    _band_plot(ax[1], rows, "reward")
    ax[0].set(xlabel="optimizer steps done", ylabel="held-out greedy reward (dense model)",
              title=f"what the learner can do ({band})")
    ax[1].set(xlabel="optimizer step", ylabel="reward of sampled rollouts",
              title=f"what its sampler got ({band})")
    for a in ax:
        a.set_ylim(-0.03, 1.03)  # rewards live in [0, 1]: the full range, no zoomed-in axis
        _style_axes(a)
    handles, labels = ax[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)


def _mismatch_plot(path: Path, rows: list[dict]) -> None:
    import matplotlib.pyplot as plt

    n = _n_seeds(rows)
    band = f"line: mean of {n} seeds, band: min-max" if n > 1 else "one seed"
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.6))
    _band_plot(ax[0], rows, "mismatch_max")
    _band_plot(ax[1], rows, "mismatch_tail")
    ax[0].set(xlabel="optimizer step", ylabel="max over tokens of |log(p_dense / p_sampler)|",
              title=f"worst token of each step ({band})")
    ax[1].set(xlabel="optimizer step", ylabel="5% quantile of log(p_dense / p_sampler)",
              title="5% tail (logged by the correction: corrected arms only)")
    for a in ax:
        a.axhline(0, color="k", lw=0.8)
        _style_axes(a)
    handles, labels = ax[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle("rollout mismatch between the sampler and the dense model (0 = none)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)


def _memory_speed_plot(path: Path, summ: list[dict]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 3.8))
    names = [s["arm"] for s in summ]
    colors = [STYLES.get(n, {}).get("color", "gray") for n in names]
    dense = next((s["peak_kv_bytes"] for s in summ if s["arm"] == "dense"), None)
    kib = [s["peak_kv_bytes"] / 1024 for s in summ]
    ax[0].barh(names, kib, color=colors)
    if dense:
        for i, s in enumerate(summ):
            ax[0].annotate(f"{100 * s['peak_kv_bytes'] / dense:.0f}% of dense", (kib[i], i),
                           xytext=(4, 0), textcoords="offset points", va="center")
        ax[0].set_xlim(0, max(kib) * 1.35)
    ax[0].set(xlabel="peak KV cache during rollouts (KiB)", title="KV memory")
    ax[1].barh(names, [s["tokens_per_s"] for s in summ], color=colors)
    ax[1].set(xlabel="generated tokens/s, wall clock (warm-up excluded)",
              title="rollout throughput (moves with machine load)")
    ax[1].set_yticklabels([])
    for a in ax:
        a.invert_yaxis()
        a.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_plots(out: Path, rows: list[dict], table, schedule, tau: float) -> list[str]:
    """Write `PNGS` into ``out``; return their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draws = {"calibration.png": lambda p: _calibration_plot(p, table, schedule, tau),
             "curves.png": lambda p: _curves_plot(p, rows),
             "mismatch.png": lambda p: _mismatch_plot(p, rows),
             "memory_speed.png": lambda p: _memory_speed_plot(p, summarize(rows))}
    files = []
    with plt.rc_context({"font.size": 10, "axes.titlesize": 11, "legend.fontsize": 10}):
        try:
            for name in PNGS:
                tmp = out / f".{name}.tmp.png"
                draws[name](tmp)
                tmp.replace(out / name)  # atomic: a reader never sees half a PNG
                files.append(name)
        finally:
            plt.close("all")
    return files


def tail_table(table) -> str:
    """Markdown table of the calibrated tail statistic per budget (rows) and context bin."""
    vals = table.values
    head = "| budget | " + " | ".join(f"{j * table.bin_size}+" for j in range(vals.shape[1])) + " |"
    rows = [head, "|---" * (vals.shape[1] + 1) + "|"]
    for i, b in enumerate(table.budgets):
        rows.append(f"| {b} | " + " | ".join(f"{float(v):.3f}" for v in vals[i]) + " |")
    return "\n".join(rows)


def summary_table(summ: list[dict]) -> str:
    """Markdown table: one row per arm, mean ± spread over seeds."""
    lines = ["| arm | seeds | held-out greedy reward before -> after | gain | sampled reward "
             "(last half) | peak KV bytes (% of dense) | worst-token mismatch | mismatch 5% tail | "
             "kept tokens | tokens/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    dense = next((s["peak_kv_bytes"] for s in summ if s["arm"] == "dense"), _NAN)
    for s in summ:
        kept = "-" if s["kept_frac"] != s["kept_frac"] else f"{100 * s['kept_frac']:.1f}%"
        lines.append(
            f"| {s['arm']} | {len(s['seeds'])} | {pm(s['dense_before'], s['dense_before_sd'])} -> "
            f"{pm(s['dense_after'], s['dense_after_sd'])} | {pm(s['gain'], s['gain_sd'])} | "
            f"{pm(s['reward_last_half'], s['reward_last_half_sd'])} | {s['peak_kv_bytes']:.0f} "
            f"({100 * s['peak_kv_bytes'] / dense:.0f}%) | {pm(s['worst'], s['worst_sd'], 2)} | "
            f"{pm(s['tail'], s['tail_sd'], 2)} | {kept} | {s['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def write_report(out: Path, *, rows, table, schedule, config, calib_s: float,
                 train_s: float = _NAN, notes: list[str] | tuple[str, ...] = ()) -> str:
    """Write plots and report.md into ``out``; return the summary table (markdown).

    A plot that fails is reported in report.md (the table and verdicts are still written)."""
    try:
        files, plot_note = write_plots(out, rows, table, schedule, config["tau"]), ""
    except Exception as exc:  # the numbers are worth writing even without plots
        files, plot_note = [], f"Plots failed: {type(exc).__name__}: {exc}"
    summ = summarize(rows)
    tbl = summary_table(summ)
    by = {s["arm"]: s for s in summ}
    checked = claims(by)
    lines = findings(by)
    if all(b is None for b in schedule.budgets):
        lines.append("No calibrated budget reached tau in any bin, so the fitted schedule is "
                     "dense everywhere and the schedule arm samples densely.")
    verdict_word = {True: "holds", False: "does not hold", None: "not checked"}
    text = "\n".join([
        "# sparsecorr demo report", "",
        f"Config: `{config}`", "",
        f"Wall time: calibration {calib_s:.1f} s, training {train_s:.1f} s.", "",
        f"Calibration over budgets {list(table.budgets)}; schedule fitted at "
        f"tau={config['tau']}: budgets per bin {list(schedule.budgets)} (None = dense).", "",
        *[f"Note: {n}" for n in notes], *([""] if notes else []),
        f"Lower q={table.q} quantile of the acceptance per budget and context bin:", "",
        tail_table(table), "",
        "## Summary", "",
        "The held-out greedy reward is the dense model's (adapter off for DistillSparse) on "
        "the same held-out prompts for every arm and seed; values are mean ± spread (sample "
        "standard deviation) over seeds.", "",
        tbl, "",
        "tokens/s is the wall-clock throughput of the rollout step: it moves with the load of "
        "the machine, so compare arms only from a run on otherwise idle cores.", "",
        "## The three claims", "",
        *[f"- **{name}: {verdict_word[ok]}.** {sentence}" for name, ok, sentence in checked], "",
        "## What each arm shows", "", *[f"- {line}" for line in lines], "",
        "## Plots", "", *([plot_note] if plot_note else [f"![{f}]({f})" for f in files]), ""])
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
