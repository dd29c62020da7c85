"""Orchestration of the demo: calibration, schedule fit, the crossed arms x seeds, report.

The study crosses the sampler with the correction, so that each comparison changes one thing:

| arm | sampler | correction |
|---|---|---|
| ``dense`` | dense | none |
| ``b8/none``, ``b8/sparse_rl`` | StreamingLLM, the aggressive fixed budget | none / ``sparse_rl()`` |
| ``b12/...``, ``b24/...`` | StreamingLLM, the fixed budgets (``DemoConfig.fixed_budgets``) | none / ``sparse_rl()`` |
| ``schedule/none``, ``schedule/sparse_rl`` | StreamingLLM, the fitted schedule | none / ``sparse_rl()`` |
| ``topk8/...``, ``topk12/...`` | block top-k (``DemoConfig.topk_budgets``) | none / ``sparse_rl()`` |
| ``topk8/sparse_rl+distill`` | ``DemoConfig.distill_at`` + the sampler's LoRA adapter | ``sparse_rl()`` |
| ``dense@64``, ``b16@64/...`` | longer responses (``long_tokens``): dense, StreamingLLM 16 (and 12 with ``--full``) | none / ``sparse_rl()`` |
| ``rkv16@64/...`` | the same length, R-KV at budget 16 (``long_rkv_budgets``, `RKV` with its authors' scoring) | none / ``sparse_rl()`` |

Every arm trains from the same shipped model (pre-trained to a partial skill by
``scripts/make_demo_model.py``) on the same prompts for each seed, and is evaluated on the same
held-out prompts; every sparse arm's sampler is also probed on them
([`probe_sampler`][sparsecorr_trl.demo.probe.probe_sampler]), corrected or not. The schedule is
calibrated and fitted once, on the first seed.

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
from .task import PROMPT_LEN, RESPONSE_LEN, demo_model, make_prompts
from .train import Arm, quiet_demo, train_arm

__all__ = ["CLAIM_ARMS", "CORRECTIONS", "FULL_CLAIM_SEEDS", "RKV_KWARGS", "DemoConfig", "DemoError", "arm_names", "demo_arms",
           "demo_samplers", "rerender", "run_demo"]

#: the corrections crossed with every sparse sampler
CORRECTIONS = ("none", "sparse_rl")
DISTILL = "sparse_rl+distill"
#: the arms the six claims rest on (``--full`` runs them over ``DemoConfig.claim_seeds``):
#: dense (dense improves; the reference of the next two), the scheduled + corrected arm
#: (schedule matches dense), the uncorrected aggressive arm (uncorrected below dense), the
#: long-response comparison (correction rescues a sampler), DistillSparse with its
#: uncorrected-adapter twin (DistillSparse raises the tail) and the same long-response
#: comparison under a faithful R-KV sampler (the correction under R-KV)
CLAIM_ARMS = ("dense", "b8/none", "schedule/sparse_rl", "topk8/sparse_rl",
              "topk8/sparse_rl+distill", "dense@64", "b16@64/none", "b16@64/sparse_rl",
              "rkv16@64/none", "rkv16@64/sparse_rl")
#: seeds the claims' arms run over with ``--full`` (the other arms: ``DemoConfig.seeds``):
#: 16, so that the report can give each deciding verdict on seeds 0-7, on 8-15 and pooled
FULL_CLAIM_SEEDS = tuple(range(16))
#: the R-KV sampler's ``policy_kwargs``: `RKV`'s defaults, which are R-KV's authors' scoring
#: (``scoring="r_kv"``, window 8, kernel 7, mix 0.1, threshold 0.5, no sink), but ``buffer=0``
#: so that it compresses at every step past the budget like the StreamingLLM arms (R-KV's
#: buffer of 128 would never compress a row of 16 + 64 tokens)
RKV_KWARGS = {"buffer": 0}


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of a demo run: the default is one seed (``sparsecorr demo``); ``full()`` runs the
    arms the claims rest on (`CLAIM_ARMS`) over 16 seeds and the others over 3 (``--full``);
    ``quick()`` is the smoke test (3 steps of 2 prompts x 4 rollouts, one seed).

    The samplers crossed with `CORRECTIONS` are StreamingLLM (``sink=1``) at the aggressive
    budget, at each of ``fixed_budgets`` and on the fitted schedule; DistillSparse runs at
    ``distill_budget`` with ``sparse_rl()``."""

    steps: int = 24
    prompts_per_step: int = 4
    group: int = 8
    prompt_len: int = PROMPT_LEN
    max_new_tokens: int = RESPONSE_LEN
    budgets: tuple[int, ...] = (8, 12, 16, 24)
    aggressive_budget: int = 8
    #: fixed budgets between the aggressive one and dense, from the calibration table: 12 is
    #: below the task's period (15 tokens) like 8, 24 above it; the fitted schedule gives 16
    #: over the whole response (see docs/getting-started.md)
    fixed_budgets: tuple[int, ...] = (12, 24)
    #: block top-k samplers (Sparrow's selection rule, `BlockTopK`: pages of `topk_page`
    #: tokens, the first and the last page always attended, every layer sparse) at these
    #: budgets, crossed with the correction too: the kept pages follow the query, so the far
    #: token is kept at some steps and not others, and the mismatch sits between StreamingLLM's
    #: all (budgets below the period) and little (above it)
    topk_budgets: tuple[int, ...] = (8, 12)
    topk_page: int = 4
    #: the sampler DistillSparse's arm uses (one of the samplers' labels)
    distill_at: str = "topk8"
    #: longer responses: a dense arm and StreamingLLM at ``long_budgets`` (crossed with the
    #: correction) generate this many tokens (and are evaluated at that length); the mismatch
    #: of a fixed budget grows with the context (the calibrated tail falls from bin to bin).
    #: None: not run
    long_tokens: int | None = 64
    long_budgets: tuple[int, ...] = (16,)
    #: R-KV (`RKV`, its authors' scoring, `RKV_KWARGS`) at these budgets on the long responses,
    #: crossed with the correction (``rkv<budget>@<long_tokens>``): what the correction buys
    #: under the compression Sparse-RL trains with
    long_rkv_budgets: tuple[int, ...] = (16,)
    #: the schedule's threshold on the acceptance tail. Sparrow's 0.86 keeps the later context
    #: bins dense here: this tiny model's distribution (not its answer) leans on far tokens, so
    #: the tail at budget 16-24 is 0.55-0.8 while budget 16 already answers (measured on the
    #: shipped model; see docs/getting-started.md)
    tau: float = 0.5
    bin_size: int = 16
    lr: float = 3e-3
    seeds: tuple[int, ...] = (0,)
    #: arms (by name) that run over ``claim_seeds`` instead of ``seeds``: the claims' arms get
    #: the most seeds, since a verdict rests on the spread over them
    claim_arms: tuple[str, ...] = ()
    claim_seeds: tuple[int, ...] = ()
    eval_every: int = 2
    #: probe every sparse arm's sampler every this many steps (and before and after training)
    probe_every: int = 4
    eval_prompts: int = 32
    distill_lr: float = 1e-3
    #: GRPO updates per rollout batch (TRL's ``num_iterations``)
    num_iterations: int = 1

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(steps=3, prompts_per_step=2, group=4, max_new_tokens=16, budgets=(8, 16),
                   fixed_budgets=(16,), topk_budgets=(12,), distill_at="topk12",
                   long_tokens=24, bin_size=8, eval_every=1, probe_every=3, eval_prompts=8)

    @classmethod
    def full(cls) -> DemoConfig:
        # long responses also at StreamingLLM 12 (below the task's period), over 3 seeds: where
        # the uncorrected long-response arm falls below dense@64 when 16 does not measurably
        return cls(seeds=(0, 1, 2), claim_arms=CLAIM_ARMS, claim_seeds=FULL_CLAIM_SEEDS,
                   long_budgets=(12, 16))

    def seeds_of(self, arm: str) -> tuple[int, ...]:
        """The seeds ``arm`` runs over: ``claim_seeds`` for one of ``claim_arms``, else
        ``seeds``."""
        return self.claim_seeds if arm in self.claim_arms and self.claim_seeds else self.seeds


