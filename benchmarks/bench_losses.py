"""The loss path where users run it: compiled, against TRL's compiled loss (issue #25).

Forward + backward on float32 ``[B, T]`` log-probs with a ragged mask (lengths uniform in
[T/2, T]) at 64x4096 and 256x8192, every implementation called once per round, in an order
shuffled every round (seeded). Medians of ``--rounds`` rounds. Rows:

- **compiled** (``torch.compile(fullgraph=True)`` of the forward, backward through the compiled
  graph): sparsecorr ``sparse_grpo(..., rollout_logp=..., correction=sparse_rl())`` with the
  default metrics (record, correction, loss and every metric), against TRL 1.16's ``dapo`` loss
  with its token_truncate IS ratio (cap 2) written as the arithmetic of TRL's IS block and
  ``_compute_loss`` (TRL's own code runs through ``exec`` of its source in the eager rows, which
  ``torch.compile`` cannot trace). Target: <= 2.0x;
- **eager**, reported for what they are (no target; a CPU eager loss is not where anyone
  trains): the same sparsecorr call, ``metrics="none"``, plain GRPO, ``sparse_rl()`` alone, TRL's
  bare loss with its real IS block, TRL's real ``_compute_loss``, OpenRLHF 0.11 ``PolicyLoss``
  and verl 0.9.1's rollout correction + vanilla policy loss (loaded as the parity tests load
  them, ``benchmarks/_peers.py``).

The aten-op-count and CPU-eager targets of issue #13 are retired (``RESULTS.md`` says why).
``--runs N`` repeats the whole measurement in N fresh processes. Also: ``kl_from_logits`` peak
extra memory and time against the naive full-softmax KL.

Run: ``python benchmarks/bench_losses.py [--quick] [--runs 3] [--no-kl]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
import _peers
from _common import machine, peak_rss_delta, setup, table

from sparsecorr.correction import sparse_rl
from sparsecorr.losses import sparse_grpo
from sparsecorr.mismatch import measure

FLOOR = "floor (exp-clamp-mul)"
OURS_C = "compiled: sparsecorr sparse_grpo + sparse_rl(), default metrics"
TRL_C = "compiled: TRL 1.16 dapo loss + token_truncate IS"
OURS = "sparsecorr sparse_grpo + sparse_rl(), default metrics"
OURS_NONE = "sparsecorr sparse_grpo + sparse_rl(), metrics='none'"
OURS_PLAIN = "sparsecorr sparse_grpo, plain GRPO"
OURS_CORR = "sparsecorr sparse_rl() alone (measure + correct + metrics)"
TRL_BARE = "TRL 1.16 bare GRPO loss + its token_truncate IS"
TRL_REAL = "TRL 1.16 _compute_loss (real, with its metrics) + IS"
ORLHF = "OpenRLHF 0.11 PolicyLoss, token mask [0.5, 5]"
VERL = "verl 0.9.1 rollout correction + vanilla policy loss"
VERL_CORR = "verl 0.9.1 rollout correction alone (with its metrics)"


def make_inputs(b: int, t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 4
    rollout = old - torch.randn(b, t, generator=g) * 0.2
    logp = old + torch.randn(b, t, generator=g) * 0.05
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    return dict(old=old, rollout=rollout, logp=logp, mask=mask, mask_f=mask.float(),
                mask_i=mask.long(), adv=torch.randn(b, generator=g),
                tokens=torch.zeros(b, t, dtype=torch.long), prompt=torch.ones(b, 4, dtype=torch.long))


def floor(d):
    return (d["old"] - d["rollout"]).exp().clamp(max=2.0) * d["mask"]


def ours(d, metrics="default"):
    lp = d["logp"].clone().requires_grad_(True)
    out = sparse_grpo(lp, d["old"], d["adv"], d["mask"], rollout_logp=d["rollout"],
                      correction=sparse_rl(), metrics=metrics)
    out.loss.backward()
    return out.metrics


def ours_plain(d):
    lp = d["logp"].clone().requires_grad_(True)
    sparse_grpo(lp, d["old"], d["adv"], d["mask"]).loss.backward()


def ours_correction(d):
    return sparse_rl()(measure(d["old"], d["rollout"], d["mask"])).metrics


def _ours_step(logp, old, rollout, adv, mask):
    out = sparse_grpo(logp, old, adv, mask, rollout_logp=rollout, correction=sparse_rl())
    return out.loss, out.metrics


def _trl_step(logp, old, rollout, adv, mask_f):
    """TRL 1.16's token_truncate IS block and ``dapo`` loss arithmetic (``_compute_loss``)."""
    diff = torch.nan_to_num((old - rollout) * mask_f, nan=0.0)  # TRL's per-token IS log-ratio
    is_ratio = torch.clamp(torch.exp(diff), max=2.0)
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    a = adv.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a) * is_ratio
    return (per_token_loss * mask_f).sum() / mask_f.sum().clamp(min=1.0)


