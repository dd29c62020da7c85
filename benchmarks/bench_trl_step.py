"""A whole TRL trainer step: ``SparseGRPOTrainer`` with ``sparse_rl()`` against stock
``trl.GRPOTrainer`` with TRL's own vLLM importance-sampling correction (issue #25, target
<= 1.05x).

**Setup, identical for both.** One process, the shipped demo model (tiny Qwen3, 2 layers,
vocabulary 64: ``sparsecorr_trl.demo.task.demo_model()``, loaded once and deep-copied for every
trainer), its tokenizer, recall prompts (``make_prompts``) and reward (``recall_reward_text``),
and one ``GRPOConfig``: ``use_cpu=True``, ``bf16=False``, seed 0, ``logging_steps=1``, TRL's
defaults otherwise (``dapo`` loss, ``beta=0``, fused AdamW at 1e-6, gradient checkpointing on,
one generation per step: ``steps_per_generation=1``, ``num_iterations=1``), and
``vllm_importance_sampling_correction=True`` with ``vllm_importance_sampling_mode=
"token_truncate"``, ``vllm_importance_sampling_clip_max=2.0``.

**How TRL's vLLM-IS block is switched on without vLLM.** TRL 1.16 runs it in
``_generate_and_score_completions`` (and multiplies the loss by its ratio in ``_compute_loss``)
when ``self.use_vllm and self.vllm_importance_sampling_correction`` and the generation step
returned per-token sampler log-probs (``sampling_per_token_logps``). ``use_vllm=True`` in the
config would build a vLLM engine, so both trainers are built with ``use_vllm=False`` and then,
after construction, only two things are changed on each (no TRL or plugin code is patched):

1. ``trainer.use_vllm = True``: the flag TRL reads at run time. With no tools and no
   ``rollout_func``, its only other reader is the vLLM branch of ``_generate_single_turn``,
   which (2) replaces;
2. ``trainer._generate_single_turn`` (an instance attribute, so it shadows both TRL's method
   and the plugin's override, which with ``policy=None`` only calls TRL's) is a stand-in for
   the vLLM engine with the contract of TRL's vLLM branch: it returns the completion ids (cut
   after the first EOS) and one log-prob per completion token. It samples with
   ``model.generate`` on a frozen copy of the initial weights (``do_sample``, TRL's
   temperature, no top-k/top-p), reseeded from the call index inside ``torch.random.fork_rng``,
   so the two trainers receive the *same* rollouts (checked: a digest of every call's ids and
   log-probs must match across the two trainers of a round) and pay the same generation cost;
   the log-probs are the sampler's own (from ``generate``'s processed scores) plus a fixed
   seeded Gaussian perturbation (``--sigma``, default 0.2 nats, clamped to <= 0), the
   mismatch a sparse sampler would leave.

Stock ``GRPOTrainer`` then computes ``old_per_token_logps`` (one no-grad forward), TRL's
token_truncate ratio and its ``sampling/*`` metrics, and multiplies its loss by the ratio.
``SparseGRPOTrainer(sparsecorr_config=SparseCorrConfig("sparse_rl"))`` (no sparse policy)
switches TRL's IS off itself; its ``score_rollouts`` makes the same no-grad forward, measures
the mismatch, applies ``sparse_rl()`` and logs ``sparsecorr/*``, and its loss is
``sparse_grpo``. Each run fails loudly unless the stock trainer logged TRL's IS metrics (and
no ``sparsecorr/*``) and ours logged ``sparsecorr/*`` correction metrics (and not TRL's).

**What is timed.** A trainer step as ``Trainer.train()`` runs it: the time between two
consecutive ``on_step_begin`` callbacks, i.e. generation + scoring (rewards, advantages, the
old-log-prob forward, the IS ratio / sparsecorr's correction) + loss + backward + gradient
clipping + optimizer + logging + fetching the next batch. Each run trains a fresh trainer
(built untimed, from the same initial weights) for ``--steps + 2`` steps; the first interval
(first-call work such as the optimizer's state) is dropped, the run's value is the median of
the other ``--steps``. After the warm-up (below), ``--rounds`` rounds, each running both
trainers in a seeded shuffled order. Reported: the median over rounds of the per-round medians, and the per-round ratio ours/stock
(median, [min, max]); the target applies to the whole step. The same is reported with each
step's rollout generation (the stand-in sampler's own wall time, identical work for both)
subtracted, no target: it is what the two trainers do differently, undiluted by a generation
cost that depends on the sampler (here a CPU ``generate`` of the tiny model, most of the step).

Before the rounds, an untimed warm-up run of each trainer (2 steps) prints both trainers'
losses and corrections on the same first steps, plus an untimed cross-check: ours with
``SparseCorrConfig(correction=trl("token_truncate", clip_max=2))`` (the plugin's preset of
TRL's own rule) must reproduce the stock trainer's losses and gradient norms, which shows that
both receive the same inputs.

Usage: ``python benchmarks/bench_trl_step.py [--quick] [--steps 8] [--rounds 31]
[--threads 1] [--batch 8] [--generations 4] [--completion 16] [--sigma 0.2]``
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import logging
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _common import machine, setup, table

STOCK = "stock trl.GRPOTrainer + TRL vLLM-IS (token_truncate, cap 2)"
OURS = 'SparseGRPOTrainer + SparseCorrConfig("sparse_rl")'
#: untimed cross-check: ours with TRL's own rule as its correction must reproduce stock's losses
OURS_TRL = 'SparseGRPOTrainer + SparseCorrConfig(correction=trl("token_truncate", clip_max=2))'
TARGET = 1.05
#: keys TRL's IS block logs, and keys our correction must log
TRL_IS_KEYS = ("sampling/importance_sampling_ratio/mean",
               "sampling/sampling_logp_difference/mean")
OURS_PREFIXES = ("sparsecorr/mismatch/", "sparsecorr/correction/")


class Sampler:
    """The stand-in for TRL's vLLM engine (module docstring): seeded sampling on a frozen copy
    of the initial weights, returning TRL's vLLM-branch contract ``(completion_ids,
    logprobs)`` with a seeded perturbation of the log-probs."""

    def __init__(self, model, *, max_new_tokens: int, temperature: float, eos_id: int,
                 pad_id: int, sigma: float, seed: int) -> None:
        self.model = model.eval()
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.eos_id, self.pad_id, self.sigma, self.seed = eos_id, pad_id, sigma, seed

    def bind(self, clock: StepClock):
        """The ``_generate_single_turn`` to set on a trainer; records on ``clock`` a digest of
        every call's rollouts and its wall time."""
        calls = iter(range(1 << 30))

        def generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                 has_tool_images=False):
            t0 = time.perf_counter()
            ids, logps = self(prompt_ids, next(calls))
            clock.generation.append(time.perf_counter() - t0)
            clock.digests.append(hashlib.sha1(repr((ids, logps)).encode()).hexdigest())
            return ids, logps

        return generate_single_turn

    @torch.no_grad()
    def __call__(self, prompt_ids: list[list[int]], call: int):
        width = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompt_ids])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 100_003 + call)
            out = self.model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True,
                temperature=self.temperature, top_k=0, top_p=1.0,
                max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_id,
                pad_token_id=self.pad_id, output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[:, width:]
        scores = torch.stack(out.scores, 1).float()  # [B, T, V], processed (tempered)
        logp = scores.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        g = torch.Generator().manual_seed(self.seed * 7919 + call)
        logp = (logp + self.sigma * torch.randn(logp.shape, generator=g)).clamp(max=0.0)
        completions, logprobs = [], []
        for row, lp in zip(tokens.tolist(), logp.tolist()):
            n = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            completions.append(row[:n])
            logprobs.append(lp[:n])
        return completions, logprobs


