"""Orchestration of the demo: calibration, schedule fit, four arms, report.

The four arms separate what the schedule buys from what the correction buys:

| arm | sampler | correction |
|---|---|---|
| ``dense`` | dense | none |
| ``sparse-uncorrected`` | aggressive fixed budget | none |
| ``sparse-corrected`` | aggressive fixed budget | ``sparse_rl()`` |
| ``sparse-schedule-corrected`` | fitted schedule | ``sparse_rl()`` |

``report.md`` is always written: when a step fails, it says which step and why, and keeps what
finished before it.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sparsecorr._io import atomic_write_text
from sparsecorr.decoding.policies import StreamingLLM
from sparsecorr.schedules import calibrate, fit_schedule

from .report import write_failure_report, write_report
from .task import demo_model, make_prompts
from .train import Arm, train_arm

__all__ = ["ARM_NAMES", "DemoConfig", "DemoError", "demo_arms", "run_demo"]

ARM_NAMES = ("dense", "sparse-uncorrected", "sparse-corrected", "sparse-schedule-corrected")


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of a demo run (``quick``: 3 steps of 2 prompts x 4 rollouts, 24 new tokens)."""

    steps: int = 40
    prompts_per_step: int = 8
    group: int = 8
    prompt_len: int = 16
    max_new_tokens: int = 48
    budgets: tuple[int, ...] = (8, 12, 16, 24, 32)
    aggressive_budget: int = 8
    tau: float = 0.86
    bin_size: int = 16
    lr: float = 1e-3
    seed: int = 0

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(steps=3, prompts_per_step=2, group=4, max_new_tokens=24, budgets=(8, 16),
                   bin_size=8)


class DemoError(RuntimeError):
    """A demo step failed; ``report.md`` says which (``stage``) and why."""

    def __init__(self, stage: str, report: Path, cause: BaseException) -> None:
        super().__init__(f"{stage} failed: {type(cause).__name__}: {cause} (report: {report})")
        self.stage, self.report = stage, report


def demo_arms(cfg: DemoConfig, schedule_path: Path, *, sink: int) -> list[Arm]:
    """The four arms (see the module docstring) as ``SparseCorrConfig`` keywords."""
    sparse = {"policy": "streaming_llm", "policy_kwargs": {"sink": sink}}
    aggressive = {**sparse, "budget": cfg.aggressive_budget}
    return [Arm("dense", {"correction": "none", "policy": "dense"}),
            Arm("sparse-uncorrected", {"correction": "none", **aggressive}),
            Arm("sparse-corrected", {"correction": "sparse_rl", **aggressive}),
            Arm("sparse-schedule-corrected", {"correction": "sparse_rl", **sparse,
                                              "schedule": str(schedule_path)})]


def run_demo(cfg: DemoConfig, out: str | Path, *, progress: bool = True) -> list[dict]:
    """Run the demo into ``out`` (report.md, schedule.json, metrics.jsonl, PNG plots).

    Raises:
        DemoError: a step failed; ``out / "report.md"`` names it and keeps the finished steps.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done: dict = {"config": asdict(cfg), "rows": []}
    stage = "calibration"
    try:
        torch.manual_seed(cfg.seed)
        policy = StreamingLLM(sink=1)
        t0 = time.perf_counter()
        table = calibrate(demo_model(cfg.seed).eval(), make_prompts(4, cfg.prompt_len, seed=cfg.seed + 7),
                          policy=policy, budgets=list(cfg.budgets), bin_size=cfg.bin_size,
                          n_bins=max(1, (cfg.prompt_len + cfg.max_new_tokens) // cfg.bin_size + 1),
                          max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, progress=progress)
        stage = "schedule fit"
        with warnings.catch_warnings(record=True) as caught:  # notes go into the report
            warnings.simplefilter("always")
            schedule = fit_schedule(table, tau=cfg.tau)
        notes = [str(w.message) for w in caught]
        for note in notes:
            print(f"[demo] {note}", flush=True)
        schedule.save(out / "schedule.json")
        done.update(table=table, schedule=schedule, calib_s=time.perf_counter() - t0)
        arms = demo_arms(cfg, out / "schedule.json", sink=policy.sink)
        for i, arm in enumerate(arms):
            stage = f"training arm {arm.name}"
            if progress:
                print(f"[demo] arm {i + 1}/{len(arms)}: {arm.name}", flush=True)
            rows = train_arm(arm, steps=cfg.steps, prompts_per_step=cfg.prompts_per_step,
                             group=cfg.group, prompt_len=cfg.prompt_len,
                             max_new_tokens=cfg.max_new_tokens, lr=cfg.lr, seed=cfg.seed,
                             progress=progress)
            done["rows"] += rows
            if progress and rows:
                print(f"[demo] arm {arm.name}: sampled reward {rows[-1]['reward']:.3f}, dense "
                      f"greedy reward {rows[-1]['dense_eval_reward']:.3f}", flush=True)
        stage = "writing metrics and report"
        atomic_write_text(out / "metrics.jsonl",
                          "".join(json.dumps(r) + "\n" for r in done["rows"]))
        write_report(out, rows=done["rows"], table=table, schedule=schedule,
                     config=done["config"], calib_s=done["calib_s"], notes=notes)
    except Exception as exc:
        report = write_failure_report(out, stage=stage, error=exc, done=done)
        raise DemoError(stage, report, exc) from exc
    return done["rows"]
