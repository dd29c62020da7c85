r"""One demo arm: ``SparseGRPOTrainer`` (TRL 1.16) on the shipped model and the recall task.

Each arm is a ``SparseCorrConfig``: the KV policy and budget or schedule the trainer samples
with (``sparsecorr.decoding``), and the correction its ``sparse_grpo`` loss applies. The trainer
logs one row per optimizer step (TRL's ``log_history`` with ``logging_steps=1``); a callback adds
the *dense* model's greedy reward on held-out prompts (every ``eval_every`` steps and after the
last), which is what training should raise and a sparse-rollout run must not damage.

Shapes:
    prompts ``[N, P]`` token ids (the dataset holds their text); rewards per completion.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from sparsecorr._modes import eval_mode
from sparsecorr.decoding import Dense, generate

from .probe import probe_sampler, sampler_of
from .task import (
    demo_model,
    demo_tokenizer,
    make_prompts,
    prompt_text,
    recall_reward,
    recall_reward_text,
)


@dataclass(frozen=True)
class Arm:
    """A training arm: a name, the ``SparseCorrConfig`` keywords it trains with, extra
    ``GRPOConfig`` keywords (e.g. ``{"num_iterations": 2}``) and the labels the report groups
    by: ``sampler`` (``"dense"``, ``"b8"``, ``"schedule"`` ...) and ``correction``
    (``"none"``, ``"sparse_rl"``, ``"sparse_rl+distill"``); ``max_new_tokens`` overrides the
    run's response length (the long-response arms)."""

    name: str
    config: dict[str, Any]
    grpo: dict[str, Any] = field(default_factory=dict)
    sampler: str = ""
    correction: str = ""
    #: response length of this arm (None: the run's)
    max_new_tokens: int | None = None


def _trl():
    from transformers import TrainerCallback
    from transformers.trainer_callback import ProgressCallback
    from trl import GRPOConfig

    from sparsecorr_trl import SparseCorrConfig, SparseGRPOTrainer

    return SparseCorrConfig, SparseGRPOTrainer, GRPOConfig, TrainerCallback, ProgressCallback


def dense_eval_reward(model, prompts: torch.Tensor, *, max_new_tokens: int) -> float:
    """Mean recall reward of the dense model's greedy responses to ``prompts``."""
    with eval_mode(model):
        batch = generate(model, prompts, policy=Dense(), budget=None, temperature=0.0,
                         max_new_tokens=max_new_tokens, logprobs_topk=0)
    return float(recall_reward(prompts, batch.tokens, batch.mask).mean())


def _row(arm: Arm, seed: int, log: dict[str, float], evals: dict[int, float],
         probes: dict[int, dict[str, float]]) -> dict[str, Any]:
    step = int(log["step"]) - 1
    row = {"arm": arm.name, "sampler": arm.sampler, "correction": arm.correction, "seed": seed,
           # with num_iterations > 1 only the steps that generate log a reward
           "step": step, "reward": float(log.get("reward", float("nan"))),
           "loss": float(log.get("loss", float("nan"))),
           "tokens_per_s": float(log.get("sparsecorr/rollout/tokens_per_s", float("nan"))),
           "peak_kv_bytes": int(log.get("sparsecorr/rollout/peak_kv_bytes", 0)),
           "mean_budget": float(log.get("sparsecorr/rollout/mean_budget", -1.0)),
           "kl_k3": float(log.get("sparsecorr/mismatch/kl_k3_mean", float("nan"))),
           # the tail of the mismatch: the 5% quantile of log(old/rollout) (logged by the
           # correction's summary, so NaN without a correction) and the worst token's |.|
           "mismatch_tail": float(log.get("sparsecorr/mismatch/log_ratio_q05", float("nan"))),
           "mismatch_max": float(log.get("sparsecorr/mismatch/log_ratio_abs_max", float("nan"))),
           "dense_eval_reward": evals.get(step + 1, float("nan"))}
    row.update(probes.get(step + 1, {}))
    row.update({k: float("nan") if v is None else float(v) for k, v in log.items()
                if k.startswith("sparsecorr/")})
    return row


