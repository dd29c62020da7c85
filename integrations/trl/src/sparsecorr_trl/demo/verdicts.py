r"""The demo's verdicts, computed from `report.summarize`'s per-arm summaries only.

- `correction_effects`: per sampler, what ``sparse_rl()`` bought: the paired difference of the
  final held-out greedy reward (corrected minus uncorrected) over seeds, its 95 % t-interval
  \(\bar d \pm t_{0.975, n-1} s_d/\sqrt n\) and whether it excludes 0 (*resolved*), each arm
  against dense, and the sampler's regime (`REGIMES`).
- `distill_effect`: DistillSparse's acceptance tail with and without its adapter (the same
  learner and budget, paired over seeds) and whether the final reward follows.
- `claims`: the demo's six claims, each holding or not as the numbers say. *Correction rescues
  a sampler* needs, over several seeds, the paired intervals against dense to agree with the
  regime: uncorrected minus dense below 0 (the collapse resolved, `collapse_interval`) and
  corrected minus dense not below 0 (the correction brings training back to dense, not part of
  the way); *the correction under R-KV* is what ``sparse_rl()`` buys with R-KV's sampler
  (``rkv<budget>@<T>``), with both intervals said.

With one seed there is no spread and no interval: a fixed margin (`ONE_SEED_MARGIN`) stands in,
the sentences say so, and none calls a difference resolved (one seed decides nothing).
"""

from __future__ import annotations

import math
from statistics import mean, stdev

from .regimes import FAIL_FRACTION, REGIMES, dense_of, regime, regime_text, why_not

__all__ = ["CLEAR_GAIN", "FAIL_FRACTION", "KV_FRACTION", "ONE_SEED_MARGIN", "REGIMES", "claims",
           "collapse_interval", "correction_effects", "dense_of", "distill_effect", "interval",
           "pm", "spread"]

#: dense GRPO must raise the held-out greedy reward by more than this (and than twice the
#: spread of its gain over seeds) for the first claim
CLEAR_GAIN = 0.05
#: margin standing in for the spread over seeds when a run has one seed
ONE_SEED_MARGIN = 0.02
#: the scheduled arm's peak KV must be at most this fraction of dense's
KV_FRACTION = 0.5
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_NAN = float("nan")


def pm(x: float, sd: float, digits: int = 3, *, signed: bool = False) -> str:
    """``x ± sd`` (just ``x`` when the spread is undefined, one seed)."""
    if x != x:
        return "n/a"
    v = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return v if sd != sd else f"{v} ± {sd:.{digits}f}"


def interval(diffs: list[float]) -> tuple[float, float, float, float]:
    """``(mean, sd, lo, hi)`` of paired differences: the 95 % t-interval (NaN bounds and sd
    for fewer than two values)."""
    d = [x for x in diffs if x == x]
    if not d:
        return _NAN, _NAN, _NAN, _NAN
    if len(d) < 2:
        return d[0], _NAN, _NAN, _NAN
    m, s = mean(d), stdev(d)
    t = _T975[len(d) - 2] if len(d) - 1 <= len(_T975) else 1.96
    half = t * s / math.sqrt(len(d))
    return m, s, m - half, m + half


def _resolved(m: float, lo: float, hi: float) -> int:
    """+1 / -1 when the interval (one seed: the fixed margin) is above / below 0, else 0."""
    if lo != lo:
        return 1 if m > ONE_SEED_MARGIN else -1 if m < -ONE_SEED_MARGIN else 0
    return 1 if lo > 0 else -1 if hi < 0 else 0


def _resolved_text(r: int, one_seed: bool) -> str:
    if one_seed:
        return {1: "above the one-seed margin", -1: "below the one-seed margin",
                0: "within the one-seed margin"}[r]
    return {1: "yes (above 0)", -1: "yes (below 0)", 0: "no"}[r]


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


def _paired(by: dict, a: str, b: str, key: str, op) -> list[float]:
    """``op(a's key, b's key)`` per seed both arms ran."""
    pa, pb = by[a]["per_seed"], by[b]["per_seed"]
    return [op(pa[s][key], pb[s][key]) for s in pa if s in pb]