def compiled_rows() -> dict[str, object]:
    ours_c = torch.compile(_ours_step, fullgraph=True)
    trl_c = torch.compile(_trl_step, fullgraph=True)

    def ours_compiled(d):
        lp = d["logp"].clone().requires_grad_(True)
        loss, metrics = ours_c(lp, d["old"], d["rollout"], d["adv"], d["mask"])
        loss.backward()
        return metrics

    def trl_compiled(d):
        lp = d["logp"].clone().requires_grad_(True)
        trl_c(lp, d["old"], d["rollout"], d["adv"], d["mask_f"]).backward()

    return {OURS_C: ours_compiled, TRL_C: trl_compiled}


def implementations() -> dict[str, object]:
    impls = {FLOOR: floor, **compiled_rows(), OURS: ours, OURS_NONE: lambda d: ours(d, "none"), OURS_PLAIN: ours_plain,
             OURS_CORR: ours_correction}
    for name, make in ((TRL_BARE, _peers.trl_bare), (TRL_REAL, _peers.trl_real),
                       (ORLHF, _peers.openrlhf_policy_loss)):
        fn = make()
        if fn is not None:
            impls[name] = fn
    verl = _peers.verl_functions()
    if verl is not None:
        impls[VERL_CORR], impls[VERL] = verl
    return impls


