"""The loss path against the peers' real code, every row timed in the same run (issue #13).

Forward + backward on float32 ``[B, T]`` log-probs with a ragged mask (lengths uniform in
[T/2, T]) at 64x4096 and 256x8192, every implementation called once per round, in an order
shuffled every round (seeded): the call that follows verl's runs up to 1 ms slower at 64x4096
(measured: the floor takes 1.25 ms there against 0.5 ms elsewhere; verl frees hundreds of MiB
and evicts the caches), so a fixed order would charge that to whichever row comes next. Medians of ``--rounds`` rounds (>= 10). Rows:

- floor: ``(a - b).exp().clamp(max=2) * mask`` (shared/BASELINES.md);
- sparsecorr: ``sparse_grpo(..., rollout_logp=..., correction=sparse_rl())`` with the default
  metrics (the training step: record, correction, loss, metrics), with ``metrics="none"``,
  plain GRPO, and ``sparse_rl()`` alone (``measure`` + the correction + its metrics);
- TRL 1.16: its own IS block (token_truncate, cap 2) + the ``dapo`` loss arithmetic of
  ``_compute_loss`` (the *bare* loss), and its real ``_compute_loss`` with its logged metrics;
- OpenRLHF 0.11 ``PolicyLoss`` with its correction (token mask [0.5, 5]);
- verl 0.9.1 ``compute_rollout_correction_and_rejection_mask`` (token TIS 2 + token_k1
  rejection, with its metrics) + ``compute_policy_loss_vanilla``, and the correction alone.

The peers are loaded as the parity tests load them (``benchmarks/_peers.py``). The aten op
count of one call is counted with a ``TorchDispatchMode`` on the benchmark's own inputs (every
dispatched op but the free aliasing ones: ``detach``, ``view`` including the dtype
reinterpretation ``view(dtype)``, ``alias``).

``--runs N`` repeats the whole measurement in N fresh processes and reports, for each target
ratio, the median and the [min, max] over the runs. Also: ``kl_from_logits`` peak extra memory
and time against the naive full-softmax KL.

Run: ``python benchmarks/bench_losses.py [--quick] [--runs 3]``.
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
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
import _peers
from _common import machine, peak_rss_delta, setup, table

from sparsecorr.correction import sparse_rl
from sparsecorr.losses import sparse_grpo
from sparsecorr.mismatch import measure

FLOOR = "floor (exp-clamp-mul)"
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


def implementations() -> dict[str, object]:
    impls = {FLOOR: floor, OURS: ours, OURS_NONE: lambda d: ours(d, "none"), OURS_PLAIN: ours_plain,
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


class _Count(TorchDispatchMode):
    FREE = ("aten.detach.default", "aten.view.default", "aten.view.dtype", "aten.alias.default")

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in self.FREE:
            self.n += 1
        return func(*args, **(kwargs or {}))


def op_count(fn, d) -> int:
    counter = _Count()
    with counter:
        fn(d)
    return counter.n


def measure_size(b: int, t: int, rounds: int) -> dict:
    d = make_inputs(b, t)
    impls = implementations()
    times: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():  # warm-up
        fn(d)
    rng = random.Random(0)
    names = list(impls)
    for _ in range(rounds):  # rotation: every implementation once per round, in a fresh order
        rng.shuffle(names)  # (a fixed order charges the cost of following verl to one row)
        for name in names:
            t0 = time.perf_counter()
            impls[name](d)
            times[name].append(time.perf_counter() - t0)
    # counted on the timed inputs: a path may depend on the size (a tiny [B] check is one
    # kernel where a [B, T] one is three fast ones)
    return {"median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "ops": {k: op_count(fn, d) for k, fn in impls.items() if k != FLOOR}}


TARGETS = [  # (label, numerator, denominator, target, is an upper bound)
    ("sparse_grpo + sparse_rl() / TRL bare loss", OURS, TRL_BARE, 1.0, True),
    ("sparse_grpo + sparse_rl() / TRL real _compute_loss", OURS, TRL_REAL, None, True),
    ("sparse_grpo + sparse_rl() / OpenRLHF PolicyLoss", OURS, ORLHF, 0.5, True),
    ("sparse_rl() alone / floor", OURS_CORR, FLOOR, 4.0, True),
    ("verl correction alone / sparse_rl() alone", VERL_CORR, OURS_CORR, 10.0, False),
]


def ratios(result: dict) -> dict[str, float]:
    med = result["median_ms"]
    return {label: med[a] / med[b] for label, a, b, _, _ in TARGETS if a in med and b in med}


def render(results: list[dict], size: str) -> str:
    meds = {k: statistics.median(r[size]["median_ms"][k] for r in results)
            for k in results[0][size]["median_ms"]}
    base = meds[FLOOR]
    ops = results[0][size]["ops"]
    rows = [[k, f"{v:.2f}", f"{v / base:.1f}", ops.get(k, "")] for k, v in meds.items()]
    out = [f"{size}, fwd+bwd, median over {len(results)} run(s) of per-run medians",
           table(["implementation", "ms", "x floor", "aten ops / call"], rows), ""]
    per_run = [ratios(r[size]) for r in results]
    trows = []
    for label, _, _, target, upper in TARGETS:
        vals = [p[label] for p in per_run if label in p]
        if not vals:
            continue
        med = statistics.median(vals)
        spread = f"[{min(vals):.2f}, {max(vals):.2f}]"
        if target is None:
            verdict = "(reference)"
        else:
            verdict = "met" if (med <= target if upper else med >= target) else "missed"
        goal = "" if target is None else f"{'<=' if upper else '>='} {target:g}"
        trows.append([label, f"{med:.2f}", spread, goal, verdict])
    n_ours, n_trl = ops.get(OURS), ops.get(TRL_BARE)
    if n_ours and n_trl:
        trows.append(["aten ops: sparse_grpo + sparse_rl() / TRL bare", f"{n_ours / n_trl:.2f}", "",
                      "<= 2", "met" if n_ours <= 2 * n_trl else "missed"])
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
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 30; quick 3)")
    parser.add_argument("--runs", type=int, default=1, help="independent runs (fresh processes)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-kl", action="store_true", help="skip the kl_from_logits rows")
    args = parser.parse_args()
    setup(2)
    rounds = args.rounds or (3 if args.quick else 30)
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
