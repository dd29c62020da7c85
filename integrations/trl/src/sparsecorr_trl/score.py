r"""The correction, in the generate-and-score step, right after the dense ``old_logp`` is known.

``SparseGRPOTrainer._generate_and_score_completions`` runs TRL's step (rollouts, rewards,
advantages), then, for rollouts whose sampler log-probs are known (a sparse policy, or vLLM),
`score_rollouts`:

1. ``old_logp``: the dense model's log-probs with the rollout-time weights (TRL's when it
   computed them, else one no-grad forward with TRL's own forward);
2. the acceptance \(\alpha_t\) (`acceptance`) when the correction or the controller reads
   it;
3. one ``Mismatch`` record (``sparsecorr.mismatch.measure``) and the ``Correction`` of the
   whole generation batch, their metrics logged once per generation as ``sparsecorr/*``
   (the loss logs only its own ``loss/*``: nothing is computed twice);
4. advantages re-derived with the rollouts the correction rejected whole left out of their
   group's mean and standard deviation (``trl_advantages(valid=correction.sequence_mask)``);
5. ``num_items_in_batch`` re-counted as the kept tokens of the generation batch over all
   processes, so ``dapo``/``cispo`` divide by the tokens that are actually in the loss.

The correction's mask and weights travel with the batch (TRL shuffles and splits it into
micro-batches) and the loss applies them (without a correction, the record's valid mask
travels alone); the controller is fed the acceptance here.

**The acceptance, one definition.** \(\alpha_t = \sum_v \min(p_t(v), q_t(v)) = 1 -
\mathrm{TV}(p_t, q_t)\) between the dense (\(p\)) and the sparse sampler's (\(q\)) next-token
distributions, as the top-k lower bound ``acceptance_rate_topk`` (k = 20 on both sides, the
sampler's processed distribution against the tempered dense one) — the statistic calibration
(``sparsecorr.schedules.calibrate``) measures and Sparrow's \(\tau = 0.86\) is a threshold on.
The controller, ``sparse_tail`` and calibration all read this one. The sampled-token
\(\min(1, p(y)/q(y))\) is an unbiased estimate of \(\alpha_t\) (\(E_{y\sim q}\) of it is
\(\sum_v \min(p, q)\)), but it is a single draw: its lower tail is far below the tail of
\(\alpha\) (a token with \(\alpha_t = 0.95\) can draw \(y\) with \(p(y)/q(y) = 0.3\)), so a
5th percentile of it compared with \(\tau\) rejects rollouts whose distributions agree.

Shapes:
    completion tensors ``[B, T]``; top-k ``[B, T, k]``; advantages ``[B]``.
"""

from __future__ import annotations

import torch
from trl.models.utils import disable_gradient_checkpointing

from sparsecorr._checks import count, finite
from sparsecorr.mismatch import acceptance_rate_topk, measure, mismatch_metrics, topk_logprobs
from sparsecorr_trl.advantages import trl_advantages
from sparsecorr_trl.metrics import log_sparsecorr

__all__ = ["acceptance", "dense_old_logp", "score_rollouts"]


def _inputs(out):
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    return ids, attn, out["completion_ids"].size(1)


def _batch_size(trainer) -> int:
    args = trainer.args
    return args.per_device_train_batch_size if trainer.model.training else args.per_device_eval_batch_size


def dense_old_logp(trainer, out) -> torch.Tensor:
    """TRL's ``old_per_token_logps`` when it computed them, else the same no-grad forward."""
    if out.get("old_per_token_logps") is not None:
        return out["old_per_token_logps"]
    ids, attn, t = _inputs(out)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model,
                                                         trainer.args.gradient_checkpointing_kwargs):
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attn, t, batch_size=_batch_size(trainer))
    return logp