def measure_size(b: int, t: int, rounds: int) -> dict:
    d = make_inputs(b, t)
    impls = implementations()
    times: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():  # warm-up (compiles the compiled rows)
        fn(d)
        fn(d)
    rng = random.Random(0)
    names = list(impls)
    for _ in range(rounds):  # rotation: every implementation once per round, in a fresh order
        rng.shuffle(names)  # (a fixed order charges the cost of following verl to one row)
        for name in names:
            t0 = time.perf_counter()
            impls[name](d)
            times[name].append(time.perf_counter() - t0)
    return {"median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}}


TARGETS = [  # (label, numerator, denominator, target, is an upper bound)
    ("compiled: sparse_grpo + sparse_rl() / TRL dapo + IS", OURS_C, TRL_C, 2.0, True),
    ("eager: sparse_grpo + sparse_rl() / TRL bare loss + IS", OURS, TRL_BARE, None, True),
    ("eager: sparse_grpo + sparse_rl() / TRL real _compute_loss", OURS, TRL_REAL, None, True),
    ("eager: sparse_grpo + sparse_rl() / OpenRLHF PolicyLoss", OURS, ORLHF, None, True),
    ("eager: compiled / eager sparse_grpo + sparse_rl()", OURS_C, OURS, None, True),
]


def ratios(result: dict) -> dict[str, float]:
    med = result["median_ms"]
    return {label: med[a] / med[b] for label, a, b, _, _ in TARGETS if a in med and b in med}


def render(results: list[dict], size: str) -> str:
    meds = {k: statistics.median(r[size]["median_ms"][k] for r in results)
            for k in results[0][size]["median_ms"]}
    base = meds[FLOOR]
    rows = [[k, f"{v:.2f}", f"{v / base:.1f}"] for k, v in meds.items()]
    out = [f"{size}, fwd+bwd, median over {len(results)} run(s) of per-run medians",
           table(["implementation", "ms", "x floor"], rows), ""]
    per_run = [ratios(r[size]) for r in results]
    trows = []
    for label, _, _, target, upper in TARGETS:
        vals = [p[label] for p in per_run if label in p]
        if not vals:
            continue
        med = statistics.median(vals)
        spread = f"[{min(vals):.2f}, {max(vals):.2f}]"
        if target is None:
            verdict = "(reported, no target)"
        else:
            verdict = "met" if (med <= target if upper else med >= target) else "missed"
        goal = "" if target is None else f"{'<=' if upper else '>='} {target:g}"
        trows.append([label, f"{med:.2f}", spread, goal, verdict])
    out.append(table(["ratio", "median", "[min, max] over runs", "target", ""], trows))
    return "\n".join(out)


def bench_kl_memory(shape: tuple[int, int, int]) -> str:
    b, t, v = shape
    size = b * t * v * 4
    setup_code = (
        f"import sys; sys.path.insert(0, {str(ROOT.parent)!r})\n"
        "from sparsecorr.losses import kl_from_logits\n"
        "g = torch.Generator().manual_seed(0)\n"
        f"s = torch.randn({b}, {t}, {v}, generator=g)\n"
        f"te = torch.randn({b}, {t}, {v}, generator=g)\n"
        f"mask = torch.ones({b}, {t}, dtype=torch.bool)\n"
        "def naive(s, te, mask):\n"
        "    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(te, -1)\n"
        "    return torch.where(mask, (lt.exp() * (lt - ls)).sum(-1), 0.0)\n"
    )
    runs = {
        ("naive full softmax", "forward"): "with torch.no_grad(): naive(s, te, mask)",
        ("sparsecorr kl_from_logits", "forward"): "with torch.no_grad(): kl_from_logits(s, te, mask)",
        ("naive full softmax", "forward+backward"):
            "s.requires_grad_(True); naive(s, te, mask).sum().backward()",
        ("sparsecorr kl_from_logits", "forward+backward"):
            "s.requires_grad_(True); kl_from_logits(s, te, mask).sum().backward()",
    }
    rows = []
    for (name, mode), code in runs.items():
        extra = peak_rss_delta(setup_code, code)
        if mode == "forward+backward":
            extra -= size  # the gradient of the logits itself
        rows.append([name, mode, f"{extra / 2**20:.0f}", f"{100 * extra / size:.1f}%"])
    return (f"kl_from_logits peak extra memory on [{b}, {t}, {v}] fp32 (logits {size / 2**20:.0f} MiB; "
            "fwd+bwd rows exclude the logits' gradient)\n\n"
            + table(["implementation", "pass", "extra MiB", "% of logits"], rows))


def one_run(quick: bool, rounds: int) -> dict:
    sizes = [(16, 1024), (64, 2048)] if quick else [(64, 4096), (256, 8192)]
    return {f"{b}x{t}": measure_size(b, t, rounds) for b, t in sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 15; quick 3)")
    parser.add_argument("--runs", type=int, default=1, help="independent runs (fresh processes)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-kl", action="store_true", help="skip the kl_from_logits rows")
    args = parser.parse_args()
    setup(2)
    rounds = args.rounds or (3 if args.quick else 15)
    if args.json:
        print(json.dumps(one_run(args.quick, rounds)))
        return
    print(machine())
    if args.runs > 1:
        cmd = [sys.executable, __file__, "--json", "--rounds", str(rounds)] + (["--quick"] if args.quick else [])
        results = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True)
                              .stdout.strip().splitlines()[-1]) for _ in range(args.runs)]
    else:
        results = [one_run(args.quick, rounds)]
    for size in results[0]:
        print(render(results, size))
        print()
    if not args.no_kl:
        print(bench_kl_memory((2, 256, 32000) if args.quick else (4, 2048, 32000)))


if __name__ == "__main__":
    main()
