"""The demo's report: PNG plots and report.md with a per-arm summary table."""

from __future__ import annotations

from pathlib import Path
from statistics import mean

from .._io import atomic_write_text


def summarize(rows: list[dict]) -> list[dict]:
    """Per arm: sampled reward (first step, last-half mean), the dense model's greedy reward
    before and after training, mean tokens/s, peak KV bytes and mean k3 mismatch."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        tail = rs[len(rs) // 2:]
        out.append({"arm": arm, "reward_first": rs[0]["reward"],
                    "reward_last_half": mean(r["reward"] for r in tail),
                    "dense_before": rs[0].get("dense_eval_reward_before", float("nan")),
                    "dense_after": rs[-1].get("dense_eval_reward", float("nan")),
                    "tokens_per_s": mean(r["tokens_per_s"] for r in rs),
                    "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs),
                    "mismatch": mean(r.get("kl_k3", float("nan")) for r in rs)})
    return out


def _plots(out: Path, rows, table, schedule, tau) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    vals = table.values
    for i, b in enumerate(table.budgets):
        ax[0].plot([j * table.bin_size for j in range(vals.shape[1])], vals[i].tolist(),
                   marker="o", label=f"budget {b}")
    ax[0].axhline(tau, color="k", ls="--", label=f"tau={tau}")
    ax[0].set(xlabel="context length", ylabel=f"q={table.q} tail of acceptance",
              title="tail profile")
    ax[0].legend(fontsize=7)
    ax[1].step([j * schedule.bin_size for j in range(len(schedule.budgets))],
               [-1 if b is None else b for b in schedule.budgets], where="post")
    ax[1].set(xlabel="context length", ylabel="budget (-1 = dense)", title="fitted schedule")
    fig.tight_layout()
    fig.savefig(out / "calibration.png", dpi=80)
    files.append("calibration.png")
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.2))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        steps = [r["step"] for r in rs]
        ax[0].plot(steps, [r["reward"] for r in rs], label=arm)
        ax[1].plot([0] + [s + 1 for s in steps],
                   [rs[0].get("dense_eval_reward_before", float("nan"))]
                   + [r["dense_eval_reward"] for r in rs], label=arm)
        ax[2].plot(steps, [max(r.get("kl_k3", float("nan")), 1e-8) for r in rs], label=arm)
    ax[0].set(xlabel="step", ylabel="reward of sampled rollouts", title="training reward")
    ax[1].set(xlabel="optimizer steps", ylabel="greedy reward, dense model",
              title="what the learner can do")
    ax[2].set(xlabel="step", ylabel="k3 KL(sampler || dense)", title="rollout mismatch",
              yscale="log")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=80)
    files.append("curves.png")
    summ = summarize(rows)
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    names = [s["arm"] for s in summ]
    ax[0].bar(names, [s["peak_kv_bytes"] / 1024 for s in summ])
    ax[0].set(ylabel="peak KV (KiB)", title="KV memory")
    ax[1].bar(names, [s["tokens_per_s"] for s in summ])
    ax[1].set(ylabel="tokens/s", title="generation throughput")
    for a in ax:
        a.tick_params(axis="x", labelsize=6)
    fig.tight_layout()
    fig.savefig(out / "memory_speed.png", dpi=80)
    files.append("memory_speed.png")
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


def _verdict(by: dict[str, dict]) -> str:
    """What happened, from the dense model's greedy reward after training (not the sampled
    reward, which for a sparse arm measures the sampler)."""
    dense = by["dense"]["dense_after"]
    unc, cor = by["sparse-uncorrected"], by["sparse-schedule-corrected"]
    margin = max(0.02, 0.1 * dense)
    if unc["dense_after"] < dense - margin:
        text = (f"training on uncorrected aggressive-budget rollouts damaged the dense model: its "
                f"greedy reward fell from {unc['dense_before']:.3f} to {unc['dense_after']:.3f} "
                f"(dense arm: {dense:.3f})")
    else:
        text = ("no clear degradation of the dense model under uncorrected aggressive-budget "
                f"rollouts (greedy reward {unc['dense_after']:.3f} vs {dense:.3f} for the dense "
                "arm, within the margin) at this scale: the run shows the machinery, not the "
                "effect")
    ok = cor["dense_after"] >= dense - margin
    text += ("; the fitted schedule with correction kept it at "
             f"{cor['dense_after']:.3f} with peak KV {cor['peak_kv_bytes']} B vs "
             f"{by['dense']['peak_kv_bytes']} B dense" if ok else
             f"; the fitted schedule with correction ended at {cor['dense_after']:.3f}, also "
             "below the dense arm")
    return text


def write_report(out: Path, *, rows, table, schedule, config, calib_s: float) -> str:
    """Write plots and report.md into ``out``; return the summary table (markdown)."""
    files = _plots(out, rows, table, schedule, config["tau"])
    summ = summarize(rows)
    lines = ["| arm | sampled reward step 0 | sampled reward (last half) | dense greedy reward "
             "before -> after | tokens/s | peak KV bytes | k3 mismatch |",
             "|---|---|---|---|---|---|---|"]
    for s in summ:
        lines.append(f"| {s['arm']} | {s['reward_first']:.3f} | {s['reward_last_half']:.3f} | "
                     f"{s['dense_before']:.3f} -> {s['dense_after']:.3f} | "
                     f"{s['tokens_per_s']:.0f} | {s['peak_kv_bytes']} | {s['mismatch']:.2e} |")
    tbl = "\n".join(lines)
    verdict = _verdict({s["arm"]: s for s in summ})
    if all(b is None for b in schedule.budgets):
        verdict += ("; no calibrated budget reached tau in any bin, so the fitted schedule is "
                    "dense everywhere and the corrected arm samples densely")
    text = "\n".join([
        "# sparsecorr demo report", "",
        f"Config: `{config}`", "",
        f"Calibration ({calib_s:.1f} s) over budgets {list(table.budgets)}; schedule fitted at "
        f"tau={config['tau']}: budgets per bin {list(schedule.budgets)} (None = dense).", "",
        f"Lower q={table.q} quantile of the acceptance per budget and context bin:", "",
        tail_table(table), "",
        "## Summary", "", tbl, "",
        f"Outcome: {verdict}.", "",
        "## Plots", "", *[f"![{f}]({f})" for f in files], ""])
    atomic_write_text(out / "report.md", text)
    return tbl