def _vs_dense(by: dict, arm: str) -> str:
    """'below' / 'above' its dense arm by more than the two arms' spread, else 'within', on
    the seeds both ran (the dense arm may have run over more)."""
    dense = dense_of(by[arm]["sampler"])
    seeds = [s for s in by[arm]["per_seed"] if s in by[dense]["per_seed"]]
    a, d = ([by[x]["per_seed"][s]["dense_after"] for s in seeds] for x in (arm, dense))
    sds = [stdev(v) for v in (a, d) if len(v) > 1]
    tol = max(sds) if sds else ONE_SEED_MARGIN
    diff = mean(a) - mean(d)
    return "below" if diff < -tol else "above" if diff > tol else "within"




def correction_effects(by: dict[str, dict]) -> list[dict]:
    """Per sampler with both a ``sampler/none`` and a ``sampler/sparse_rl`` arm (and a dense
    arm), in order: the arms' final rewards, the paired difference (corrected minus
    uncorrected: ``diff``, ``diff_sd``, ``lo``, ``hi``, ``resolved`` in {+1, 0, -1}), each arm
    against dense (``unc_vs_dense``, ``cor_vs_dense``: below / within / above) and the regime
    (one of `REGIMES`), with the sentences the report prints."""
    out = []
    for sampler in dict.fromkeys(s["sampler"] for s in by.values()):
        ua, ca = f"{sampler}/none", f"{sampler}/sparse_rl"
        if ua not in by or ca not in by or dense_of(sampler) not in by:
            continue
        unc, cor = by[ua], by[ca]
        m, sd, lo, hi = interval(_paired(by, ca, ua, "dense_after", lambda a, b: a - b))
        res, one = _resolved(m, lo, hi), lo != lo
        unc_vs, cor_vs = _vs_dense(by, ua), _vs_dense(by, ca)
        regime_ = regime(by, unc, cor_vs, unc_vs, res, one)
        if regime_ == "rescued" and not one and interval(_paired(
                by, ca, dense_of(sampler), "dense_after", lambda a, b: a - b))[3] < 0:
            regime_ = "partly rescued"  # the seeds' paired interval: still below dense
        n = len(_paired(by, ca, ua, "dense_after", lambda a, b: a))
        diff_text = (f"{pm(m, sd, signed=True)} over {n} seeds, 95% interval "
                     f"[{lo:+.3f}, {hi:+.3f}], " + ("resolved" if res else "not resolved")
                     + " by the seeds" if not one else
                     f"{m:+.3f} (one seed: no interval; a fixed margin of {ONE_SEED_MARGIN} "
                     f"stands in, and it is {_resolved_text(res, True)})")
        out.append({"sampler": sampler, "unc_arm": ua, "cor_arm": ca, "dense_arm": dense_of(sampler),
                    "seeds": [x for x in cor["per_seed"] if x in unc["per_seed"]],
                    "unc": unc["dense_after"], "unc_sd": unc["dense_after_sd"],
                    "cor": cor["dense_after"], "cor_sd": cor["dense_after_sd"],
                    "diff": m, "diff_sd": sd, "lo": lo, "hi": hi, "resolved": res,
                    "resolved_text": _resolved_text(res, one), "diff_text": diff_text,
                    "unc_vs_dense": unc_vs, "cor_vs_dense": cor_vs, "regime": regime_,
                    "regime_text": regime_text(regime_, by, unc, one_seed=one)})
    return out


