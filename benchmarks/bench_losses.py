"""TRAIN layer speed and memory, each row as a ratio to a baseline timed in the same run.

1. ``sparse_grpo`` forward + backward on 256×8192 tokens (ragged mask, lengths uniform in
   [T/2, T]) with the ``sparse_rl()`` correction (token TIS 1.5, band [0.5, 1.5], veto 1e-4,
   batch normalisation) and all its metrics (loss, correction and mismatch), against
   - the floor ``(a - b).exp().clamp(max=2.0) * mask`` (shared/BASELINES.md),
   - OpenRLHF 0.11 ``PolicyLoss`` with its correction on (token mask [0.5, 5]), loaded through
     ``tests/openrlhf_shim.py`` (its real code, without the GPU-only imports),
   - TRL 1.16's GRPO loss path (``GRPOTrainer._compute_loss`` is a method bound to a trainer,
     so its loss arithmetic is re-typed here op for op: token-truncated IS ratio with cap 2
     computed as in ``_generate_and_score_completions``, two-sided clip, ``dapo`` token mean),
   - a naive plain-autograd implementation of the same sparse_rl math with a few metrics.
   Target (BASELINES.md): no slower than TRL's bare loss, at most half of OpenRLHF's time.
2. ``kl_from_logits`` peak extra memory (RSS high-water mark in a fresh subprocess) vs the naive
   full-softmax KL on ``[4, 2048, 32000]`` fp32 logits, forward and forward + backward.
   Target: peak extra memory < 15% of the logits' size (beyond the gradient itself, which
   autograd needs whatever the implementation).

Run: ``python benchmarks/bench_losses.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from _common import machine, peak_rss_delta, setup, table

from sparsecorr.losses import sparse_grpo
from sparsecorr.mismatch import mismatch_metrics

try:
    from sparsecorr.correction import sparse_rl
    from sparsecorr.mismatch import measure
except ImportError:  # pragma: no cover - correction layer not installed yet
    sparse_rl = None

try:
    from tests.openrlhf_shim import load_openrlhf_loss_module

    PolicyLoss = load_openrlhf_loss_module().PolicyLoss
except Exception:  # pragma: no cover - OpenRLHF absent
    PolicyLoss = None


def make_inputs(b: int, t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 4
    rollout = old - torch.randn(b, t, generator=g) * 0.2
    logp = old + torch.randn(b, t, generator=g) * 0.05
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    adv = torch.randn(b, generator=g)
    return dict(old=old, rollout=rollout, logp=logp, mask=mask, adv=adv)


def floor(d):
    return (d["old"] - d["rollout"]).exp().clamp(max=2.0) * d["mask"]


def ours(d):
    lp = d["logp"].clone().requires_grad_(True)
    out = sparse_grpo(lp, d["old"], d["adv"], d["mask"], rollout_logp=d["rollout"], correction=sparse_rl())
    out.loss.backward()
    return out.metrics


def ours_plain(d):
    lp = d["logp"].clone().requires_grad_(True)
    out = sparse_grpo(lp, d["old"], d["adv"], d["mask"])
    out.loss.backward()
    return out.metrics


def ours_measure(d):
    lp = d["logp"].clone().requires_grad_(True)
    out = sparse_grpo(lp, d["old"], d["adv"], d["mask"], rollout_logp=d["rollout"])
    out.loss.backward()
    return out.metrics


def ours_no_mismatch(d):
    lp = d["logp"].clone().requires_grad_(True)
    out = sparse_grpo(lp, d["old"], d["adv"], d["mask"], rollout_logp=d["rollout"], correction=sparse_rl(),
                      mismatch=False)
    out.loss.backward()
    return out.metrics


def correction_only(d):
    return sparse_rl()(measure(old_logp=d["old"], rollout_logp=d["rollout"], mask=d["mask"]))


def mismatch_only(d):
    return mismatch_metrics(d["old"], d["rollout"], d["mask"], quantiles=())


def naive(d):
    """Plain autograd, the obvious way: sparse_rl weights, clipped loss, a few metrics."""
    lp = d["logp"].clone().requires_grad_(True)
    mask = d["mask"]
    m = mask.float()
    log_r = (d["old"] - d["rollout"]).clamp(-20, 20)
    r = log_r.exp()
    keep = mask & (r >= 0.5) & (r <= 1.5)
    veto = ((r < 1e-4) & mask).any(dim=1, keepdim=True)
    keep = keep & ~veto
    w = r.clamp(max=1.5) * keep
    w = w / (w.sum() / keep.sum().clamp(min=1))
    ratio = (lp - d["old"]).clamp(-20, 20).exp()
    adv = d["adv"][:, None]
    loss_t = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * w.detach()
    kf = keep.float()
    loss = (loss_t * kf).sum() / kf.sum().clamp(min=1)
    loss.backward()
    with torch.no_grad():
        return {"clip": ((ratio > 1.2) & keep).float().sum() / kf.sum(), "kl": ((r - 1 - log_r) * m).sum() / m.sum(),
                "rej": 1 - kf.sum() / m.sum()}


def trl_like(d):
    """TRL 1.16's GRPO loss arithmetic with its token_truncate IS ratio (cap 2), dapo mean."""
    lp = d["logp"].clone().requires_grad_(True)
    mask = d["mask"].float()
    is_ratio = torch.exp(d["old"] - d["rollout"]).clamp(max=2.0)
    coef_1 = torch.exp(lp - d["old"])
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    adv = d["adv"].unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    per_token_loss = per_token_loss * is_ratio
    loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    loss.backward()