class DemoError(RuntimeError):
    """A demo step failed; ``report.md`` says which (``stage``) and why."""

    def __init__(self, stage: str, report: Path, cause: BaseException) -> None:
        super().__init__(f"{stage} failed: {type(cause).__name__}: {cause} (report: {report})")
        self.stage, self.report = stage, report


def arm_names(cfg: DemoConfig) -> list[str]:
    """The arms' names in the order they run (``schedule`` stands for the fitted schedule)."""
    return [a.name for a in demo_arms(cfg, Path("schedule.json"), sink=1)]


def demo_arms(cfg: DemoConfig, schedule_path: Path, *, sink: int) -> list[Arm]:
    """Dense, then every sampler crossed with `CORRECTIONS`, then DistillSparse (see the module
    docstring), as ``SparseCorrConfig`` keywords; each named ``sampler/correction``."""
    samplers = demo_samplers(cfg, schedule_path, sink=sink)
    grpo = {"num_iterations": cfg.num_iterations} if cfg.num_iterations != 1 else {}
    arms = [Arm("dense", {"correction": "none", "policy": "dense"}, grpo, "dense", "none")]
    for name, sampler in samplers.items():
        arms += [Arm(f"{name}/{c}", {"correction": c, **sampler}, grpo, name, c)
                 for c in CORRECTIONS]
    d = cfg.distill_at
    if d not in samplers:
        raise ValueError(f"distill_at: expected one of {sorted(samplers)}, got {d!r}")
    arms.append(Arm(f"{d}/{DISTILL}", {"correction": "sparse_rl", **samplers[d], "distill": True,
                                        "distill_lr": cfg.distill_lr}, grpo, d, DISTILL))
    if cfg.long_tokens is not None:
        t, sparse = cfg.long_tokens, {"policy": "streaming_llm", "policy_kwargs": {"sink": sink}}
        arms.append(Arm(f"dense@{t}", {"correction": "none", "policy": "dense"}, grpo,
                        f"dense@{t}", "none", t))
        for b in cfg.long_budgets:
            arms += [Arm(f"b{b}@{t}/{c}", {"correction": c, **sparse, "budget": b}, grpo,
                         f"b{b}@{t}", c, t) for c in CORRECTIONS]
        rkv = {"policy": "rkv", "policy_kwargs": dict(RKV_KWARGS)}
        for b in cfg.long_rkv_budgets:
            arms += [Arm(f"rkv{b}@{t}/{c}", {"correction": c, **rkv, "budget": b}, grpo,
                         f"rkv{b}@{t}", c, t) for c in CORRECTIONS]
    return arms