def distill_effect(by: dict[str, dict], tau: float | None = None) -> dict | None:
    """DistillSparse's arm against itself without the adapter (acceptance tail, paired over
    seeds) and against the same sampler with ``sparse_rl()`` and no adapter (final reward);
    None without a DistillSparse arm."""
    dis = next((s for s in by.values() if s["correction"].endswith("+distill")), None)
    if dis is None:
        return None
    base = by.get(f"{dis['sampler']}/sparse_rl")
    per = dis["per_seed"].values()
    m, sd, lo, hi = interval([p["p_accept"] - p["p_accept_noadapter"] for p in per])
    res = _resolved(m, lo, hi)
    on, off = dis["p_accept"], dis["p_accept_noadapter"]
    text = (f"with sampler {dis['sampler']} the adapter moves the sampler's acceptance 5% tail "
            f"from {pm(off, dis['p_accept_noadapter_sd'])} (adapter off) to "
            f"{pm(on, dis['p_accept_sd'])} (adapter on; the same learner, probed during "
            f"training), a paired difference of {pm(m, sd, signed=True)}"
            + (f" (95% interval [{lo:+.3f}, {hi:+.3f}])" if lo == lo else "")
            + (": resolved by the seeds" if res and lo == lo else
               ": not resolved by the seeds" if lo == lo else
               f" ({_resolved_text(res, True)}; one seed decides nothing)"))
    if tau is not None:
        text += f"; tau = {tau} is " + ("reached" if on >= tau else "not reached")
    follows = None
    if base is not None:
        rm, rsd, rlo, rhi = interval(_paired(by, dis["arm"], base["arm"], "dense_after",
                                             lambda a, b: a - b))
        follows = _resolved(rm, rlo, rhi)
        text += (f". Final greedy reward {pm(dis['dense_after'], dis['dense_after_sd'])} with "
                 f"DistillSparse vs {pm(base['dense_after'], base['dense_after_sd'])} without "
                 f"({base['arm']}), difference {pm(rm, rsd, signed=True)}: reward "
                 + _follows_text(follows, one=rlo != rlo) + ".")
    return {"arm": dis["arm"], "sampler": dis["sampler"], "on": on, "off": off, "diff": m,
            "diff_sd": sd, "lo": lo, "hi": hi, "resolved": res, "reward_follows": follows,
            "text": text}


def _follows_text(follows: int, *, one: bool) -> str:
    """Whether DistillSparse's final reward follows its tail: by the interval over seeds, or,
    with one seed, by the fixed margin (then nothing is called resolved)."""
    if one:
        return {1: "is higher by more than the one-seed margin",
                0: "is within the one-seed margin",
                -1: "is lower by more than the one-seed margin"}[follows] + " (one seed decides nothing)"
    return {1: "follows (higher, resolved)", 0: "does not follow measurably (not resolved)",
            -1: "does not follow (lower, resolved)"}[follows]


def _dense_improves(d: dict) -> tuple[str, bool, str]:
    n = len(d["seeds"])
    seeds = f"{n} seed{'s' if n != 1 else ''}"
    gain_sd = d["gain_sd"] if d["gain_sd"] == d["gain_sd"] else 0.0
    need = max(CLEAR_GAIN, 2 * gain_sd)
    ok = d["gain"] > need
    return ("dense improves", ok,
            f"Dense GRPO moved the held-out greedy reward from "
            f"{pm(d['dense_before'], d['dense_before_sd'])} to "
            f"{pm(d['dense_after'], d['dense_after_sd'])} (gain {pm(d['gain'], d['gain_sd'])}, "
            f"{seeds}): " + ("a clear margin" if ok else "not a clear margin")
            + f" (a clear margin is more than {need:.3f}: {CLEAR_GAIN} and twice the gain's "
              f"spread).")


def _schedule_matches(by: dict) -> tuple[str, bool | None, str]:
    d, sch = by["dense"], by.get("schedule/sparse_rl")
    if sch is None:
        return ("schedule matches dense", None, "The scheduled + corrected arm did not run.")
    tol, from_seeds = spread(by, "dense", sch["arm"])
    diff = sch["dense_after"] - d["dense_after"]
    ratio = _paired(by, sch["arm"], "dense", "dense_after", lambda a, b: a / b if b else _NAN)
    kv = sch["peak_kv_bytes"] / max(1.0, d["peak_kv_bytes"])
    # 'reaches what dense reaches': within the spread, or above dense by more than it
    within, above, small = abs(diff) <= tol, diff > tol, kv <= KV_FRACTION
    where = ("within" if within else "above dense by more than" if above else
             "below dense by more than")
    ok = (within or above) and small
    r = [v for v in ratio if v == v]
    return ("schedule matches dense", ok,
            f"The scheduled + corrected arm reaches "
            f"{pm(mean(r) if r else _NAN, stdev(r) if len(r) > 1 else _NAN, 2)} of dense's final "
            f"reward ({pm(sch['dense_after'], sch['dense_after_sd'])} vs "
            f"{pm(d['dense_after'], d['dense_after_sd'])}) with {100 * kv:.0f}% of its peak KV: "
            f"the difference {diff:+.3f} is {where} {_tol_text(tol, from_seeds)}, and the peak "
            f"KV is " + ("at most" if small else "above") + f" {100 * KV_FRACTION:.0f}% of "
            f"dense's; the claim " + ("holds" if ok else "does not hold") + " in this run.")


