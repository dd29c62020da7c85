r"""DistillSparse inside ``SparseGRPOTrainer`` (Sparrow, Zhou et al. 2026, arXiv 2606.08446).

The policy is wrapped with a LoRA adapter \(\varphi\) (``sparsecorr.losses.sparse_adapter``)
that is active only in the sparse sampler: every dense forward of the trainer (``old_logp``,
the reference-free PPO loss on \(\theta\)) runs inside ``dense_mode``. After the policy's
backward pass on a batch, `AdapterStep` takes one AdamW step on \(\varphi\) alone with

\[
L_\varphi = L_\text{PPO}^\text{sparse}(\text{sparse\_logp}, \text{rollout\_logp}) +
\lambda\,\overline{k_3}(\text{dense\_logp}, \text{sparse\_logp}),
\]

where ``sparse_logp`` is the sparse sampler's own log-prob of the rollout tokens, teacher-forced
through the same sparse decode path with autograd on (``teacher_forced_logprobs(grad=True)``),
and ``dense_logp`` is the dense model's log-prob at rollout time (detached). The gradient is
taken with ``torch.autograd.grad`` with respect to \(\varphi\) only, so \(\theta\)'s
accumulated gradient is untouched.

Shapes:
    prompt ids ``[B, P]``; completion ids, masks and log-probs ``[B, T]``; advantages ``[B]``.
"""

from __future__ import annotations

import torch

from sparsecorr._modes import eval_mode
from sparsecorr.decoding import teacher_forced_logprobs
from sparsecorr.losses import PPOClip, adapter_parameters, distill_sparse_loss


class AdapterStep:
    """The adapter's optimizer and its per-batch update (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, kl_weight: float) -> None:
        self.params = adapter_parameters(model)
        if not self.params:
            raise ValueError("model: expected a peft model with the sparse LoRA adapter, found "
                             "no lora_ parameters")
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)
        self.kl_weight = kl_weight

    def __call__(self, model, *, prompt_ids, prompt_mask, completion_ids, completion_mask,
                 rollout_logp, dense_logp, advantages, policy, budget, sampling: dict,
                 clip_low: float, clip_high: float, aggregation: str) -> dict[str, float]:
        """One AdamW step on the adapter; returns its ``distill/*`` metrics."""
        mask = completion_mask.bool()
        # eval: no gradient checkpointing, whose recompute would replay a mutated KV cache
        with eval_mode(model):
            sparse = teacher_forced_logprobs(
                model, prompt_ids, completion_ids, policy=policy, budget=budget,
                attention_mask=prompt_mask, response_mask=mask, logprobs_topk=0, grad=True,
                **sampling)
        sparse_logp = sparse.rollout_logp.to(dense_logp.device)
        out = distill_sparse_loss(sparse_logp, rollout_logp, dense_logp.detach(), advantages,
                                  mask, kl_weight=self.kl_weight,
                                  surrogate=PPOClip(clip_low=clip_low, clip_high=clip_high),
                                  aggregation=aggregation)
        grads = torch.autograd.grad(out.loss, self.params, allow_unused=True)
        for p, g in zip(self.params, grads):
            p.grad = None if g is None else g.detach()
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        metrics = {k: float(v) for k, v in out.metrics.items() if k.startswith("distill/")}
        metrics["distill/loss"] = float(out.loss.detach())
        return metrics
