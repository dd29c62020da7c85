"""MEASURE layer speed and memory, each row as a ratio to a baseline timed in the same run.

1. ``token_logprobs`` vs naive ``log_softmax(-1).gather`` and TRL's ``selective_log_softmax``
   (when installed) on ``[8, 1024, 32000]`` logits, fp32 and bf16: time and peak extra memory
   (RSS high-water mark in a fresh subprocess). Targets: no slower than TRL; peak extra memory
   < 10% of the logits' size.
2. ``binned_quantile`` on 256×8192 tokens, 20 bins, vs a per-bin ``torch.quantile`` loop
   (target ≥ 5× faster), and on 64×65536 tokens where ``torch.quantile`` refuses the input.
3. ``mismatch_metrics`` as a multiple of ``x.clone()`` on the same ``[B, T]`` tensor.

Run: ``python benchmarks/bench_mismatch.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median_time, peak_rss_delta, setup, table

from sparsecorr.mismatch import binned_quantile, mismatch_metrics, token_logprobs

try:
    from trl.trainer.utils import selective_log_softmax
except Exception:  # pragma: no cover - TRL absent
    selective_log_softmax = None


def naive(logits, tokens):
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)


IMPLS = {
    "naive log_softmax.gather": ("naive", "from bench_mismatch import naive as f"),
    "sparsecorr token_logprobs": ("ours", "from sparsecorr.mismatch import token_logprobs as f"),
}
if selective_log_softmax is not None:
    IMPLS["TRL selective_log_softmax"] = ("trl", "from trl.trainer.utils import selective_log_softmax as f")


def bench_logprobs(shape, repeat):
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(*shape, generator=g).to(dtype)
        tokens = torch.randint(0, shape[-1], shape[:-1], generator=g)
        size = logits.numel() * logits.element_size()
        floor = median_time(lambda x=logits: x.amax(-1), repeat=repeat)
        times = {}
        for name, (_, _imp) in IMPLS.items():
            fn = {"naive log_softmax.gather": naive, "sparsecorr token_logprobs": token_logprobs,
                  "TRL selective_log_softmax": selective_log_softmax}[name]
            times[name] = median_time(lambda fn=fn, x=logits, t=tokens: fn(x, t), repeat=repeat)
        setup_code = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            f"g = torch.Generator().manual_seed(0)\n"
            f"logits = torch.randn(*{tuple(shape)}, generator=g).to({dtype})\n"
            f"tokens = torch.randint(0, {shape[-1]}, {tuple(shape[:-1])}, generator=g)\n"
        )
        for name, (_, imp) in IMPLS.items():
            mem = peak_rss_delta(setup_code + imp, "out = f(logits, tokens)")
            rows.append([str(dtype).replace("torch.", ""), name, f"{times[name] * 1e3:.0f} ms",
                         f"{times[name] / floor:.1f}x",
                         f"{times[name] / times['naive log_softmax.gather']:.2f}",
                         f"{mem / 2**20:.0f} MiB", f"{100 * mem / size:.1f}%"])
        rows.append([str(dtype).replace("torch.", ""), "logits.amax(-1) (floor)",
                     f"{floor * 1e3:.0f} ms", "1.0x", "", "", ""])
    print(f"\n## token_logprobs on {list(shape)} logits\n")
    print(table(["dtype", "implementation", "median", "x floor", "x naive", "peak extra", "% of logits"], rows))


def per_bin_loop(x, mask, offset, bin_size, n_bins):
    pos = offset[:, None] + torch.arange(x.shape[1])
    bins = pos // bin_size
    out = []
    for k in range(n_bins):
        vals = x[mask & (bins == k)]
        out.append(torch.quantile(vals, 0.05) if vals.numel() else torch.tensor(float("nan")))
    return torch.stack(out)


def bench_binned(repeat, quick):
    rows = []
    b, t = (64, 8192) if quick else (256, 8192)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(b, t, generator=g)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    offset = torch.randint(0, 32000, (b,), generator=g)
    bin_size = (offset.max() + t) // 20 + 1
    n_bins = int((offset[:, None] + t - 1).max() // bin_size) + 1
    ours = median_time(lambda: binned_quantile(x, mask, 0.05, bin_size=int(bin_size), offset=offset,
                                               n_bins=n_bins), repeat=repeat)
    loop = median_time(lambda: per_bin_loop(x, mask, offset, bin_size, n_bins), repeat=repeat)
    rows.append([f"{b}x{t}, {n_bins} bins", "per-bin torch.quantile loop", f"{loop * 1e3:.1f} ms", "1.00"])
    rows.append([f"{b}x{t}, {n_bins} bins", "binned_quantile", f"{ours * 1e3:.1f} ms", f"{loop / ours:.1f}x faster"])
    big = torch.rand(64, 65536, generator=g)
    big_mask = torch.ones_like(big, dtype=torch.bool)
    try:
        torch.quantile(big[big_mask], 0.05)
        status = "ran"
    except RuntimeError as exc:
        status = f"fails: {str(exc).splitlines()[0][:48]}"
    t_big = median_time(lambda: binned_quantile(big, big_mask, 0.05, bin_size=2000), repeat=max(1, repeat // 2))
    rows.append(["64x65536 (4.2M)", f"torch.quantile on all tokens: {status}", "", ""])
    rows.append(["64x65536 (4.2M)", "binned_quantile (33 bins)", f"{t_big * 1e3:.0f} ms", ""])
    huge = torch.rand(4096, 4200, generator=g)
    try:
        torch.quantile(huge.reshape(-1), 0.05)
        status = "ran"
    except RuntimeError as exc:
        status = f"fails: {str(exc).splitlines()[0][:48]}"
    t_huge = median_time(lambda: binned_quantile(huge, torch.ones_like(huge, dtype=torch.bool), 0.05,
                                                 bin_size=2000), repeat=1, warmup=0)
    rows.append(["4096x4200 (17.2M)", f"torch.quantile: {status}", "", ""])
    rows.append(["4096x4200 (17.2M)", "binned_quantile (3 bins)", f"{t_huge * 1e3:.0f} ms", ""])
    print("\n## binned_quantile (5th percentile per position bin)\n")
    print(table(["input", "implementation", "median", "ratio"], rows))


def bench_metrics(repeat, quick):
    b, t = (64, 8192) if quick else (256, 8192)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(b, t, generator=g) * 5
    roll = old - 0.1 * torch.randn(b, t, generator=g)
    mask = torch.arange(t)[None] < torch.randint(t // 2, t + 1, (b,), generator=g)[:, None]
    acc = torch.rand(b, t, generator=g)
    clone = median_time(lambda: old.clone(), repeat=repeat)
    plain = median_time(lambda: mismatch_metrics(old, roll, mask, quantiles=()), repeat=repeat)
    full = median_time(lambda: mismatch_metrics(old, roll, mask, acceptance=acc), repeat=repeat)
    rows = [[f"{b}x{t}", "x.clone()", f"{clone * 1e3:.2f} ms", "1.0x"],
            [f"{b}x{t}", "mismatch_metrics (means/max only)", f"{plain * 1e3:.1f} ms", f"{plain / clone:.0f}x"],
            [f"{b}x{t}", "mismatch_metrics + acceptance + 3 quantiles", f"{full * 1e3:.1f} ms", f"{full / clone:.0f}x"]]
    print("\n## mismatch_metrics\n")
    print(table(["input", "operation", "median", "x clone"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller inputs, fewer repeats")
    args = ap.parse_args()
    setup(2)
    repeat = 3 if args.quick else 7
    print(f"# bench_mismatch ({machine()})")
    bench_logprobs((2, 1024, 32000) if args.quick else (8, 1024, 32000), repeat)
    bench_binned(repeat, args.quick)
    bench_metrics(repeat, args.quick)


if __name__ == "__main__":
    main()