def _uncorrected_below(by: dict, aggressive: str) -> tuple[str, bool | None, str]:
    d, unc = by["dense"], by.get(f"{aggressive}/none")
    if unc is None:
        return ("uncorrected below dense", None, "The uncorrected aggressive arm did not run.")
    tol, from_seeds = spread(by, "dense", unc["arm"])
    gap = _paired(by, "dense", unc["arm"], "dense_after", lambda a, b: a - b)
    g = (mean(gap), stdev(gap) if len(gap) > 1 else _NAN)
    below = d["dense_after"] - unc["dense_after"] > tol
    return ("uncorrected below dense", below,
            f"The uncorrected aggressive arm ({unc['arm']}) ends at "
            f"{pm(unc['dense_after'], unc['dense_after_sd'])}, "
            + (f"below dense by {pm(*g)}: measurably below (more than "
               f"{_tol_text(tol, from_seeds)})." if below else
               f"{pm(*g)} under dense: at this scale it did not end measurably below dense (the "
               f"gap is not more than {_tol_text(tol, from_seeds)})."))




def collapse_interval(by: dict, e: dict) -> tuple[float, float, float, float]:
    """``interval`` of the uncorrected arm minus its dense arm (final greedy reward), paired
    over the seeds both ran, for a `correction_effects` item ``e``: the collapse the correction
    is said to rescue is resolved when ``hi < 0``."""
    return interval(_paired(by, e["unc_arm"], e["dense_arm"], "dense_after", lambda a, b: a - b))


def _interval_text(m: float, lo: float, hi: float, n: int) -> str:
    return (f"{m:+.3f} (one seed: no interval)" if lo != lo else
            f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}] over {n} seeds")


def _against_dense(by: dict, e: dict) -> tuple[bool, bool, str]:
    """Each arm of the pair ``e`` against its dense arm, paired over seeds: whether the
    uncorrected arm's collapse is resolved (its interval below 0), whether the corrected arm is
    *not* resolved below dense, and a clause saying both (with one seed there is no interval:
    both True, the fixed margin having decided 'below' and 'not below' already)."""
    def diff(arm):
        d = _paired(by, arm, e["dense_arm"], "dense_after", lambda a, b: a - b)
        return (*interval(d), len(d))
    m, _, lo, hi, n = diff(e["unc_arm"])
    gm, _, glo, ghi, _ = diff(e["cor_arm"])
    one = lo != lo
    collapse, level = one or hi < 0, one or not ghi < 0
    text = (f"{e['unc_arm']} minus {e['dense_arm']} is {_interval_text(m, lo, hi, n)}: the "
            f"collapse the correction is said to rescue is "
            + ("not decided (one seed decides nothing)" if one else
               "resolved" if collapse else "not itself resolved at this sparsity"))
    if not one:
        text += (f"; {e['cor_arm']} minus {e['dense_arm']} is {_interval_text(gm, glo, ghi, n)}: "
                 + ("corrected training is not measurably below dense" if level else
                    f"corrected training still ends below dense (resolved), so the correction "
                    f"recovers part of the gap ({e['diff']:+.3f} of {m:+.3f}), not all of it"))
    return collapse, level, text


