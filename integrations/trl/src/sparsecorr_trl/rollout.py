r"""Sparse rollouts for ``SparseGRPOTrainer``: TRL's prompt token ids -> ``sparsecorr.decoding``.

TRL hands ``_generate_single_turn`` one list of prompt token ids per rollout (prompts already
repeated ``num_generations`` times). `sparse_rollouts` pads them, samples with
``sparsecorr.decoding.generate`` under the configured KV policy and budget (an int or a
context-length schedule), and returns what TRL's vLLM path returns: the completion ids (up to
and including EOS, as TRL's own generate path cuts them) and the sampler's log-prob of every
completion token, which TRL turns into ``sampling_per_token_logps`` and the loss corrects.

The sampler uses TRL's temperature, ``top_k`` and ``top_p``; its log-probs are those of the
tempered, truncated distribution it sampled from (TRL's dense ``old_logp`` is tempered, not
truncated: truncation is part of the mismatch the correction sees, as with vLLM).

On a CUDA device the sampler runs its fast path by default: CUDA-graph decode steps with the
``auto`` backend (FlashInfer when installed). What ran is logged: ``sparsecorr/rollout/cuda_graph``
(1 when the graph replays ran, 0 when eager), ``sparsecorr/rollout/fused`` (1 when the captured
step ran compiled, ``sparsecorr.decoding.fused``) and ``sparsecorr/rollout/flashinfer`` (1 when the
FlashInfer kernels ran); `SparseRollouts.backend` names the backend. The batch comes back to the
host once (``generate`` returns CPU tensors) and is split into Python lists in one ``tolist`` per
field, not one per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from sparsecorr._modes import eval_mode
from sparsecorr.decoding import generate


@dataclass(frozen=True)
class RolloutStats:
    """Per-call statistics logged under ``sparsecorr/rollout/*``."""

    tokens: int
    tokens_per_s: float
    peak_kv_bytes: int
    mean_budget: float
    mean_kv_kept: float
    cuda_graph: float = 0.0
    fused: float = 0.0
    flashinfer: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        return {f"sparsecorr/rollout/{k}": float(v) for k, v in self.__dict__.items()}


def _pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask (``generate`` accepts either padding side)."""
    rows = [torch.tensor(p, dtype=torch.long) for p in prompt_ids]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_id)
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_value=0)
    return ids, mask


def sampling_kwargs(args) -> dict:
    """TRL's sampling settings as ``generate`` keywords (``top_k`` 0/None and ``top_p`` 1 = off)."""
    top_k = getattr(args, "top_k", None)
    top_p = getattr(args, "top_p", 1.0)
    return {"temperature": float(args.temperature),
            "top_k": int(top_k) if top_k else None,
            "top_p": None if top_p is None or top_p >= 1.0 else float(top_p)}


@dataclass(frozen=True)
class SparseRollouts:
    """What `sparse_rollouts` returns.

    Attributes:
        completions: completion token ids per rollout.
        logprobs: the sampler's log-prob of every completion token.
        stats: per-call statistics.
        topk_logp: ``[B, T, k]`` the sampler's top-k log-probs at every completion position
            (``-inf`` padded), or None when ``logprobs_topk=0``.
        topk_ids: ``[B, T, k]`` their token ids, or None.
    """

    completions: list[list[int]]
    logprobs: list[list[float]]
    stats: RolloutStats
    topk_logp: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    backend: str = ""
    cuda_graph: str = "off"
    fused: str = "off"


def use_cuda_graph(model, option: bool | None) -> bool:
    """``SparseCorrConfig.cuda_graph`` resolved for ``model``: None = on for a CUDA model."""
    return next(model.parameters()).device.type == "cuda" if option is None else bool(option)


def sparse_rollouts(model, prompt_ids: list[list[int]], *, policy, budget, max_new_tokens: int,
                    eos_token_id, pad_token_id: int, generator: torch.Generator,
                    sampling: dict, logprobs_topk: int = 0, cuda_graph: bool | None = None,
                    backend: str = "auto", fused_step: bool | None = None,
                    max_num_seqs: int | None = None) -> SparseRollouts:
    """Sample one completion per prompt with the sparse sampler (and record its top-k
    log-probs, for the acceptance rate, when ``logprobs_topk > 0``). ``cuda_graph``: None = on
    for a CUDA model (see `use_cuda_graph`); ``fused_step``: ``generate``'s ``fused``;
    ``max_num_seqs``: ``generate``'s (rows decoded at once; None = the memory plan)."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompt_ids: expected non-empty token id lists, got an empty prompt")
    ids, mask = _pad(prompt_ids, pad_token_id)
    with eval_mode(model):
        batch = generate(model, ids, mask, policy=policy, budget=budget,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                         generator=generator, logprobs_topk=logprobs_topk, backend=backend,
                         cuda_graph=use_cuda_graph(model, cuda_graph), fused=fused_step,
                         max_num_seqs=max_num_seqs, **sampling)
    lengths = batch.lengths.tolist()
    tokens, logp = batch.tokens.tolist(), batch.rollout_logp.tolist()  # host tensors: one pass each
    completions = [row[:n] for row, n in zip(tokens, lengths)]
    logprobs = [row[:n] for row, n in zip(logp, lengths)]
    gen = batch.mask
    seconds = batch.meta["prefill_s"] + batch.meta["decode_s"]
    budget_t = batch.budget[gen].float()
    stats = RolloutStats(
        tokens=int(gen.sum()), tokens_per_s=float(gen.sum()) / max(seconds, 1e-9),
        peak_kv_bytes=int(batch.peak_kv_bytes),
        mean_budget=float(budget_t[budget_t >= 0].mean()) if bool((budget_t >= 0).any()) else -1.0,
        mean_kv_kept=float(batch.kv_kept[gen].mean()) if bool(gen.any()) else 0.0,
        cuda_graph=float(batch.meta["cuda_graph"] == "on"), fused=float(batch.meta["fused"] == "on"),
        flashinfer=float(batch.meta["backend"] == "flashinfer"))
    top = (batch.topk_logp, batch.topk_ids) if logprobs_topk > 0 else (None, None)
    return SparseRollouts(completions, logprobs, stats, *top, backend=batch.meta["backend"],
                          cuda_graph=batch.meta["cuda_graph"], fused=batch.meta["fused"])
