"""The demo report's PNG plots, written atomically from the rows of ``metrics.jsonl``.

- ``calibration.png``: the calibrated tail profile per budget with tau, and the fitted schedule;
- ``curves.png``: per sampler (one column each), the held-out greedy reward (top) and the sampled
  reward (bottom) per step, uncorrected vs ``sparse_rl()`` (and DistillSparse), dense drawn in
  every column for reference, mean over seeds with a min-max band;
- ``mismatch.png``: per sampler, the probe's acceptance tail (Sparrow's 5 % quantile) and the
  fraction of tokens ``sparse_rl()``'s band rejects, over training, for every arm;
- ``memory_speed.png``: peak KV per arm as a share of dense's, and tokens/s.
"""

from __future__ import annotations

from pathlib import Path
from statistics import mean

from .verdicts import dense_of

__all__ = ["PNGS", "style", "write_plots"]

PNGS = ("calibration.png", "curves.png", "mismatch.png", "memory_speed.png")
_NAN = float("nan")
_PALETTE = ("#d62728", "#ff7f0e", "#2ca02c", "#1f77b4", "#9467bd", "#8c564b", "#e377c2")
_MARKERS = "s^Dv<>P*X"
_LINES = {"none": "--", "sparse_rl": "-", "sparse_rl+distill": (0, (1, 1.5))}


def style(arm: str, sampler: str, correction: str, samplers: list[str]) -> dict:
    """One look per arm: the colour and marker name the sampler, the line the correction."""
    if sampler.startswith("dense"):
        return {"color": "#333333", "marker": "o", "linestyle": "-"}
    i = samplers.index(sampler) if sampler in samplers else len(samplers)
    return {"color": _PALETTE[i % len(_PALETTE)], "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": _LINES.get(correction, "-.")}


def _labels(rows: list[dict]) -> dict[str, tuple[str, str]]:
    """arm -> (sampler, correction), in order of appearance."""
    return {r["arm"]: (r.get("sampler", r["arm"]), r.get("correction", "")) for r in rows}