def _correction_rescues(by: dict, period: int) -> tuple[str, bool | None, str]:
    effects = correction_effects(by)
    if not effects:
        return ("correction rescues a sampler", None, "No sampler ran with and without the "
                                                      "correction.")
    per = "; ".join(f"{e['sampler']}: {e['regime']} (difference "
                    f"{pm(e['diff'], e['diff_sd'], signed=True)}, uncorrected {e['unc_vs_dense']} "
                    f"{dense_of(e['sampler'])}, corrected {e['cor_vs_dense']} "
                    f"{dense_of(e['sampler'])})" for e in effects)
    found = [(e, *_against_dense(by, e)) for e in effects if e["regime"] == "rescued"]
    rescued = [(e, t) for e, collapse, level, t in found if collapse and level]
    one = all(e["lo"] != e["lo"] for e in effects)
    if rescued:
        return ("correction rescues a sampler", True,
                f"With {', '.join(e['sampler'] for e, _ in rescued)}, uncorrected training ends "
                f"measurably below its dense arm, sparse_rl() training does not, and "
                + (f"the difference exceeds a fixed margin of {ONE_SEED_MARGIN} (one seed: no "
                   f"spread and no interval, so one seed decides nothing; --full checks it over "
                   f"16 seeds)" if one else "the seeds resolve the difference; "
                   + "; ".join(t for _, t in rescued))
                + f". Per sampler: {per}.")
    if found:
        return ("correction rescues a sampler", False,
                f"With {', '.join(e['sampler'] for e, *_ in found)}, sparse_rl() training ends "
                f"higher than uncorrected training (resolved by the seeds) and within the "
                f"seeds' spread of its dense arm, but the paired intervals against dense do not "
                f"show a rescue: " + "; ".join(t for *_, t in found)
                + f". So the regime Sparse-RL describes (a resolved collapse that the "
                  f"correction brings back to dense) is not shown. Per sampler: {per}.")
    return ("correction rescues a sampler", False,
            "No sampler shows the regime Sparse-RL describes (uncorrected training measurably "
            "below dense, corrected not, and the difference "
            + (f"beyond a fixed margin of {ONE_SEED_MARGIN}, one seed standing in for the "
               f"interval" if one else "resolved by the seeds")
            + f"). Per sampler: {per}. What prevents it here: {why_not(by, effects, period)}"
            + "".join(f"; {_against_dense(by, e)[2]}" for e in effects
                      if e["regime"] == "partly rescued") + ".")


def _distill_raises(by: dict, tau: float) -> tuple[str, bool | None, str]:
    d = distill_effect(by, tau)
    if d is None:
        return ("DistillSparse raises the tail", None, "The DistillSparse arm did not run.")
    return ("DistillSparse raises the tail", d["resolved"] > 0,
            d["text"][0].upper() + d["text"][1:])


def _rkv_correction(by: dict) -> tuple[str, bool | None, str]:
    """What sparse_rl() buys under R-KV's sampler (the pairs ``rkv<budget>@<T>``): holds when
    the paired difference (corrected minus uncorrected) is resolved above 0 (one seed: above
    the fixed margin, which decides nothing)."""
    effects = [e for e in correction_effects(by) if e["sampler"].startswith("rkv")]
    if not effects:
        return ("correction under R-KV", None, "The R-KV arms did not run.")
    parts = []
    for e in effects:
        parts.append(
            f"with R-KV's sampler {e['sampler']} (RKV(buffer=0): R-KV's authors' scoring), sparse_rl() "
            f"training ends at {pm(e['cor'], e['cor_sd'])} against {pm(e['unc'], e['unc_sd'])} "
            f"uncorrected, a difference of {e['diff_text']}; against the seeds' spread, uncorrected "
            f"{e['unc_vs_dense']} {e['dense_arm']} and corrected {e['cor_vs_dense']} it "
            f"({e['regime']}); "
            + _against_dense(by, e)[2])
    ok = any(e["resolved"] > 0 for e in effects)
    text = "; ".join(parts)
    return ("correction under R-KV", ok, text[0].upper() + text[1:] + ".")


def claims(by: dict[str, dict], config: dict | None = None) -> list[tuple[str, bool | None, str]]:
    """The demo's claims checked against the numbers: ``(name, holds, sentence)``; ``holds``
    is None when an arm the claim needs did not run. ``config``: the run's `DemoConfig` as a
    dict (aggressive budget, prompt length, tau)."""
    config = config or {}
    d = by.get("dense")
    if d is None:
        return [("dense improves", None, "The dense arm did not run: no claim can be checked.")]
    return [_dense_improves(d), _schedule_matches(by),
            _uncorrected_below(by, f"b{config.get('aggressive_budget', 8)}"),
            _correction_rescues(by, config.get("prompt_len", 16) - 1),
            _distill_raises(by, config.get("tau", 0.5)), _rkv_correction(by)]
