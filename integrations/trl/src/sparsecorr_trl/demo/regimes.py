"""Which regime a sampler's pair of arms is in, and the sentences that say it (`verdicts`).

The regimes (`REGIMES`) compare each arm of a pair (``sampler/none``, ``sampler/sparse_rl``)
with its dense arm (`dense_of`); `why_not` names what keeps the regime Sparse-RL describes
from showing. Split from `verdicts` to keep modules small; `verdicts` re-exports the names.
"""

from __future__ import annotations

__all__ = ["FAIL_FRACTION", "REGIMES", "budget_of", "dense_of", "fails", "regime", "regime_text",
           "why_not"]

#: a sampler whose sampled reward at step 1 (same shipped model for every arm) is below this
#: fraction of dense's fails outright
FAIL_FRACTION = 0.5
#: what a sampler's pair of arms shows (see `correction_effects`): uncorrected not measurably
#: below dense (harmless); uncorrected below, corrected not (rescued, if the seeds resolve their
#: difference); partly rescued (over several seeds, a rescued pair whose corrected arm still
#: ends below dense by the paired interval); both below (the sampler fails outright when its
#: sampled reward at step 1 is below `FAIL_FRACTION` of dense's)
REGIMES = ("harmless", "rescued", "rescued, not resolved", "rescued, within the one-seed margin",
           "partly rescued", "fails outright", "both below dense")
#: t_{0.975, df} for df = 1..30 (larger df: 1.96)


def dense_of(sampler: str) -> str:
    """The dense arm a sampler is compared with: ``dense``, or ``dense@T`` for a sampler of
    the long-response arms (``b16@64``)."""
    return f"dense@{sampler.split('@', 1)[1]}" if "@" in sampler else "dense"



def fails(by: dict, unc: dict) -> bool:
    return unc["reward_first"] < FAIL_FRACTION * by[dense_of(unc["sampler"])]["reward_first"]


def regime(by: dict, unc: dict, cor_vs: str, unc_vs: str, resolved: int, one_seed: bool) -> str:
    if unc_vs != "below":
        return "harmless"
    if cor_vs != "below":
        return ("rescued" if resolved > 0 else "rescued, within the one-seed margin" if one_seed
                else "rescued, not resolved")
    return "fails outright" if fails(by, unc) else "both below dense"


def regime_text(regime: str, by: dict, unc: dict, *, one_seed: bool = False) -> str:
    d = by[dense_of(unc["sampler"])]
    mm = (f"acceptance 5% tail {unc['p_accept']:.3f}, band rejects "
          f"{100 * unc['p_rejected']:.1f}% of tokens, {100 * unc['p_vetoed']:.1f}% of sequences "
          f"vetoed, ESS {unc['p_ess']:.3f}")
    return {
        "fails outright": f"both end below {dense_of(unc['sampler'])}, and the sampler fails "
                          f"outright: its "
                          f"sampled reward at step 1 is {unc['reward_first']:.3f}, below "
                          f"{FAIL_FRACTION} of dense's {d['reward_first']:.3f} on the same "
                          f"model, so its rollouts rarely hold the answer, and a correction can "
                          f"reweight or drop them but not supply it ({mm})",
        "harmless": f"uncorrected training is not measurably below "
                    f"{dense_of(unc['sampler'])}: this sampler's "
                    f"mismatch ({mm}) did not bias training enough to show",
        "rescued": f"uncorrected training ends below {dense_of(unc['sampler'])}, corrected "
                   f"training does not, and "
                   + ("the difference exceeds the one-seed margin (one seed decides nothing)"
                      if one_seed else "the seeds resolve the difference")
                   + f": the regime Sparse-RL describes ({mm})",
        "rescued, not resolved": f"uncorrected training ends below {dense_of(unc['sampler'])} "
                                 f"and corrected training does not, but the seeds do not "
                                 f"resolve their difference ({mm})",
        "rescued, within the one-seed margin": f"uncorrected training ends below "
                                               f"{dense_of(unc['sampler'])} and corrected "
                                               f"training does not, but their difference is "
                                               f"within the one-seed margin ({mm})",
        "partly rescued": f"uncorrected training ends below {dense_of(unc['sampler'])}, "
                          f"corrected training ends higher (resolved) and within the seeds' "
                          f"spread of {dense_of(unc['sampler'])}, but its paired interval "
                          f"against {dense_of(unc['sampler'])} is still below 0: the correction "
                          f"recovers part of the gap, not all of it ({mm})",
        "both below dense": f"both end below {dense_of(unc['sampler'])}: the correction does "
                            f"not bring this sampler to that level ({mm})",
    }[regime]


def budget_of(sampler: str) -> int | None:
    """The budget of a StreamingLLM sampler label ``b<budget>``; None for any other."""
    return int(sampler[1:]) if sampler[:1] == "b" and sampler[1:].isdigit() else None


def why_not(by: dict, effects: list[dict], period: int) -> str:
    """Which property of the task keeps the regime from showing, from the regimes found."""
    fails = [e for e in effects if e["regime"] == "fails outright"]
    harmless = [e for e in effects if e["regime"] == "harmless"]
    partly = [e for e in effects if e["regime"] == "partly rescued"]
    parts = []
    if fails:
        names = ", ".join(e["sampler"] for e in fails)
        worst = max(by[e["unc_arm"]]["reward_first"] for e in fails)
        short = [e["sampler"] for e in fails if (budget_of(e["sampler"]) or period) < period]
        dense = min(by[dense_of(e["sampler"])]["reward_first"] for e in fails)
        parts.append(
            f"{names} fail{'s' if len(fails) == 1 else ''} outright (sampled reward at step 1 at "
            f"most {worst:.3f} against dense's {dense:.3f})"
            + (f"; {', '.join(short)} {'is a' if len(short) == 1 else 'are'} StreamingLLM "
               f"budget{'' if len(short) == 1 else 's'} below the task's period: every answer "
               f"token recites the token {period} positions back, which such a budget has "
               f"evicted, so the rollouts lack the answer whether or not they are corrected"
               if short else ""))
    if harmless:
        names = ", ".join(e["sampler"] for e in harmless)
        rej = max(by[e["unc_arm"]]["p_rejected"] for e in harmless)
        acc = min(by[e["unc_arm"]]["p_accept"] for e in harmless)
        parts.append(
            f"{names} train{'s' if len(harmless) == 1 else ''} at dense's level without the "
            f"correction, although sparse_rl()'s band would reject up to {100 * rej:.1f}% of "
            f"the tokens and the acceptance tail falls to {acc:.3f}: at this scale (a tiny "
            f"model, a 64-word vocabulary, 24 steps) that mismatch does not bias uncorrected "
            f"training measurably")
    if partly:
        parts.append(
            f"with {', '.join(e['sampler'] for e in partly)} the correction recovers part of a "
            f"resolved collapse, but corrected training still ends below its dense arm by the "
            f"paired interval")
    if fails and harmless and len(fails) + len(harmless) == len(effects):
        parts.append("so every sampler here either loses the answer or carries a mismatch that "
                     "does no measurable harm, and none sits between the two")
    if parts:
        return "; ".join(parts)
    one = all(e["lo"] != e["lo"] for e in effects)
    return ("with one seed, no such difference is beyond the fixed margin" if one else
            "the seeds do not resolve the differences")
