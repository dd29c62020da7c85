"""The peers' own loss code, loaded the way the parity tests load it, for the benchmarks.

- TRL 1.16: its vLLM importance-sampling block is cut from the installed
  ``GRPOTrainer._generate_and_score_completions`` source and executed (as
  ``tests/unit/correction/test_parity_peers.py`` does); its real ``GRPOTrainer._compute_loss``
  runs on a stand-in ``self`` that hands it the learner log-probs (``accelerator.gather`` and
  ``reduce`` are the identity of a single process), metrics included. The *bare* loss re-types
  the loss arithmetic of ``_compute_loss`` op for op (``dapo``), without its metrics.
- OpenRLHF 0.11: ``PolicyLoss`` through ``tests/openrlhf_shim.py``.
- verl 0.9.1: ``compute_rollout_correction_and_rejection_mask`` and
  ``compute_policy_loss_vanilla`` + ``agg_loss`` through ``tests/verl_shim.py``.

Every loader returns None when the peer is not installed.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace

import torch

Inputs = dict[str, torch.Tensor]


def trl_is_block() -> Callable[[Inputs], torch.Tensor] | None:
    """TRL's own token_truncate IS ratio (cap 2) from ``_generate_and_score_completions``."""
    try:
        from trl.trainer import grpo_trainer
    except ImportError:
        return None
    src = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    start = src.index("            if self.use_vllm and self.vllm_importance_sampling_correction:\n"
                      "                mask = completion_mask")
    end = src.index("            # Compute the per-token log probabilities for the reference model")
    code = compile(textwrap.dedent(src[start:end]), "trl_is_block", "exec")
    owner = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                            vllm_importance_sampling_mode="token_truncate",
                            vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=2.0)

    def run(d: Inputs) -> torch.Tensor:
        ns = {"self": owner, "completion_mask": d["mask_f"], "tool_mask": None, "torch": torch,
              "math": math, "old_per_token_logps": d["old"], "sampling_per_token_logps": d["rollout"]}
        exec(code, ns)
        return ns["vllm_importance_sampling_ratio"]

    return run


def trl_bare() -> Callable[[Inputs], None] | None:
    """TRL's IS block + the loss arithmetic of ``_compute_loss`` (``dapo``), no metrics."""
    is_block = trl_is_block()
    if is_block is None:
        return None

    def run(d: Inputs) -> None:
        is_ratio = is_block(d)
        lp = d["logp"].clone().requires_grad_(True)
        mask = d["mask_f"]
        coef_1 = torch.exp(lp - d["old"])
        coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
        adv = d["adv"].unsqueeze(1)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv) * is_ratio
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        loss.backward()

    return run


def trl_real() -> Callable[[Inputs], None] | None:
    """TRL's IS block + its real ``GRPOTrainer._compute_loss`` (metrics included)."""
    is_block = trl_is_block()
    if is_block is None:
        return None
    from trl.trainer.grpo_trainer import GRPOTrainer

    def make_owner(lp: torch.Tensor) -> SimpleNamespace:
        accel = SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction="sum": x,
                                gather_for_metrics=lambda x: x, num_processes=1, sync_gradients=True)
        args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1)
        return SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
            aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
            importance_sampling_level="token", beta=0.0, loss_type="dapo", epsilon_low=0.2,
            epsilon_high=0.2, args=args, use_vllm=True, vllm_importance_sampling_correction=True,
            model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
            accelerator=accel, _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)))

    def run(d: Inputs) -> None:
        inputs = {"prompt_ids": d["prompt"], "prompt_mask": d["prompt"], "completion_ids": d["tokens"],
                  "completion_mask": d["mask_i"], "advantages": d["adv"], "old_per_token_logps": d["old"],
                  "importance_sampling_ratio": is_block(d),
                  "num_items_in_batch": d["mask_f"].sum()}
        lp = d["logp"].clone().requires_grad_(True)
        loss = GRPOTrainer._compute_loss(make_owner(lp), None, inputs)
        loss.backward()

    return run


def openrlhf_policy_loss() -> Callable[[Inputs], None] | None:
    try:
        from tests.openrlhf_shim import load_openrlhf_loss_module

        policy_loss = load_openrlhf_loss_module().PolicyLoss(
            is_correction_level="token", is_correction_mode="mask", is_correction_threshold=(0.5, 5.0))
    except Exception:
        return None

    def run(d: Inputs) -> None:
        lp = d["logp"].clone().requires_grad_(True)
        loss, *_ = policy_loss(lp, d["old"], d["adv"][:, None], action_mask=d["mask_f"],
                               rollout_log_probs=d["rollout"])
        loss.backward()

    return run


def verl_functions() -> tuple[Callable, Callable] | None:
    """``(correction, loss)``: verl's rollout correction (token TIS 2 + token_k1 rejection
    [0.5, 2], with its metrics) and its vanilla policy loss with those weights."""
    try:
        from tests.verl_shim import load_verl_module

        helper = load_verl_module("verl.trainer.ppo.rollout_corr_helper")
        core = load_verl_module("verl.trainer.ppo.core_algos")
    except Exception:
        return None
    config = _VerlActorConfig()

    def correction(d: Inputs):
        return helper.compute_rollout_correction_and_rejection_mask(
            d["old"], d["rollout"], d["mask_f"], rollout_is="token", rollout_is_threshold=2.0,
            rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")

    def loss(d: Inputs) -> None:
        weights, mask, _ = correction(d)
        w = weights["rollout_is_weights"] if isinstance(weights, dict) else weights.batch["rollout_is_weights"]
        lp = d["logp"].clone().requires_grad_(True)
        pg, _ = core.compute_policy_loss_vanilla(d["old"], lp, d["adv"][:, None].expand_as(lp), mask,
                                                 loss_agg_mode="token-mean", config=config,
                                                 rollout_is_weights=w)
        pg.backward()

    return correction, loss


class _VerlActorConfig(dict):
    """The fields of verl's ``ActorConfig`` its vanilla loss reads (defaults of verl 0.9.1)."""

    clip_ratio = 0.2
    clip_ratio_low = 0.2
    clip_ratio_high = 0.2
    global_batch_info: dict = {}  # noqa: RUF012 - read-only stand-in

    def get(self, key, default=None):
        return {"clip_ratio_c": 3.0}.get(key, default)
