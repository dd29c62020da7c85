"""``sparsecorr demo``: calibrate -> fit a schedule -> sampler x correction GRPO arms (x seeds) -> report.

Provided by the ``sparsecorr-trl`` distribution through the ``sparsecorr.commands`` entry point
(the ``sparsecorr`` CLI discovers it). ``add_parser`` is cheap; ``run`` checks every dependency
before any work starts and names the extra to install when one is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

#: importable module -> the distribution that provides it (all brought by ``sparsecorr[demo]``)
REQUIREMENTS = {"trl": "trl", "peft": "peft", "datasets": "datasets",
                "matplotlib": "matplotlib", "transformers": "transformers"}
INSTALL_HINT = "pip install 'sparsecorr[demo]'"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo", help="run the end-to-end demo on a shipped tiny model (calibrate, fit a "
                     "schedule, train GRPO arms crossing sampler and correction, write "
                     "report.md)",
        description="Calibrate a KV budget on a shipped tiny Qwen3 (pre-trained to a partial "
                    "skill on a recall task), fit a schedule, and train GRPO arms with "
                    "SparseGRPOTrainer that cross the sampler (dense; StreamingLLM at the "
                    "aggressive budget, at fixed budgets and on the fitted schedule; block "
                    "top-k; R-KV and StreamingLLM on longer responses) with the "
                    "correction (none; sparse_rl()), plus DistillSparse; write report.md with "
                    "plots: what the correction buys per sampler over seeds, and six claims "
                    "checked against the numbers. CPU-bound; see docs/getting-started.md for "
                    "measured times on 2 cores (default: one seed; --full: the claims' arms over 16 "
                    "seeds, the others over 3).")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="smoke test: 3 steps of 2 prompts x 4 rollouts per arm, one seed")
    size.add_argument("--full", action="store_true",
                      help="the study: the arms the claims rest on over 16 seeds, the others over 3, "
                           "reported as mean ± spread")
    size.add_argument("--report-only", action="store_true",
                      help="rewrite report.md and the plots of the finished run in --out from "
                           "its metrics.jsonl (no training)")
    p.add_argument("--out", default="runs/demo", help="output directory")
    return p


def missing_requirements() -> list[str]:
    """Distributions the demo needs that are not importable."""
    return [dist for mod, dist in REQUIREMENTS.items() if importlib.util.find_spec(mod) is None]


def run(args: argparse.Namespace) -> int:
    missing = missing_requirements()
    if missing:
        print(f"sparsecorr demo: error: missing {', '.join(missing)}: {INSTALL_HINT}",
              file=sys.stderr)
        return 2
    from pathlib import Path

    from .report import pm, summarize
    from .run import DemoConfig, DemoError, rerender, run_demo

    if getattr(args, "report_only", False):
        try:
            rerender(args.out)
        except (OSError, ValueError, KeyError) as exc:
            print(f"sparsecorr demo: error: --report-only: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 1
        print(f"report: {Path(args.out) / 'report.md'}")
        return 0

    cfg = (DemoConfig.quick() if args.quick else DemoConfig.full() if getattr(args, "full", False)
           else DemoConfig())
    try:
        rows = run_demo(cfg, args.out)
    except DemoError as exc:
        print(f"sparsecorr demo: error: {exc}", file=sys.stderr)
        return 1
    for s in summarize(rows):
        print(f"{s['arm']:>24}  held-out greedy reward {pm(s['dense_before'], s['dense_before_sd'])}"
              f" -> {pm(s['dense_after'], s['dense_after_sd'])}  sampled reward (last half) "
              f"{s['reward_last_half']:.3f}  peak KV {s['peak_kv_bytes']:.0f} B  "
              f"{s['tokens_per_s']:.0f} tok/s")
    print(f"report: {Path(args.out) / 'report.md'}")
    return 0
