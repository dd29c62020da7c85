"""``sparsecorr calibrate``, ``sparsecorr schedule`` and ``sparsecorr cost`` (the PLAN commands)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def add_calibrate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("calibrate", help="measure tail acceptance per budget and length bin",
                       description="Generate rollouts at each budget, teacher-force the dense model, "
                                   "and write the calibration table (JSON) and a PNG plot.")
    p.add_argument("--model", required=True, help="local model directory")
    p.add_argument("--prompts", required=True, help='JSONL with {"prompt_ids": [...]} or {"prompt": "..."}')
    p.add_argument("--budgets", required=True, type=_ints, help="e.g. 256,512,1024")
    p.add_argument("--policy", default="rkv")
    p.add_argument("--bin-size", type=int, default=2000)
    p.add_argument("--n-bins", type=int, default=20)
    p.add_argument("--q", type=float, default=0.05)
    p.add_argument("--tau", type=float, default=0.86, help="drawn on the plot")
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--logprobs-topk", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (resumable)")
    return p


def run_calibrate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..decoding import get_policy
    from ..schedules import calibrate
    from .decode import _read_prompts

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise ValueError(f"--model: expected a local model directory, got {model_dir}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:
        tok = None
    prompts = _read_prompts(Path(args.prompts), tok)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    table = calibrate(model, ids, policy=get_policy(args.policy), budgets=args.budgets,
                      bin_size=args.bin_size, n_bins=args.n_bins, q=args.q,
                      max_new_tokens=args.max_new_tokens, samples_per_prompt=args.samples_per_prompt,
                      attention_mask=mask, logprobs_topk=args.logprobs_topk, seed=args.seed,
                      out=args.out, progress=True)
    png = plot_table(table, tau=args.tau, path=Path(args.out) / "calibration.png")
    print(f"wrote {Path(args.out) / 'calibration.json'} and {png}")
    return 0


def plot_table(table, *, tau: float, path: Path) -> Path:
    """Tail acceptance vs context length, one line per budget, with the tau line (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plot: matplotlib is needed for the plot: pip install 'sparsecorr[plot]'") from None
    values = table.values.numpy()
    x = [(i + 0.5) * table.bin_size for i in range(table.n_bins)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for b, row in zip(table.budgets, values):
        ax.plot(x, row, marker="o", label=f"budget {b}")
    ax.axhline(tau, color="k", linestyle="--", label=f"tau = {tau}")
    ax.set_xlabel("total context length (tokens)")
    ax.set_ylabel(f"{int(table.q * 100)}th percentile of acceptance")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_schedule(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("schedule", help="fit the cheapest schedule keeping the tail above tau")
    p.add_argument("--table", required=True, help="calibration table JSON")
    p.add_argument("--tau", type=float, default=0.86)
    p.add_argument("--model-config", default=None, help="model dir or preset (qwen3-4b) for the cost model")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--non-monotone", action="store_true")
    p.add_argument("--out", required=True, help="schedule JSON to write")
    return p


def _cost_model(spec: str | None):
    from ..schedules import MODEL_PRESETS, CostModel

    if spec is None:
        return None
    if spec in MODEL_PRESETS:
        return CostModel.from_config(spec)
    path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    if not path.is_file():
        raise ValueError(f"--model-config: expected a model dir, a config.json or one of {sorted(MODEL_PRESETS)}, got {spec}")
    return CostModel.from_config(json.loads(path.read_text()))


def run_schedule(args: argparse.Namespace) -> int:
    from ..schedules import CalibrationTable, fit_schedule

    table = CalibrationTable.load(args.table)
    schedule = fit_schedule(table, tau=args.tau, cost_model=_cost_model(args.model_config),
                            monotone=not args.non_monotone, max_steps=args.max_steps)
    schedule.save(args.out)
    print(schedule.table())
    if "predicted_speedup" in schedule.meta:
        print(f"predicted speedup over the calibrated length: {schedule.meta['predicted_speedup']:.2f}x")
    print(f"wrote {args.out}")
    return 0


def add_cost(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("cost", help="dense vs scheduled decode cost per length bin")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", help="model dir or config.json")
    src.add_argument("--preset", help="qwen3-1.7b | qwen3-4b | qwen3-8b")
    p.add_argument("--schedule", required=True, help="schedule JSON or a preset name")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--hardware", default="h100", help="h100 | h200")
    return p


def run_cost(args: argparse.Namespace) -> int:
    from ..schedules import HARDWARE, SPARROW_PRESETS, BudgetSchedule

    if args.hardware not in HARDWARE:
        raise ValueError(f"--hardware: expected one of {sorted(HARDWARE)}, got {args.hardware!r}")
    cm = _cost_model(args.model_config or args.preset).with_intensity(HARDWARE[args.hardware])
    s = BudgetSchedule.preset(args.schedule) if args.schedule in SPARROW_PRESETS else BudgetSchedule.load(args.schedule)
    print("| generated tokens | dense eFLOPs | scheduled eFLOPs | speedup |")
    print("|---:|---:|---:|---:|")
    for k in range(1, len(s.budgets) + 1):
        l_out = k * s.bin_size
        d = cm.cost(n=args.samples, l_in=args.prompt_len, l_out=l_out)
        c = cm.cost(n=args.samples, l_in=args.prompt_len, l_out=l_out, budget=s)
        print(f"| {l_out:,} | {d:.3e} | {c:.3e} | {d / c:.2f}x |")
    return 0
