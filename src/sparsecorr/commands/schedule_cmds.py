"""``sparsecorr calibrate``, ``sparsecorr schedule`` and ``sparsecorr cost`` (the PLAN commands).

Every option is validated by argparse (a one-line error naming the option, exit status 2) and
every path checked before the first expensive step (loading a model, generating a budget).
``schedule`` and ``cost`` share one set of cost-model defaults (``DEFAULT_N`` samples,
``DEFAULT_L_IN`` prompt tokens, H100), so the same schedule gets the same predicted speedup in
both.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import warnings
from pathlib import Path

#: the built-in policy names of ``sparsecorr.decoding.get_policy``, for ``--help`` only (kept here
#: so it stays fast; a test checks they are registered); ``--policy`` takes the whole registry
POLICY_NAMES = ("block_topk", "dense", "rkv", "snapkv", "streaming_llm")
#: hardware names of ``sparsecorr.schedules.HARDWARE`` (a test checks they agree)
HARDWARE_NAMES = ("h100", "h200")
#: cost-model defaults of ``sparsecorr.schedules.cost`` (DEFAULT_N, DEFAULT_L_IN; tested equal)
DEFAULT_SAMPLES, DEFAULT_PROMPT_LEN = 8, 512


# -- argparse types: each refuses a bad value with a message naming what was expected -----------
def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


positive_int, nonnegative_int = _int_at_least(1), _int_at_least(0)


def probability(text: str) -> float:
    """A finite number in [0, 1] (NaN refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # False for NaN
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def budget_list(text: str) -> list[int]:
    """Comma-separated positive ints, at least one."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return values


# -- calibrate -----------------------------------------------------------------------------------
def add_calibrate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("calibrate", help="measure tail acceptance per budget and length bin",
                       description="Generate rollouts at each budget, teacher-force the dense model, "
                                   "and write the calibration table (JSON) and a PNG plot. Resumable: "
                                   "a rerun with the same --out continues (new budgets are added; "
                                   "a new --q re-writes the table at that level without "
                                   "recomputing; other changed settings are refused).")
    p.add_argument("--model", required=True, help="local model directory")
    p.add_argument("--prompts", required=True, help='JSONL with {"prompt_ids": [...]} or {"prompt": "..."}')
    p.add_argument("--budgets", required=True, type=budget_list, help="candidate KV budgets, e.g. 256,512,1024")
    p.add_argument("--policy", default="rkv", help="sparse KV policy: " + " | ".join(POLICY_NAMES)
                   + ", another registered name, or MODULE:CLASS (imported and registered)")
    p.add_argument("--bin-size", type=positive_int, default=2000, help="tokens of total context per bin")
    p.add_argument("--n-bins", type=positive_int, default=20, help="number of length bins")
    p.add_argument("--q", type=probability, default=0.05, help="tail level of the acceptance")
    p.add_argument("--tau", type=probability, default=0.86, help="threshold drawn on the plot")
    p.add_argument("--max-new-tokens", type=positive_int, default=4096, help="generated tokens per rollout")
    p.add_argument("--samples-per-prompt", type=positive_int, default=4, help="rollouts per prompt")
    p.add_argument("--logprobs-topk", type=positive_int, default=20,
                   help="top-k log-probs per position for the acceptance bound")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="sampling seed")
    p.add_argument("--out", required=True, help="output directory (resumable)")
    return p


def run_calibrate(args: argparse.Namespace) -> int:
    from .._io import atomic_write_bytes, check_writable_dir
    from ..schedules.calibrate import plan_calibration
    from ..schedules.table import check_table_size
    from .decode import policy_name

    # cheap checks first: nothing below loads a model before these pass
    args.policy = policy_name(args.policy)  # a registered name, or MODULE:CLASS (registered)
    check_table_size(len(set(args.budgets)), args.n_bins)
    out = check_writable_dir("--out", args.out)
    _require_matplotlib()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..decoding import get_policy
    from ..schedules import calibrate
    from .decode import _read_prompts

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise ValueError(f"--model: expected a local model directory, got {model_dir}")
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
    kwargs = dict(policy=get_policy(args.policy), budgets=args.budgets, bin_size=args.bin_size,
                  n_bins=args.n_bins, q=args.q, max_new_tokens=args.max_new_tokens,
                  samples_per_prompt=args.samples_per_prompt, attention_mask=mask,
                  logprobs_topk=args.logprobs_topk, seed=args.seed, out=out)
    try:  # resume conflicts fail here, before the model loads
        plan = plan_calibration(ids, **kwargs)
    except ValueError as exc:
        msg = str(exc)
        raise ValueError("--out:" + msg[4:] if msg.startswith("out:") else msg) from None
    if plan.reused:
        print(f"resuming {out / 'calibration.json'}: budgets {plan.reused} already done", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    table = calibrate(model, ids, progress=True, **kwargs)
    png = out / "calibration.png"
    atomic_write_bytes(png, plot_table_png(table, tau=args.tau))
    print(f"wrote {out / 'calibration.json'} (q={table.q:g}, budgets {table.budgets}) and {png}")
    return 0


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("plot: matplotlib is needed for the plot: pip install 'sparsecorr[plot]'") from None


def plot_table_png(table, *, tau: float) -> bytes:
    """PNG bytes of the tail acceptance vs context length, one line per budget, with tau."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = table.values.numpy()
    x = [(i + 0.5) * table.bin_size for i in range(table.n_bins)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for b, row in zip(table.budgets, values):
        ax.plot(x, row, marker="o", label=f"budget {b}")
    ax.axhline(tau, color="k", linestyle="--", label=f"tau = {tau}")
    ax.set_xlabel("total context length (tokens)")
    ax.set_ylabel(f"{table.q * 100:g}th percentile of acceptance")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def plot_table(table, *, tau: float, path: Path) -> Path:
    """Write `plot_table_png` to ``path`` atomically; returns the path."""
    from .._io import atomic_write_bytes

    return atomic_write_bytes(path, plot_table_png(table, tau=tau))


# -- schedule ------------------------------------------------------------------------------------
def _add_cost_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=positive_int, default=DEFAULT_SAMPLES,
                   help="samples per prompt (N) in the cost model")
    p.add_argument("--prompt-len", type=nonnegative_int, default=DEFAULT_PROMPT_LEN,
                   help="prompt tokens (L_in) in the cost model")
    p.add_argument("--hardware", default="h100", choices=HARDWARE_NAMES,
                   help="hardware intensity of the cost model")


def add_schedule(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("schedule", help="fit the cheapest schedule keeping the tail above tau",
                       description="Fit the cheapest budget per length bin whose tail acceptance "
                                   "reaches tau (exact DP). With --model-config, rank by the cost "
                                   "model and print the predicted speedup (the number `sparsecorr "
                                   "cost` prints in its last row for the same inputs).")
    p.add_argument("--table", required=True, help="calibration table JSON")
    p.add_argument("--tau", type=probability, default=0.86, help="stability threshold on the tail")
    p.add_argument("--model-config", default=None,
                   help="model dir, config.json or preset (qwen3-1.7b | qwen3-4b | qwen3-8b) for the "
                        "cost model; without it budgets are ranked by KV size")
    p.add_argument("--max-steps", type=positive_int, default=None,
                   help="at most this many distinct budgets (None: unbounded)")
    p.add_argument("--non-monotone", action="store_true", help="allow budgets to shrink with length")
    _add_cost_inputs(p)
    p.add_argument("--out", required=True, help="schedule JSON to write")
    return p


def _cost_model(spec: str | None, hardware: str = "h100", *, option: str = "--model-config"):
    from ..schedules import MODEL_PRESETS, CostModel

    if spec is None:
        return None
    if spec in MODEL_PRESETS:
        return CostModel.from_config(spec, intensity=hardware)
    path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    if not path.is_file():
        raise ValueError(f"{option}: expected a model dir, a config.json or one of "
                         f"{sorted(MODEL_PRESETS)}, got {spec}")
    try:
        config = json.loads(path.read_text())
        return CostModel.from_config(config, intensity=hardware)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{option}: {path}: {exc}") from None


def run_schedule(args: argparse.Namespace) -> int:
    from .._io import check_writable_file
    from ..schedules import CalibrationTable, fit_schedule

    check_writable_file("--out", args.out)
    try:
        table = CalibrationTable.load(args.table)
    except ValueError as exc:
        raise ValueError(f"--table: {exc}") from None
    cm = _cost_model(args.model_config, args.hardware)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule = fit_schedule(table, tau=args.tau, cost_model=cm, monotone=not args.non_monotone,
                                max_steps=args.max_steps, n=args.samples, l_in=args.prompt_len)
    for w in caught:  # a clean line instead of a warning that points into the library
        print(f"sparsecorr schedule: warning: {str(w.message).removeprefix('fit_schedule: ')}",
              file=sys.stderr)
    schedule.save(args.out)
    print(schedule.table())
    if "predicted_speedup" in schedule.meta:
        l_out = len(schedule.budgets) * schedule.bin_size
        line = _speedup_line(schedule.meta["predicted_speedup"], args.samples, args.prompt_len, l_out,
                             args.hardware)
        print(f"predicted speedup {line}")
    print(f"wrote {args.out}")
    return 0


def _speedup_line(x: float, n: int, l_in: int, l_out: int, hardware: str) -> str:
    return (f"{x:.2f}x for {l_out:,} generated tokens ({n} samples per prompt, {l_in}-token prompt, "
            f"{hardware})")


# -- cost ----------------------------------------------------------------------------------------
def add_cost(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("cost", help="dense vs scheduled decode cost per length bin",
                       description="Dense vs scheduled decode cost (eFLOPs) for 1, 2, ... bins of "
                                   "generated tokens; the last row is the speedup `sparsecorr "
                                   "schedule` predicts for the same inputs.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", help="model dir or config.json")
    src.add_argument("--preset", choices=("qwen3-1.7b", "qwen3-4b", "qwen3-8b"), help="model preset")
    p.add_argument("--schedule", required=True, help="schedule JSON or a preset name")
    _add_cost_inputs(p)
    return p


def run_cost(args: argparse.Namespace) -> int:
    from ..schedules import SPARROW_PRESETS, BudgetSchedule

    cm = _cost_model(args.model_config or args.preset, args.hardware,
                     option="--model-config" if args.model_config else "--preset")
    try:
        s = (BudgetSchedule.preset(args.schedule) if args.schedule in SPARROW_PRESETS
             else BudgetSchedule.load(args.schedule))
    except ValueError as exc:
        raise ValueError(f"--schedule: {exc}") from None
    print("| generated tokens | dense eFLOPs | scheduled eFLOPs | speedup |")
    print("|---:|---:|---:|---:|")
    for k in range(1, len(s.budgets) + 1):
        l_out = k * s.bin_size
        d = cm.cost(n=args.samples, l_in=args.prompt_len, l_out=l_out)
        c = cm.cost(n=args.samples, l_in=args.prompt_len, l_out=l_out, budget=s)
        print(f"| {l_out:,} | {d:.3e} | {c:.3e} | {d / c:.2f}x |")
    print(f"({args.samples} samples per prompt, {args.prompt_len}-token prompt, {args.hardware})")
    return 0