def _style_axes(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _calibration_plot(path: Path, table, schedule, tau: float) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for i, b in enumerate(table.budgets):
        ax[0].plot([j * table.bin_size for j in range(table.values.shape[1])],
                   table.values[i].tolist(), marker="osD^vP*X"[i % 8],
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


def _series(rows: list[dict], arm: str, key: str, *, before: str | None = None):
    """Steps and, over seeds, the mean, min and max of ``key`` at each step (NaN skipped);
    ``before``: the key row 0 holds the value before training under (plotted at step 0)."""
    by_step: dict[int, list[float]] = {}
    for r in rows:
        if r["arm"] != arm:
            continue
        if before and r["step"] == 0:
            v = r.get(before, _NAN)
            if v is not None and v == v:
                by_step.setdefault(0, []).append(v)
        v = r.get(key, _NAN)
        if v is not None and v == v:
            by_step.setdefault(r["step"] + 1, []).append(v)
    xs = sorted(by_step)
    return (xs, [mean(by_step[x]) for x in xs], [min(by_step[x]) for x in xs],
            [max(by_step[x]) for x in xs])


def _draw(ax, rows: list[dict], arms: list[str], key: str, *, before: str | None = None) -> None:
    """Each arm's series of ``key``; DistillSparse's also with its adapter off (the probe's
    ``..._noadapter`` keys), in grey."""
    labels = _labels(rows)
    samplers = list(dict.fromkeys(s for s, _ in labels.values() if not s.startswith("dense")))
    for arm in arms:
        st = style(arm, *labels[arm], samplers)
        series = [(key, before, arm, st)]
        if key.startswith("probe_"):
            series.append((f"{key}_noadapter", before and f"{key}_noadapter_before",
                           f"{arm} (adapter off)", {**st, "color": "#888888"}))
        for k, b, label, look in series:
            xs, ys, lo, hi = _series(rows, arm, k, before=b)
            if not xs:
                continue
            ax.plot(xs, ys, label=label, markersize=4, fillstyle="none", markeredgewidth=1.2,
                    linewidth=1.6, **look)
            if any(a != b for a, b in zip(lo, hi)):
                ax.fill_between(xs, lo, hi, color=look["color"], alpha=0.12, linewidth=0)


def _band(rows: list[dict]) -> str:
    """How many seeds each curve averages: one count, or the counts the arms ran over."""
    seeds: dict[str, set] = {}
    for r in rows:
        seeds.setdefault(r["arm"], set()).add(r.get("seed", 0))
    counts = sorted({len(v) for v in seeds.values()})
    if counts == [1]:
        return "one seed"
    n = " or ".join(str(c) for c in counts)
    return f"mean of {n} seeds per arm, band min-max"


def _per_sampler(rows: list[dict]) -> dict[str, list[str]]:
    """sampler -> its arms, its dense arm first (``dense``, or ``dense@T`` for the
    long-response samplers)."""
    labels = _labels(rows)
    out: dict[str, list[str]] = {}
    for arm, (sampler, _) in labels.items():
        if not sampler.startswith("dense"):
            out.setdefault(sampler, [a for a in (dense_of(sampler),) if a in labels]).append(arm)
    return out or {"dense": [a for a in labels if a == "dense"]}


def _grid(path: Path, rows: list[dict], panels: list[tuple[str, str | None, str, tuple]],
          title: str, *, per_row: int = 4) -> None:
    """One column per sampler (``per_row`` to a row of blocks), one row per ``(key, before,
    ylabel, ylim)`` panel within each block."""
    import matplotlib.pyplot as plt

    cols = _per_sampler(rows)
    n, k = len(cols), len(panels)
    width, blocks = min(per_row, n), -(-n // per_row)
    fig, ax = plt.subplots(k * blocks, width, figsize=(3.7 * width, 3.0 * k * blocks),
                           squeeze=False)
    for j, (sampler, arms) in enumerate(cols.items()):
        for i, (key, before, ylabel, ylim) in enumerate(panels):
            a = ax[(j // per_row) * k + i][j % per_row]
            _draw(a, rows, arms, key, before=before)
            if ylim:
                a.set_ylim(*ylim)
            a.set(xlabel="optimizer steps done", ylabel=ylabel if j % per_row == 0 else None,
                  title=sampler if i == 0 else None)
            _style_axes(a)
            a.legend(fontsize=7, loc="best")
    for j in range(n, width * blocks):
        for i in range(k):
            ax[(j // per_row) * k + i][j % per_row].set_visible(False)
    fig.suptitle(f"{title} ({_band(rows)})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def _curves_plot(path: Path, rows: list[dict]) -> None:
    _grid(path, rows, [("dense_eval_reward", "dense_eval_reward_before",
                        "held-out greedy reward (dense model)", (-0.03, 1.03)),
                       ("reward", None, "reward of sampled rollouts", (-0.03, 1.03))],
          "what the learner can do (top) and what its sampler got (bottom), per sampler")


def _mismatch_plot(path: Path, rows: list[dict]) -> None:
    _grid(path, rows, [("probe_accept_q05", "probe_accept_q05_before",
                        "acceptance, 5% quantile", (-0.03, 1.03)),
                       ("probe_rejected_frac", "probe_rejected_frac_before",
                        "tokens sparse_rl's band rejects", (-0.02, 1.02))],
          "the sampler probe: mismatch between each arm's sampler and its dense model")


def _memory_speed_plot(path: Path, summ: list[dict]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 0.45 * len(summ) + 1.6))
    names = [s["arm"] for s in summ]
    samplers = list(dict.fromkeys(s["sampler"] for s in summ
                                  if not s["sampler"].startswith("dense")))
    colors = [style(s["arm"], s["sampler"], s["correction"], samplers)["color"] for s in summ]
    dense = {s["arm"]: s["peak_kv_bytes"] for s in summ if s["sampler"].startswith("dense")}
    kib = [s["peak_kv_bytes"] / 1024 for s in summ]
    ax[0].barh(names, kib, color=colors)
    for i, s in enumerate(summ):
        ref = dense.get(dense_of(s["sampler"]))
        if ref:
            ax[0].annotate(f"{100 * s['peak_kv_bytes'] / ref:.0f}% of {dense_of(s['sampler'])}",
                           (kib[i], i), xytext=(4, 0), textcoords="offset points", va="center")
    ax[0].set_xlim(0, max(kib) * 1.45)
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


def write_plots(out: Path, rows: list[dict], table, schedule, tau: float,
                summ: list[dict]) -> list[str]:
    """Write `PNGS` into ``out`` (``summ``: `report.summarize` of ``rows``); return their
    names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draws = {"calibration.png": lambda p: _calibration_plot(p, table, schedule, tau),
             "curves.png": lambda p: _curves_plot(p, rows),
             "mismatch.png": lambda p: _mismatch_plot(p, rows),
             "memory_speed.png": lambda p: _memory_speed_plot(p, summ)}
    files = []
    with plt.rc_context({"font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8}):
        try:
            for name in PNGS:
                tmp = out / f".{name}.tmp.png"
                draws[name](tmp)
                tmp.replace(out / name)  # atomic: a reader never sees half a PNG
                files.append(name)
        finally:
            plt.close("all")
    return files
