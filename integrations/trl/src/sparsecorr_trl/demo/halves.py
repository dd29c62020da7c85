r"""Each deciding verdict on each half of the seeds and pooled, from `report.summarize`'s summaries.

A sampler pair (``sampler/none``, ``sampler/sparse_rl`` and its dense arm) that ran over at least
`MIN_SPLIT` common seeds is a *deciding* comparison here (``--full`` runs the claims' pairs over
16 seeds, the others over 3). Three paired differences of the final held-out greedy reward are
given on the first half of the seeds (0-7), the second half (8-15) and all of them, each with
the 95 % t-interval \(\bar d \pm t_{0.975, n-1} s_d/\sqrt n\) that `verdicts.interval` computes:

- ``correction``: corrected minus uncorrected (what the correction buys);
- ``collapse``: uncorrected minus dense (the harm the correction is said to rescue: resolved
  below 0 when the uncorrected arm measurably ends below dense);
- ``gap``: corrected minus dense.

A verdict that holds on one half and not on the other is said to rest on the seeds drawn.
"""

from __future__ import annotations

from .verdicts import correction_effects, interval

__all__ = ["COMPARISONS", "MIN_SPLIT", "collapse", "seed_halves", "split_rows", "split_verdicts"]

#: a pair is split into halves when its arms share at least this many seeds (4: two per half)
MIN_SPLIT = 4
#: comparison key -> (minuend arm role, subtrahend arm role, label)
COMPARISONS = {"correction": ("cor_arm", "unc_arm", "sparse_rl - none"),
               "collapse": ("unc_arm", "dense_arm", "none - dense"),
               "gap": ("cor_arm", "dense_arm", "sparse_rl - dense")}


def seed_halves(seeds: list) -> list[tuple[str, list]]:
    """``[(label, seeds)]``: the first half, the second half (sorted seeds, halves of equal size,
    the second one larger by one for an odd count) and all, labelled by their range
    (``"seeds 0-7"``); only the pooled entry for fewer than `MIN_SPLIT` seeds."""
    s = sorted(seeds)
    parts = [s[:len(s) // 2], s[len(s) // 2:], s] if len(s) >= MIN_SPLIT else [s]
    return [(_label(p, pooled=p is s), p) for p in parts]


def _label(seeds: list, *, pooled: bool) -> str:
    rng = (f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1))
           else ", ".join(str(x) for x in seeds))
    return f"seeds {rng}" + (" (pooled)" if pooled else "")


def _paired(by: dict, a: str, b: str, seeds: list) -> list[float]:
    pa, pb = by[a]["per_seed"], by[b]["per_seed"]
    return [pa[s]["dense_after"] - pb[s]["dense_after"] for s in seeds if s in pa and s in pb]


def split_verdicts(by: dict[str, dict], e: dict) -> list[dict]:
    """For one `correction_effects` item ``e``: per seed set of `seed_halves` over the pair's
    common seeds (also those its dense arm ran), per comparison of `COMPARISONS`, a dict with
    ``part`` (label), ``seeds``, ``comparison``, ``label``, ``mean``, ``sd``, ``lo``, ``hi`` and
    ``resolved`` (+1 / -1: the interval above / below 0, 0: it holds 0, None: no interval)."""
    dense = by[e["dense_arm"]]["per_seed"]
    seeds = [s for s in e["seeds"] if s in dense]
    out = []
    for part, ss in seed_halves(seeds):
        for key, (a, b, label) in COMPARISONS.items():
            m, sd, lo, hi = interval(_paired(by, e[a], e[b], ss))
            res = None if lo != lo else 1 if lo > 0 else -1 if hi < 0 else 0
            out.append({"part": part, "seeds": ss, "comparison": key,
                        "label": f"{e['sampler']}: {label.replace('dense', e['dense_arm'])}",
                        "mean": m, "sd": sd, "lo": lo, "hi": hi, "resolved": res})
    return out


def collapse(by: dict[str, dict], e: dict) -> dict:
    """The pooled ``collapse`` item of `split_verdicts` (uncorrected minus dense over all the
    pair's common seeds)."""
    return next(v for v in reversed(split_verdicts(by, e)) if v["comparison"] == "collapse")


def split_rows(by: dict[str, dict]) -> list[tuple[dict, list[dict]]]:
    """``[(effect, split_verdicts)]`` for every pair with at least `MIN_SPLIT` common seeds."""
    return [(e, split_verdicts(by, e)) for e in correction_effects(by)
            if len([s for s in e["seeds"] if s in by[e["dense_arm"]]["per_seed"]]) >= MIN_SPLIT]


def verdict_cell(v: dict) -> str:
    """``+0.082 [+0.035, +0.129], resolved (above 0)`` (or ``not resolved``; ``n/a``)."""
    if v["mean"] != v["mean"]:
        return "n/a"
    if v["resolved"] is None:
        return f"{v['mean']:+.3f} (one seed: no interval)"
    word = {1: "resolved (above 0)", -1: "resolved (below 0)", 0: "not resolved"}[v["resolved"]]
    return f"{v['mean']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}], {word}"