def _dense_topk(trainer, out, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense model's top-k log-probs at every completion position (tempered)."""
    ids, attn, t = _inputs(out)
    model = trainer.accelerator.unwrap_model(trainer.model)
    bs = _batch_size(trainer)
    vals, idx = [], []
    with torch.no_grad(), trainer._sparsecorr_dense_context(model):
        for s in range(0, ids.shape[0], bs):
            logits = model(input_ids=ids[s:s + bs], attention_mask=attn[s:s + bs]).logits
            v, i = topk_logprobs(logits[:, -t - 1:-1], k=min(k, logits.shape[-1]),
                                 temperature=trainer.temperature)
            vals.append(v)
            idx.append(i)
    return torch.cat(vals), torch.cat(idx)


def acceptance(trainer, out, topk_logp: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    r"""\(\alpha_t\) (module docstring) of every completion token, from the sampler's recorded
    top-k and the dense model's top-k at the same positions.

    Shapes:
        topk_logp, topk_ids: ``[B, T, k]`` -> ``[B, T]`` float32 in [0, 1].
    """
    t = out["completion_ids"].size(1)
    q_logp, q_ids = topk_logp[:, :t].to(out["completion_ids"].device), topk_ids[:, :t]
    if q_logp.shape[1] < t:  # completions padded further by TRL (pad_to_multiple_of)
        pad = t - q_logp.shape[1]
        q_logp = torch.nn.functional.pad(q_logp, (0, 0, 0, pad), value=float("-inf"))
        q_ids = torch.nn.functional.pad(q_ids, (0, 0, 0, pad))
    p_logp, p_ids = _dense_topk(trainer, out, q_logp.shape[-1])
    return acceptance_rate_topk(p_logp, p_ids, q_logp, q_ids.to(p_ids.device))


def _regroup(trainer, out, keep_rows: torch.Tensor) -> int:
    """Re-derive the advantages with rejected rollouts left out; how many were (global)."""
    valid = trainer.accelerator.gather(keep_rows)
    dropped = int((~valid).sum())
    if dropped:
        mode = "train" if trainer.model.training else "eval"
        g = trainer.num_generations if mode == "train" else trainer.num_generations_eval
        adv = trl_advantages(trainer._sparsecorr_rewards, trainer.reward_weights,
                             num_generations=g, scale_rewards=trainer.scale_rewards,
                             multi_objective_aggregation=trainer.multi_objective_aggregation,
                             valid=valid)
        b = keep_rows.shape[0]
        start = trainer.accelerator.process_index * b
        out["advantages"] = adv[start:start + b].to(out["advantages"].dtype)
    return dropped


def score_rollouts(trainer, out: dict, *, topk: tuple | None) -> dict:
    """Steps 1-5 of the module docstring on TRL's output ``out`` (changed in place, returned).

    Args:
        trainer: the ``SparseGRPOTrainer``.
        out: ``_generate_and_score_completions``'s output, with ``sampling_per_token_logps``.
        topk: the sampler's ``(topk_logp, topk_ids)`` when the acceptance is needed, else None.
    """
    mask = out["completion_mask"].bool()
    if "tool_mask" in out:
        mask = mask & out["tool_mask"].bool()
    old = dense_old_logp(trainer, out)
    acc = None if topk is None else acceptance(trainer, out, *topk)
    mm = measure(old, out["sampling_per_token_logps"], mask, acceptance=acc,
                 advantages=out["advantages"])
    out["sparsecorr_old_logp"] = old
    if acc is not None and trainer.model.training:
        prompt_lengths = out["prompt_mask"].sum(1).long()
        for cb in trainer._callbacks():
            cb.observe(acc, mm.valid & finite(acc), prompt_lengths)
    correction = trainer.sparsecorr_correction
    if correction is None:  # no correction: the loss still leaves non-finite rollout tokens out
        out["sparsecorr_mask"] = mm.valid
        if trainer.sparsecorr_config.log_metrics:
            log_sparsecorr(trainer, mismatch_metrics(mm, level="default"))
        return out
    corr = correction(mm)
    out["sparsecorr_mask"] = corr.mask
    out["sparsecorr_weights"] = corr.weights
    # rows TRL itself emptied (mask_truncated_completions) keep their place in the groups
    dropped = _regroup(trainer, out, corr.sequence_mask | ~mm.input_rows)
    out["num_items_in_batch"] = trainer.accelerator.gather(count(corr.mask)).sum()
    if trainer.sparsecorr_config.log_metrics:
        log_sparsecorr(trainer, {**mismatch_metrics(mm), **corr.metrics,
                                 "advantages/regrouped_seqs": dropped})
    return out