class StepClock:
    """``on_step_begin`` timestamps (a ``TrainerCallback``), and what the sampler recorded."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.stamps.append(time.perf_counter())

        self.stamps: list[float] = []
        self.generation: list[float] = []  # the sampler's seconds, one call per step
        self.digests: list[str] = []
        self.callback = _Callback()

    def step_times(self) -> tuple[list[float], list[float]]:
        """Seconds of every whole step but the first (the last step has no end stamp), and
        the same less the step's rollout generation (step ``k`` makes sampler call ``k - 1``:
        one generation per step, ``steps_per_generation=1``)."""
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        if len(self.generation) < len(gaps):
            raise RuntimeError(f"expected one generation per step, got {len(self.generation)} "
                               f"for {len(gaps)} steps")
        return gaps[1:], [g - s for g, s in zip(gaps[1:], self.generation[1:])]


class Bench:
    """What both trainers share: the initial model, tokenizer, data, reward and config."""

    def __init__(self, args) -> None:
        from datasets import Dataset
        from sparsecorr_trl.demo.task import (
            PROMPT_LEN,
            demo_model,
            demo_tokenizer,
            make_prompts,
            prompt_text,
        )

        self.args = args
        self.model = demo_model()
        self.tokenizer = demo_tokenizer()
        self.dataset = Dataset.from_dict(
            {"prompt": prompt_text(make_prompts(256, PROMPT_LEN, seed=0))})
        self.sampler = Sampler(copy.deepcopy(self.model), max_new_tokens=args.completion,
                               temperature=1.0, eos_id=self.tokenizer.eos_token_id,
                               pad_id=self.tokenizer.pad_token_id, sigma=args.sigma, seed=0)

    def config(self, out: str, max_steps: int):
        from trl import GRPOConfig

        a = self.args
        return GRPOConfig(
            output_dir=out, per_device_train_batch_size=a.batch, num_generations=a.generations,
            max_completion_length=a.completion, max_steps=max_steps, logging_steps=1,
            report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no",
            disable_tqdm=True, temperature=1.0,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=2.0)

    def trainer(self, name: str, out: str, max_steps: int, clock: StepClock):
        from sparsecorr_trl import SparseCorrConfig, SparseGRPOTrainer
        from sparsecorr_trl.demo.task import recall_reward_text
        from transformers import PrinterCallback
        from trl import GRPOTrainer

        from sparsecorr.correction import trl

        kwargs = dict(model=copy.deepcopy(self.model).train(), reward_funcs=recall_reward_text,
                      args=self.config(out, max_steps), train_dataset=self.dataset,
                      processing_class=self.tokenizer, callbacks=[clock.callback])
        if name == STOCK:
            trainer = GRPOTrainer(**kwargs)
        else:
            correction = trl("token_truncate", clip_max=2.0) if name == OURS_TRL else "sparse_rl"
            trainer = SparseGRPOTrainer(**kwargs,
                                        sparsecorr_config=SparseCorrConfig(correction))
        trainer.remove_callback(PrinterCallback)  # disable_tqdm prints every log row
        trainer.use_vllm = True
        trainer._generate_single_turn = self.sampler.bind(clock)
        want_is = name == STOCK
        if trainer.vllm_importance_sampling_correction is not want_is:
            raise RuntimeError(f"{name}: vllm_importance_sampling_correction is "
                               f"{trainer.vllm_importance_sampling_correction}, expected {want_is}")
        return trainer

    def run(self, name: str, steps: int):
        """Train a fresh trainer for ``steps`` steps: (its ``StepClock``, its log rows)."""
        clock = StepClock()
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = self.trainer(name, out, steps, clock)
            trainer.train()
        rows = [r for r in trainer.state.log_history if "train_runtime" not in r]
        check(name, rows, steps)
        return clock, rows


def check(name: str, rows: list[dict], steps: int) -> None:
    """Fail unless every step logged its own correction (and not the other's)."""
    if len(rows) != steps:
        raise RuntimeError(f"{name}: expected {steps} logged steps, got {len(rows)}")
    for step, row in enumerate(rows, start=1):
        ours = [k for k in row if k.startswith(OURS_PREFIXES)]
        trl_is = [k for k in TRL_IS_KEYS if k in row]
        if name == STOCK:
            bad = len(trl_is) != len(TRL_IS_KEYS) or any(k.startswith("sparsecorr/") for k in row)
            if not bad and not row["sampling/sampling_logp_difference/mean"] > 0:
                bad = True  # the perturbation must reach TRL's IS block
        else:
            bad = bool(trl_is) or not any(k.startswith("sparsecorr/correction/") for k in ours) \
                or not any(k.startswith("sparsecorr/mismatch/") for k in ours)
        if bad:
            raise RuntimeError(f"{name}, step {step}: its IS/correction metrics are missing or "
                               f"the other's are present; logged keys: {sorted(row)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: a few seconds")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 8; quick 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 31; quick 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the matrices are tiny)")
    ap.add_argument("--batch", type=int, default=None, help="per-device batch (default 8; quick 4)")
    ap.add_argument("--generations", type=int, default=4, help="num_generations (default 4)")
    ap.add_argument("--completion", type=int, default=None,
                    help="max_completion_length (default 16; quick 8)")
    ap.add_argument("--sigma", type=float, default=0.2,
                    help="std of the seeded log-prob perturbation, nats (default 0.2)")
    args = ap.parse_args()
    steps = args.steps or (2 if args.quick else 8)
    rounds = args.rounds or (2 if args.quick else 31)
    args.batch = args.batch or (4 if args.quick else 8)
    args.completion = args.completion or (8 if args.quick else 16)
    setup(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    bench = Bench(args)
    arms = [STOCK, OURS]
    print(machine())
    print(f"demo Qwen3 (2 layers, vocab 64), batch {args.batch}, {args.generations} generations, "
          f"completion <= {args.completion} tokens, prompt 16 tokens, sigma {args.sigma}; "
          f"{rounds} rounds x {steps} timed steps per trainer, warm-up run first")

    # warm-up, and what each trainer computed on the same first two steps
    warm = {name: bench.run(name, 2) for name in (*arms, OURS_TRL)}
    if len({tuple(clock.digests) for clock, _ in warm.values()}) != 1:
        raise RuntimeError("the trainers received different rollouts")
    for a, b in zip(warm[STOCK][1], warm[OURS_TRL][1]):
        for key in ("loss", "grad_norm"):
            if abs(a[key] - b[key]) > 1e-6 + 1e-4 * abs(a[key]):
                raise RuntimeError(f"{OURS_TRL} does not reproduce the stock {key}: "
                                   f"{a[key]} vs {b[key]}")
    notes = {
        STOCK: "TRL IS ratio mean {sampling/importance_sampling_ratio/mean:.4f} "
               "[{sampling/importance_sampling_ratio/min:.3f}, "
               "{sampling/importance_sampling_ratio/max:.3f}], "
               "|old - sampler| mean {sampling/sampling_logp_difference/mean:.4f}",
        OURS: "ratio [{sparsecorr/mismatch/ratio_min:.3f}, {sparsecorr/mismatch/ratio_max:.3f}], "
              "kept tokens {sparsecorr/correction/kept_token_frac:.4f}, "
              "weight mean {sparsecorr/correction/weight_mean:.4f}",
        OURS_TRL: "untimed cross-check: same losses and grad norms as stock (checked)",
    }
    print(table(["first two steps (same weights, same rollouts)", "loss 1", "loss 2",
                 "grad norm 1", "IS / correction, step 1"],
                [[name, f"{rows[0]['loss']:.6f}", f"{rows[1]['loss']:.6f}",
                  f"{rows[0]['grad_norm']:.5f}", notes[name].format(**rows[0])]
                 for name, (_, rows) in warm.items()]))

    rng = random.Random(0)
    whole: dict[str, list[float]] = {name: [] for name in arms}  # per-round medians
    bare: dict[str, list[float]] = {name: [] for name in arms}  # the same less generation
    for _ in range(rounds):
        order = arms[:]
        rng.shuffle(order)
        digests = {}
        for name in order:
            clock, _ = bench.run(name, steps + 2)
            times, no_gen = clock.step_times()
            whole[name].append(statistics.median(times))
            bare[name].append(statistics.median(no_gen))
            digests[name] = clock.digests
        if digests[STOCK] != digests[OURS]:
            raise RuntimeError("the two trainers received different rollouts")

    rows = []
    for name in arms:
        for label, per_round in (("whole step", whole), ("step less generation", bare)):
            med = statistics.median(per_round[name])
            base = statistics.median(per_round[STOCK])
            rows.append([name, label, f"{med * 1e3:.1f}",
                         f"[{min(per_round[name]) * 1e3:.1f}, {max(per_round[name]) * 1e3:.1f}]",
                         f"{med / base:.3f}"])
    print(table(["implementation", "timed", "ms / step", "[min, max] over rounds", "vs stock"],
                rows))
    trows = []
    for label, per_round, target in (("ours / stock, whole step", whole, TARGET),
                                      ("ours / stock, step less generation", bare, None)):
        ratios = [o / s for o, s in zip(per_round[OURS], per_round[STOCK])]
        med = statistics.median(ratios)
        if target is None:
            goal, verdict = "", "(reported, no target)"
        else:
            goal, verdict = f"<= {target:g}", "met" if med <= target else "missed"
        trows.append([label, f"{med:.3f}", f"[{min(ratios):.3f}, {max(ratios):.3f}]", goal,
                      verdict])
    print(table(["ratio (per round)", "median", "[min, max] over rounds", "target", ""], trows))


if __name__ == "__main__":
    main()