def demo_samplers(cfg: DemoConfig, schedule_path: Path, *, sink: int) -> dict[str, dict]:
    """Sampler label -> its ``SparseCorrConfig`` keywords: StreamingLLM ``b<budget>`` at the
    aggressive and the fixed budgets, ``schedule``, and block top-k ``topk<budget>``."""
    sparse = {"policy": "streaming_llm", "policy_kwargs": {"sink": sink}}
    samplers = {f"b{b}": {**sparse, "budget": b}
                for b in dict.fromkeys((cfg.aggressive_budget, *cfg.fixed_budgets))}
    samplers["schedule"] = {**sparse, "schedule": str(schedule_path)}
    for b in cfg.topk_budgets:
        samplers[f"topk{b}"] = {
            "policy": "block_topk", "budget": b,
            "policy_kwargs": {"page_size": cfg.topk_page, "keep_first_pages": 1,
                              "keep_last_pages": 1, "dense_layers": 0}}
    return samplers


def run_demo(cfg: DemoConfig, out: str | Path, *, progress: bool = True) -> list[dict]:
    """Run the demo into ``out`` (report.md, schedule.json, metrics.jsonl, PNG plots), on one
    torch thread and without transformers' per-load bars (`quiet_demo`).

    Raises:
        DemoError: a step failed; ``out / "report.md"`` names it and keeps the finished steps.
    """
    with quiet_demo():
        return _run_demo(cfg, out, progress=progress)


def _run_demo(cfg: DemoConfig, out: str | Path, *, progress: bool) -> list[dict]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done: dict = {"config": json.loads(json.dumps(asdict(cfg))), "rows": [],  # as run.json has it
                  "arm_s": {}, "stage": "calibration"}
    try:
        table, schedule, notes = _calibrate(cfg, out, done, progress=progress)
        arms = demo_arms(cfg, out / "schedule.json", sink=1)
        _check_claim_arms(cfg, [a.name for a in arms])
        held_out = make_prompts(cfg.eval_prompts, cfg.prompt_len, seed=99_991)
        t_train = time.perf_counter()
        for i, arm in enumerate(arms):
            _train_seeds(cfg, arm, f"arm {i + 1}/{len(arms)} {arm.name}", held_out, done,
                         progress=progress)
            _write_rows(out, done["rows"])  # a run stopped part way keeps its finished arms
        done["train_s"] = time.perf_counter() - t_train
        done["stage"] = "writing metrics and report"
        atomic_write_text(out / "run.json", json.dumps(
            {"config": done["config"], "calib_s": done["calib_s"], "train_s": done["train_s"],
             "arm_s": done["arm_s"], "notes": notes}, indent=1))
        write_report(out, rows=done["rows"], table=table, schedule=schedule,
                     config=done["config"], calib_s=done["calib_s"], train_s=done["train_s"],
                     notes=notes)
    except Exception as exc:
        report = write_failure_report(out, stage=done["stage"], error=exc, done=done)
        raise DemoError(done["stage"], report, exc) from exc
    return done["rows"]


