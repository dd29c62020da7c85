r"""One GRPO arm: sparse (or dense) rollouts -> dense old log-probs -> ``sparse_grpo`` step.

Per step: sample ``G`` responses per prompt with the arm's KV policy/budget (``rollout_logp``),
teacher-force the dense model for ``old_logp``, compute \(\log\pi_\theta\) by a full forward,
group-normalise rewards and minimise ``sparse_grpo`` with the arm's correction.

Shapes:
    prompts ``[B, P]``; all per-token tensors ``[B*G, T]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..decoding import Dense, generate, teacher_forced_logprobs
from ..losses import group_advantages, sparse_grpo
from .task import make_prompts, recall_reward


@dataclass(frozen=True)
class Arm:
    """A training arm: name, KV policy, budget (int, schedule or None) and correction."""

    name: str
    policy: Any
    budget: Any
    correction: Any


def _learner_logp(model, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    ids = torch.cat([prompts, tokens], 1)
    logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def train_arm(model, arm: Arm, *, steps: int, prompts_per_step: int, group: int,
              prompt_len: int, max_new_tokens: int, lr: float, seed: int, log) -> None:
    """Run ``steps`` GRPO updates on ``model`` in place, calling ``log(row)`` per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        prompts = make_prompts(prompts_per_step, prompt_len, seed=seed * 1000 + step)
        prompts = prompts.repeat_interleave(group, 0)
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            batch = generate(model, prompts, policy=arm.policy, budget=arm.budget,
                             max_new_tokens=max_new_tokens, generator=g)
            gen_s = time.perf_counter() - t0
            dense = teacher_forced_logprobs(model, prompts, batch.tokens, policy=Dense(),
                                            budget=None, response_mask=batch.mask)
        mask = batch.mask.bool()
        reward = recall_reward(prompts, batch.tokens, mask)
        adv = group_advantages(reward, group_size=group)
        model.train()
        logp = _learner_logp(model, prompts, batch.tokens)
        out = sparse_grpo(logp, dense.rollout_logp, adv, mask, rollout_logp=batch.rollout_logp,
                          correction=arm.correction, aggregation="seq-mean-token-mean")
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        row = {"arm": arm.name, "step": step, "reward": float(reward.mean()),
               "loss": float(out.loss.detach()), "tokens_per_s": float(mask.sum()) / max(gen_s, 1e-9),
               "peak_kv_bytes": int(batch.peak_kv_bytes)}
        row.update({k: float(v) for k, v in out.metrics.items()})
        log(row)