@contextmanager
def quiet_demo() -> Iterator[None]:
    """What the demo does not show its user, restored on exit: transformers' "Loading weights"
    bar (``transformers.core_model_loading``, one per ``from_pretrained`` of the shipped model)
    and TRL 1.16's read of ``model.is_gradient_checkpointing`` (``trl.models.utils``, during
    generation), which transformers 5 deprecates with a FutureWarning (nothing in this config can
    avoid the read). It also runs torch on one thread: the model is tiny, and two threads on a
    shared two-core machine spin against each other (measured: 2-7 s per arm on one thread
    against up to 94 s on two, with other jobs on the cores)."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    threads = torch.get_num_threads()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            yield
    finally:
        torch.set_num_threads(threads)
        if bar:
            hf_logging.enable_progress_bar()


def _probe(arm: Arm, model, held_out: torch.Tensor, *, max_new_tokens: int,
           seed: int) -> dict[str, float]:
    """`probe_sampler` of the arm's sampler (none for dense); DistillSparse also without its
    adapter (keys ``..._noadapter``), the dense model always with the adapter off."""
    sampler = sampler_of(arm.config)
    if sampler is None:
        return {}
    policy, budget = sampler
    kw = {"policy": policy, "budget": budget, "max_new_tokens": max_new_tokens, "seed": seed}
    if not hasattr(model, "disable_adapter"):
        return probe_sampler(model, held_out, **kw)
    out = probe_sampler(model, held_out, dense=model.disable_adapter(), **kw)
    off = probe_sampler(model, held_out, dense=model.disable_adapter(),
                        sparse=model.disable_adapter(), **kw)
    return out | {f"{k}_noadapter": v for k, v in off.items()}


def train_arm(arm: Arm, *, steps: int, prompts_per_step: int, group: int, prompt_len: int,
              max_new_tokens: int, lr: float, seed: int, held_out: torch.Tensor | None = None,
              eval_every: int = 1, probe_every: int = 0, bar: Any = None,
              progress: bool = True) -> list[dict[str, Any]]:
    """Train a fresh copy of the demo model for ``steps`` GRPO steps; one row per step.

    Row 0's ``dense_eval_reward_before`` is measured before training; row ``i``'s
    ``dense_eval_reward`` after step ``i + 1`` when ``(i + 1) % eval_every == 0`` or it is the
    last step (NaN otherwise). With ``probe_every`` > 0 a sparse arm's sampler is also probed
    (`probe_sampler`: the ``probe_*`` keys) before training (row 0's ``..._before`` keys),
    every ``probe_every`` steps and after the last. ``held_out``: the evaluation prompts
    (default: 16 made from ``seed``). ``bar``: a tqdm bar advanced once per step (TRL's own bar
    is shown instead when it is None and ``progress``).
    """
    with quiet_demo():
        return _train(arm, steps=steps, prompts_per_step=prompts_per_step, group=group,
                      prompt_len=prompt_len, max_new_tokens=max_new_tokens, lr=lr, seed=seed,
                      held_out=held_out, eval_every=eval_every, probe_every=probe_every,
                      bar=bar, progress=progress)


def _train(arm: Arm, *, steps, prompts_per_step, group, prompt_len, max_new_tokens, lr, seed,
           held_out, eval_every, probe_every, bar, progress) -> list[dict[str, Any]]:
    SparseCorrConfig, SparseGRPOTrainer, GRPOConfig, TrainerCallback, ProgressCallback = _trl()
    from datasets import Dataset

    torch.manual_seed(seed)
    model = demo_model(seed).train()
    if held_out is None:
        held_out = make_prompts(16, prompt_len, seed=seed + 99_991)
    texts = prompt_text(make_prompts(steps * prompts_per_step, prompt_len, seed=seed + 1))
    data = Dataset.from_dict({"prompt": texts})
    evals = {0: dense_eval_reward(model, held_out, max_new_tokens=max_new_tokens)}
    probes: dict[int, dict[str, float]] = {}
    if probe_every > 0:
        probes[0] = _probe(arm, model, held_out, max_new_tokens=max_new_tokens, seed=seed)

    class StepBar(ProgressCallback):
        """TRL's progress bar over the training steps, without printing every log dict."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            return control

    class DenseEval(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            n, m = state.global_step, kwargs.get("model") or model
            if n % eval_every == 0 or n == steps:
                # DistillSparse wraps the model in a LoRA adapter that is on outside
                # dense_mode: the dense model is the one with the adapter off
                off = m.disable_adapter() if hasattr(m, "disable_adapter") else nullcontext()
                with off:
                    evals[n] = dense_eval_reward(m, held_out, max_new_tokens=max_new_tokens)
            if probe_every > 0 and (n % probe_every == 0 or n == steps):
                probes[n] = _probe(arm, m, held_out, max_new_tokens=max_new_tokens, seed=seed + n)
            if bar is not None:
                bar.update(1)
            return control

    with tempfile.TemporaryDirectory(prefix="sparsecorr-demo-") as tmp:
        args = GRPOConfig(output_dir=tmp, per_device_train_batch_size=prompts_per_step * group,
                          num_generations=group, max_completion_length=max_new_tokens,
                          max_steps=steps, learning_rate=lr, loss_type="grpo", beta=0.0,
                          logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=seed,
                          save_strategy="no", activation_checkpointing=False, temperature=1.0,
                          disable_tqdm=not progress, shuffle_dataset=False, **arm.grpo)
        trainer = SparseGRPOTrainer(model=model, reward_funcs=recall_reward_text, args=args,
                                    train_dataset=data, processing_class=demo_tokenizer(),
                                    callbacks=[DenseEval()],
                                    sparsecorr_config=SparseCorrConfig(**arm.config))
        trainer.remove_callback(ProgressCallback)
        if progress and bar is None:
            trainer.add_callback(StepBar())
        trainer.train()
    rows = [_row(arm, seed, log, evals, probes) for log in trainer.state.log_history
            if "reward" in log or "loss" in log]
    if rows:
        rows[0]["dense_eval_reward_before"] = evals[0]
        rows[0].update({f"{k}_before": v for k, v in probes.get(0, {}).items()})
    return rows
