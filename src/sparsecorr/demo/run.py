"""Orchestration of the demo: calibration, schedule fit, three arms, report."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .._io import atomic_write_text
from ..decoding.policies import StreamingLLM
from ..schedules import calibrate, fit_schedule
from .report import write_report
from .task import demo_model, make_prompts
from .train import Arm, train_arm


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of a demo run (``quick`` shrinks them to stay under 2 minutes on 2 cores)."""

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


def run_demo(cfg: DemoConfig, out: str | Path, *, progress: bool = True) -> list[dict]:
    """Run the demo into ``out`` (report.md, schedule.json, metrics.jsonl, PNG plots)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    policy = StreamingLLM(sink=1)
    model = demo_model(cfg.seed).eval()
    prompts = make_prompts(4, cfg.prompt_len, seed=cfg.seed + 7)
    t0 = time.perf_counter()
    table = calibrate(model, prompts, policy=policy, budgets=list(cfg.budgets),
                      bin_size=cfg.bin_size, n_bins=max(1, (cfg.prompt_len + cfg.max_new_tokens)
                                                        // cfg.bin_size + 1),
                      max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, progress=progress)
    schedule = fit_schedule(table, tau=cfg.tau)
    schedule.save(out / "schedule.json")
    calib_s = time.perf_counter() - t0
    sparse = {"policy": "streaming_llm", "policy_kwargs": {"sink": policy.sink}}
    arms = [Arm("dense", {"correction": "none", "policy": "dense"}),
            Arm("sparse-uncorrected", {"correction": "none", **sparse,
                                       "budget": cfg.aggressive_budget}),
            Arm("sparse-schedule-corrected", {"correction": "sparse_rl", **sparse,
                                              "schedule": str(out / "schedule.json")})]
    rows: list[dict] = []
    for i, arm in enumerate(arms):
        if progress:
            print(f"[demo] arm {i + 1}/{len(arms)}: {arm.name}", flush=True)
        rows += train_arm(arm, steps=cfg.steps, prompts_per_step=cfg.prompts_per_step,
                          group=cfg.group, prompt_len=cfg.prompt_len,
                          max_new_tokens=cfg.max_new_tokens, lr=cfg.lr, seed=cfg.seed,
                          progress=progress)
        if progress:
            print(f"[demo] arm {arm.name}: sampled reward {rows[-1]['reward']:.3f}, dense greedy "
                  f"reward {rows[-1]['dense_eval_reward']:.3f}", flush=True)
    atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write_report(out, rows=rows, table=table, schedule=schedule, config=asdict(cfg),
                 calib_s=calib_s)
    return rows