def _write_rows(out: Path, rows: list[dict]) -> None:
    atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _check_claim_arms(cfg: DemoConfig, names: list[str]) -> None:
    unknown = [a for a in cfg.claim_arms if a not in names]
    if unknown:
        raise ValueError(f"claim_arms: expected arm names among {names}, got unknown {unknown}")
    if cfg.claim_arms and not cfg.claim_seeds:
        raise ValueError(f"claim_seeds: expected at least one seed for claim_arms "
                         f"{list(cfg.claim_arms)}, got {cfg.claim_seeds!r}")


def _calibrate(cfg: DemoConfig, out: Path, done: dict, *, progress: bool):
    """Calibrate StreamingLLM (``sink=1``) on the first seed's model and fit the schedule;
    write ``schedule.json`` and ``calibration.json``. Returns ``(table, schedule, notes)``."""
    seed0 = cfg.seeds[0]
    torch.manual_seed(seed0)
    t0 = time.perf_counter()
    table = calibrate(demo_model(seed0).eval(), make_prompts(4, cfg.prompt_len, seed=seed0 + 7),
                      policy=StreamingLLM(sink=1), budgets=list(cfg.budgets),
                      bin_size=cfg.bin_size,
                      n_bins=max(1, (cfg.prompt_len + cfg.max_new_tokens) // cfg.bin_size + 1),
                      max_new_tokens=cfg.max_new_tokens, seed=seed0, progress=progress)
    done["stage"] = "schedule fit"
    with warnings.catch_warnings(record=True) as caught:  # notes go into the report
        warnings.simplefilter("always")
        schedule = fit_schedule(table, tau=cfg.tau)
    notes = [str(w.message) for w in caught]
    for note in notes:
        print(f"[demo] {note}", flush=True)
    schedule.save(out / "schedule.json")
    table.save(out / "calibration.json")
    done.update(table=table, schedule=schedule, calib_s=time.perf_counter() - t0)
    return table, schedule, notes


def _train_seeds(cfg: DemoConfig, arm: Arm, desc: str, held_out: torch.Tensor, done: dict, *,
                 progress: bool) -> None:
    """Train ``arm`` on each of its seeds (`DemoConfig.seeds_of`); its rows go into
    ``done["rows"]``, its wall time into ``done["arm_s"]``."""
    done["stage"] = f"training arm {arm.name}"
    seeds = cfg.seeds_of(arm.name)
    bar = _bar(desc, len(seeds) * cfg.steps, progress)
    t0 = time.perf_counter()
    try:
        for seed in seeds:
            done["stage"] = f"training arm {arm.name} (seed {seed})"
            if bar is not None:
                bar.set_postfix_str(f"seed {seed}")
            rows = train_arm(arm, steps=cfg.steps, prompts_per_step=cfg.prompts_per_step,
                             group=cfg.group, prompt_len=cfg.prompt_len,
                             max_new_tokens=arm.max_new_tokens or cfg.max_new_tokens, lr=cfg.lr,
                             seed=seed, held_out=held_out, eval_every=cfg.eval_every,
                             probe_every=cfg.probe_every, bar=bar, progress=progress)
            done["rows"] += rows
            if bar is not None and rows:
                bar.set_postfix_str(f"seed {seed}: held-out greedy reward "
                                    f"{rows[0]['dense_eval_reward_before']:.3f} -> "
                                    f"{rows[-1]['dense_eval_reward']:.3f}")
    finally:
        done["arm_s"][arm.name] = time.perf_counter() - t0
        if bar is not None:
            bar.close()


def rerender(out: str | Path) -> None:
    """Rewrite report.md and the plots of a finished run from its files (metrics.jsonl,
    calibration.json, schedule.json, run.json), e.g. after the report's code changed."""
    from sparsecorr.schedules import BudgetSchedule, CalibrationTable

    out = Path(out)
    meta = json.loads((out / "run.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    write_report(out, rows=rows, table=CalibrationTable.load(out / "calibration.json"),
                 schedule=BudgetSchedule.load(out / "schedule.json"), config=meta["config"],
                 calib_s=meta["calib_s"], train_s=meta["train_s"], notes=meta["notes"])


def _bar(desc: str, total: int, progress: bool):
    """One tqdm bar per arm over its seeds x steps (None without ``progress``)."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)
