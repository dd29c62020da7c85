"""``sparsecorr demo``: calibrate -> fit a schedule -> three GRPO arms -> report."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="run the end-to-end demo on a seeded tiny model")
    p.add_argument("--quick", action="store_true", help="a shorter run (under 2 minutes)")
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..demo import DemoConfig, run_demo
    from ..demo.report import summarize

    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    rows = run_demo(cfg, args.out)
    for s in summarize(rows):
        print(f"{s['arm']:>26}  sampled reward {s['reward_first']:.3f} -> "
              f"{s['reward_last_half']:.3f}  dense greedy reward {s['dense_before']:.3f} -> "
              f"{s['dense_after']:.3f}  {s['tokens_per_s']:.0f} tok/s  "
              f"peak KV {s['peak_kv_bytes']} B")
    print(f"report: {Path(args.out) / 'report.md'}")
    return 0
