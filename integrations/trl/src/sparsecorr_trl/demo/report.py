"""The demo's report: PNG plots and report.md with a per-arm summary and a verdict derived from
the numbers (nothing in the verdict is fixed in advance)."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean

from sparsecorr._io import atomic_write_text

#: one look per arm, distinct in colour, marker and line style so overlapping series stay visible
STYLES = {  # hollow markers of decreasing size: an arm drawn over another still shows both
    "dense": {"color": "#333333", "marker": "o", "linestyle": "-", "markersize": 10},
    "sparse-uncorrected": {"color": "#d62728", "marker": "s", "linestyle": "--", "markersize": 8},
    "sparse-corrected": {"color": "#1f77b4", "marker": "^", "linestyle": "-.", "markersize": 7},
    "sparse-schedule-corrected": {"color": "#2ca02c", "marker": "D", "linestyle": ":",
                                  "markersize": 5},
}
_NAN = float("nan")


def _mean(values: list[float]) -> float:
    vals = [v for v in values if v == v]
    return mean(vals) if vals else _NAN


def summarize(rows: list[dict]) -> list[dict]:
    """Per arm: sampled reward (first step, last-half mean), the dense model's greedy reward
    before and after training, tokens/s (mean over the steps after the first, which includes
    warm-up), peak KV bytes, mean k3 mismatch and mean kept-token fraction of the correction."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        timed = rs[1:] if len(rs) > 1 else rs
        out.append({"arm": arm, "steps": len(rs), "reward_first": rs[0]["reward"],
                    "reward_last_half": mean(r["reward"] for r in rs[len(rs) // 2:]),
                    "dense_before": rs[0].get("dense_eval_reward_before", _NAN),
                    "dense_after": rs[-1].get("dense_eval_reward", _NAN),
                    "tokens_per_s": _mean([r["tokens_per_s"] for r in timed]),
                    "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs),
                    "mismatch": _mean([r.get("kl_k3", _NAN) for r in rs]),
                    "kept_frac": _mean([r.get("sparsecorr/correction/kept_token_frac", _NAN)
                                        for r in rs])})
    return out


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


def _curves_plot(path: Path, rows: list[dict]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.4))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        style = {"markersize": 6, **STYLES.get(arm, {}), "label": arm, "fillstyle": "none",
                 "markeredgewidth": 1.5}
        ax[0].plot([r["step"] + 1 for r in rs], [r["reward"] for r in rs], **style)
        ax[1].plot([0] + [r["step"] + 1 for r in rs],
                   [rs[0].get("dense_eval_reward_before", _NAN)]
                   + [r["dense_eval_reward"] for r in rs], **style)
        ax[2].plot([r["step"] + 1 for r in rs], [r.get("kl_k3", _NAN) for r in rs], **style)
    ax[0].set(xlabel="optimizer step", ylabel="reward of sampled rollouts",
              title="training reward (what the sampler got)")
    ax[1].set(xlabel="optimizer steps done", ylabel="greedy reward of the dense model",
              title="what the learner can do")
    for a in ax[:2]:
        a.set_ylim(-0.03, 1.03)  # rewards live in [0, 1]: the full range, no zoomed-in axis
    kls = [r.get("kl_k3", _NAN) for r in rows]
    positive = [v for v in kls if v == v and v > 0]
    ax[2].set_yscale("symlog", linthresh=min(positive) if positive else 1e-6)
    ax[2].set(xlabel="optimizer step", ylabel="k3 KL(sampler || dense), symlog",
              title="rollout mismatch (0 = dense sampler)")
    for a in ax:
        _style_axes(a)
    handles, labels = ax[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)


def _memory_speed_plot(path: Path, summ: list[dict]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [s["arm"] for s in summ]
    colors = [STYLES.get(n, {}).get("color", "gray") for n in names]
    ax[0].barh(names, [s["peak_kv_bytes"] / 1024 for s in summ], color=colors)
    ax[0].set(xlabel="peak KV cache (KiB)", title="KV memory during rollouts")
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
    """Write calibration.png, curves.png and memory_speed.png into ``out``; return their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    with plt.rc_context({"font.size": 10, "axes.titlesize": 11, "legend.fontsize": 10}):
        try:
            for name, draw in (("calibration.png", lambda p: _calibration_plot(p, table, schedule, tau)),
                               ("curves.png", lambda p: _curves_plot(p, rows)),
                               ("memory_speed.png", lambda p: _memory_speed_plot(p, summarize(rows)))):
                tmp = out / f".{name}.tmp.png"
                draw(tmp)
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


def _compare(a: float, b: float, margin: float) -> str:
    """'higher than' / 'lower than' / 'about the same as': a vs b within ``margin``."""
    if math.isnan(a) or math.isnan(b):
        return "not comparable to"
    return "higher than" if a > b + margin else "lower than" if a < b - margin else "about the same as"


def verdict(by: dict[str, dict]) -> list[str]:
    """What each arm shows, from the dense model's greedy reward after training (not the sampled
    reward, which for a sparse arm measures the sampler), with a margin of
    ``max(0.02, 10% of the dense arm's)``; one sentence per comparison."""
    d = by["dense"]
    margin = max(0.02, 0.1 * d["dense_after"]) if d["dense_after"] == d["dense_after"] else 0.02
    lines = [f"Margin for 'about the same': {margin:.3f} (greedy reward of the dense model)."]
    unc = by.get("sparse-uncorrected")
    if unc:
        cmp = _compare(unc["dense_after"], d["dense_after"], margin)
        lines.append(
            f"Aggressive budget, no correction: the dense model's greedy reward went "
            f"{unc['dense_before']:.3f} -> {unc['dense_after']:.3f}, {cmp} the dense arm "
            f"({d['dense_after']:.3f})"
            + ("; training on these rollouts damaged it." if cmp == "lower than" else
               "; no damage shows at this scale, so this run shows the machinery rather than "
               "the effect." if cmp == "about the same as" else "."))
    cor = by.get("sparse-corrected")
    if unc and cor:
        cmp = _compare(cor["dense_after"], unc["dense_after"], margin)
        kept = "" if cor["kept_frac"] != cor["kept_frac"] else (
            f" It kept {100 * cor['kept_frac']:.1f}% of the sampled tokens"
            + (": it protects the model by discarding these rollouts, so there is little to "
               "learn from them." if cor["kept_frac"] < 0.05 else "."))
        lines.append(
            f"What the correction buys (same aggressive rollouts + sparse_rl()): greedy reward "
            f"{cor['dense_after']:.3f}, {cmp} without correction "
            f"({unc['dense_after']:.3f}) and {_compare(cor['dense_after'], d['dense_after'], margin)}"
            f" dense.{kept}")
    sch = by.get("sparse-schedule-corrected")
    if cor and sch:
        kv = sch["peak_kv_bytes"] / max(1, d["peak_kv_bytes"])
        lines.append(
            f"What the schedule buys (fitted schedule vs aggressive budget, both with sparse_rl()): "
            f"greedy reward {sch['dense_after']:.3f}, "
            f"{_compare(sch['dense_after'], cor['dense_after'], margin)} the aggressive arm's "
            f"{cor['dense_after']:.3f}; sampled reward (last half) "
            f"{sch['reward_last_half']:.3f} vs {cor['reward_last_half']:.3f}; kept tokens "
            f"{100 * sch['kept_frac']:.1f}% vs {100 * cor['kept_frac']:.1f}%; peak KV "
            f"{sch['peak_kv_bytes']} B vs {cor['peak_kv_bytes']} B aggressive and "
            f"{d['peak_kv_bytes']} B dense ({100 * kv:.0f}% of dense); "
            f"{sch['tokens_per_s']:.0f} vs {d['tokens_per_s']:.0f} tokens/s dense.")
    return lines


def _summary_table(summ: list[dict]) -> str:
    lines = ["| arm | sampled reward step 1 | sampled reward (last half) | dense greedy reward "
             "before -> after | tokens/s (after warm-up) | peak KV bytes | k3 mismatch | "
             "kept tokens |", "|---|---|---|---|---|---|---|---|"]
    for s in summ:
        kept = "-" if s["kept_frac"] != s["kept_frac"] else f"{100 * s['kept_frac']:.1f}%"
        lines.append(f"| {s['arm']} | {s['reward_first']:.3f} | {s['reward_last_half']:.3f} | "
                     f"{s['dense_before']:.3f} -> {s['dense_after']:.3f} | "
                     f"{s['tokens_per_s']:.0f} | {s['peak_kv_bytes']} | {s['mismatch']:.2e} | "
                     f"{kept} |")
    return "\n".join(lines)


def write_report(out: Path, *, rows, table, schedule, config, calib_s: float,
                 notes: list[str] | tuple[str, ...] = ()) -> str:
    """Write plots and report.md into ``out``; return the summary table (markdown).

    A plot that fails is reported in report.md (the table and verdict are still written)."""
    try:
        files, plot_note = write_plots(out, rows, table, schedule, config["tau"]), ""
    except Exception as exc:  # the numbers are worth writing even without plots
        files, plot_note = [], f"Plots failed: {type(exc).__name__}: {exc}"
    summ = summarize(rows)
    tbl = _summary_table(summ)
    findings = verdict({s["arm"]: s for s in summ})
    if all(b is None for b in schedule.budgets):
        findings.append("No calibrated budget reached tau in any bin, so the fitted schedule is "
                        "dense everywhere and the schedule arm samples densely.")
    text = "\n".join([
        "# sparsecorr demo report", "",
        f"Config: `{config}`", "",
        f"Calibration ({calib_s:.1f} s) over budgets {list(table.budgets)}; schedule fitted at "
        f"tau={config['tau']}: budgets per bin {list(schedule.budgets)} (None = dense).", "",
        *[f"Note: {n}" for n in notes], *([""] if notes else []),
        f"Lower q={table.q} quantile of the acceptance per budget and context bin:", "",
        tail_table(table), "",
        "## Summary", "", tbl, "",
        "tokens/s is the wall-clock throughput of the rollout step: it moves with the load of "
        "the machine, so compare arms only from a run on otherwise idle cores.", "",
        "## What each arm shows", "", *[f"- {line}" for line in findings], "",
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
        lines += ["Arms that finished:", "", _summary_table(summarize(done["rows"])), ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path