def openrlhf(d, module=[]):  # noqa: B006 - one PolicyLoss per process
    if not module:
        module.append(PolicyLoss(is_correction_level="token", is_correction_mode="mask",
                                 is_correction_threshold=(0.5, 5.0)))
    lp = d["logp"].clone().requires_grad_(True)
    loss, *_ = module[0](lp, d["old"], d["adv"][:, None], action_mask=d["mask"].float(),
                         rollout_log_probs=d["rollout"])
    loss.backward()


def bench_loss(b: int, t: int, rounds: int) -> str:
    d = make_inputs(b, t)
    impls = {"floor (exp-clamp-mul)": floor, "sparsecorr sparse_grpo, no correction": ours_plain,
             "sparsecorr sparse_grpo + rollout_logp (mismatch metrics only)": ours_measure,
             "naive autograd sparse_rl + 3 metrics": naive, "TRL 1.16 loss + token_truncate IS": trl_like}
    impls["  of which: mismatch_metrics alone (no quantiles)"] = mismatch_only
    if sparse_rl is not None:
        impls["sparsecorr sparse_grpo + sparse_rl() + all metrics"] = ours
        impls["sparsecorr sparse_grpo + sparse_rl(), mismatch=False"] = ours_no_mismatch
        impls["  of which: sparse_rl() correction alone"] = correction_only
    if PolicyLoss is not None:
        impls["OpenRLHF PolicyLoss, token mask [0.5, 5]"] = openrlhf
    times: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():  # warm-up
        fn(d)
    for _ in range(rounds):  # rotation: every implementation once per round
        for name, fn in impls.items():
            t0 = time.perf_counter()
            fn(d)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["floor (exp-clamp-mul)"]
    rows = [[k, f"{v * 1e3:.1f}", f"{v / base:.1f}"] for k, v in med.items()]
    for peer in ("TRL 1.16 loss + token_truncate IS", "OpenRLHF PolicyLoss, token mask [0.5, 5]",
                 "naive autograd sparse_rl + 3 metrics"):
        key = "sparsecorr sparse_grpo + sparse_rl() + all metrics"
        if key in med and peer in med:
            rows.append([f"ratio: sparse_grpo+sparse_rl / {peer.split(',')[0]}", "", f"{med[key] / med[peer]:.2f}"])
    return f"sparse_grpo fwd+bwd, {b}x{t}, median of {rounds} rounds\n\n" + table(
        ["implementation", "ms", "x floor"], rows)


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


def bench_kl_time(shape: tuple[int, int, int], repeat: int) -> str:
    from _common import median_time

    from sparsecorr.losses import kl_from_logits

    g = torch.Generator().manual_seed(0)
    s, te = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    mask = torch.ones(shape[:2], dtype=torch.bool)

    def naive():
        x = s.clone().requires_grad_(True)
        ls, lt = torch.log_softmax(x, -1), torch.log_softmax(te, -1)
        torch.where(mask, (lt.exp() * (lt - ls)).sum(-1), 0.0).sum().backward()

    def ours():
        x = s.clone().requires_grad_(True)
        kl_from_logits(x, te, mask).sum().backward()

    t_naive, t_ours = median_time(naive, repeat=repeat), median_time(ours, repeat=repeat)
    rows = [["naive full softmax", f"{t_naive * 1e3:.0f}", "1.00"],
            ["sparsecorr kl_from_logits", f"{t_ours * 1e3:.0f}", f"{t_ours / t_naive:.2f}"]]
    return f"kl_from_logits forward+backward time on {list(shape)} fp32\n\n" + table(
        ["implementation", "ms", "x naive"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    args = parser.parse_args()
    setup(2)
    print(machine())
    if args.quick:
        print(bench_loss(64, 2048, rounds=5))
        print()
        print(bench_kl_memory((2, 256, 32000)))
        print()
        print(bench_kl_time((1, 256, 32000), repeat=5))
    else:
        print(bench_loss(256, 8192, rounds=15))
        print()
        print(bench_kl_memory((4, 2048, 32000)))
        print()
        print(bench_kl_time((2, 2048, 32000), repeat=3))


if __name__ == "__main__":
    main()
