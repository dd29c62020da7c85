r"""Sparse decoding over Hugging Face causal LMs: ``generate`` and ``teacher_forced_logprobs``.

One loop serves both: prefill the (left-padded, ragged) prompts, then one token per step for
every active row, with the model's attention routed through the ``"sparsecorr"`` attention
function and a `SparseKVCache`. Positions are passed
explicitly (true positions, so RoPE is right after eviction). Rows that finish (EOS) or are
pruned leave the batch, freeing their compute and KV. ``teacher_forced_logprobs`` runs the same
loop with the tokens given, so for the same tokens it reproduces ``generate``'s log-probs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tqdm.auto import tqdm

from ..mismatch import truncate_logits
from .backends import get_backend
from .cache import ATTN_NAME, SparseKVCache, active_cache
from .policies import Dense, KVPolicy
from .rollout import RolloutBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["BudgetLike", "generate", "teacher_forced_logprobs"]


class BudgetLike(Protocol):
    def budget_at(self, context_len: int) -> int | None: ...


@contextlib.contextmanager
def _sparse_attention(model) -> Iterator[None]:
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _budgets(budget, context_lens: torch.Tensor) -> torch.Tensor:
    if budget is None:
        return torch.full_like(context_lens, -1)
    if isinstance(budget, int):
        if budget < 1:
            raise ValueError(f"budget: expected a positive int, None or a schedule, got {budget!r}")
        return torch.full_like(context_lens, budget)
    if not hasattr(budget, "budget_at"):
        raise ValueError(f"budget: expected an int or an object with budget_at(context_len), got {type(budget).__name__}")
    vals = [budget.budget_at(int(c)) for c in context_lens.tolist()]
    return torch.tensor([-1 if v is None else int(v) for v in vals], dtype=torch.long)


def _left_pad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-align ragged prompts: returns ids ``[B, P]`` and a bool validity mask ``[B, P]``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [B, P], got {tuple(input_ids.shape)}")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    m = attention_mask.bool()
    order = (~m).long().argsort(dim=1, descending=True, stable=True)  # padding first, order kept
    return input_ids.gather(1, order), m.gather(1, order)


def _sample(logits, *, temperature, top_k, top_p, k, generator, forced):
    """Next token, its log-prob and the top-k, all from the processed distribution."""
    z = logits.float()
    if temperature > 0:
        z = truncate_logits(z / temperature, top_k, top_p)
    logp_all = torch.log_softmax(z, dim=-1)
    if forced is not None:
        tok = forced
    elif temperature > 0:
        tok = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(1)
    else:
        tok = logp_all.argmax(-1)
    top = logp_all.topk(min(k, logp_all.shape[-1]), dim=-1) if k > 0 else None
    return tok, logp_all.gather(1, tok[:, None]).squeeze(1), top


def _run(model, input_ids, attention_mask, *, policy, budget, max_new_tokens, temperature, top_k,
         top_p, logprobs_topk, eos_token_id, backend, generator, progress, forced, forced_mask,
         pruner, group_size, grad=False) -> RolloutBatch:
    if not isinstance(policy, KVPolicy):
        raise ValueError(f"policy: expected a KVPolicy (Dense(), RKV(), ...), got {type(policy).__name__}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {temperature!r}")
    device = next(model.parameters()).device
    ids, pmask = _left_pad(input_ids.to(device), None if attention_mask is None else attention_mask.to(device))
    b_total = ids.shape[0]
    prompt_len = pmask.sum(1)
    eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
    k = logprobs_topk
    out_tok = torch.zeros(b_total, max_new_tokens, dtype=torch.long)
    out_mask = torch.zeros(b_total, max_new_tokens, dtype=torch.bool)
    out_logp = torch.zeros(b_total, max_new_tokens)
    out_tk = torch.full((b_total, max_new_tokens, k), float("-inf"))
    out_ti = torch.zeros(b_total, max_new_tokens, k, dtype=torch.long)
    out_budget = torch.full((b_total, max_new_tokens), -1, dtype=torch.long)
    out_kept = torch.zeros(b_total, max_new_tokens)
    finish = ["length"] * b_total
    pruned = torch.zeros(b_total, dtype=torch.bool)
    pruned_at = torch.full((b_total,), -1, dtype=torch.long)
    n_layers = model.config.num_hidden_layers
    cache = SparseKVCache(n_layers, policy=policy, backend=get_backend(backend))
    active = torch.arange(b_total)
    hidden_buf = None
    if pruner is not None:
        hidden_buf = torch.zeros(b_total, pruner.window, model.config.hidden_size)
    budget_obj = None if isinstance(policy, Dense) else budget
    with _sparse_attention(model), active_cache(cache), torch.set_grad_enabled(grad):
        # prefill: positions count real tokens only (left padding has no position)
        pos = (pmask.long().cumsum(1) - 1).clamp(min=0)
        cache.new_pos, cache.new_valid = pos, pmask
        cache.step_budget = _budgets(budget_obj, prompt_len.cpu()).to(device)
        t_start = time.perf_counter()
        out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
        cache.compress_if_needed(cache.step_budget)
        cache.peak_bytes = cache.kv_bytes()
        t_prefill = time.perf_counter()
        bar = tqdm(total=max_new_tokens, disable=not progress, desc=f"decode {policy.name}")
        for t in range(max_new_tokens):
            rows = active
            f_tok = None if forced is None else forced[rows, t].to(device)
            tok, lp, top = _sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, k=k,
                                   generator=generator, forced=f_tok)
            out_tok[rows, t], out_logp[rows, t], out_mask[rows, t] = tok.cpu(), lp.cpu(), True
            if top is not None:
                out_tk[rows, t], out_ti[rows, t] = top.values.cpu(), top.indices.cpu()
            out_budget[rows, t] = cache.step_budget.cpu()
            done = torch.zeros(len(rows), dtype=torch.bool)
            if eos:
                done |= torch.tensor([int(x) in eos for x in tok.tolist()])
                for r in rows[done].tolist():
                    finish[r] = "eos"
            if forced_mask is not None:
                last = ~forced_mask[rows, t + 1] if t + 1 < max_new_tokens else torch.ones(len(rows), dtype=torch.bool)
                done |= last
            if t + 1 == max_new_tokens:
                bar.update(1)
                break
            keep = ~done
            if not bool(keep.any()):
                bar.update(max_new_tokens - t)
                break
            if not bool(keep.all()):
                sel = keep.nonzero().squeeze(1).to(device)
                cache.select_rows(sel)
                active, tok = active[keep], tok[sel]
            context = prompt_len[active].cpu() + t + 1
            step_pos = (prompt_len[active] + t).to(device)[:, None]
            cache.new_pos, cache.new_valid = step_pos, torch.ones_like(step_pos, dtype=torch.bool)
            cache.step_budget = _budgets(budget_obj, context).to(device)
            cache.attended = None
            # hidden states of generated tokens detect_len - window ... detect_len - 1 (fed here)
            slot = None if pruner is None else t - (pruner.detect_len - pruner.window)
            want_hidden = slot is not None and 0 <= slot < pruner.window
            out = model(input_ids=tok[:, None], position_ids=step_pos, past_key_values=cache,
                        use_cache=True, output_hidden_states=want_hidden)
            logits = out.logits[:, -1]
            if want_hidden:
                hidden_buf[active, slot] = out.hidden_states[pruner.layer][:, -1].float().cpu()
            if cache.attended is not None:
                out_kept[active, t] = (cache.attended / n_layers).cpu()
            if pruner is not None and t + 1 == pruner.detect_len:
                # every row has generated detect_len tokens and its window of hidden states
                decision = pruner.decide(hidden_buf.to(device), group_size=group_size).cpu()
                cut = ~decision[active]
                pruned[active[cut]] = True
                pruned_at[active[cut]] = t + 1
                for r in active[cut].tolist():
                    finish[r] = "pruned"
                if bool(cut.all()):
                    bar.update(max_new_tokens - t)
                    break
                if bool(cut.any()):
                    sel = (~cut).nonzero().squeeze(1).to(device)
                    cache.select_rows(sel)
                    active, logits = active[~cut], logits[sel]
            cache.compress_if_needed(cache.step_budget)
            cache.peak_bytes = max(cache.peak_bytes, cache.kv_bytes())
            bar.update(1)
        bar.close()
        t_end = time.perf_counter()
    lengths = out_mask.sum(1)
    mask = out_mask & ~pruned[:, None]
    return RolloutBatch(
        tokens=out_tok, mask=mask, lengths=lengths, prompt_lengths=prompt_len.cpu(),
        rollout_logp=torch.where(out_mask, out_logp, 0.0), topk_logp=out_tk, topk_ids=out_ti,
        budget=out_budget, kv_kept=out_kept, finish_reason=tuple(finish),
        peak_kv_bytes=int(cache.peak_bytes), pruned=pruned, pruned_at=pruned_at,
        meta={"policy": repr(policy), "backend": cache.backend.name, "dtype": str(next(model.parameters()).dtype),
              "temperature": temperature, "top_k": top_k, "top_p": top_p,
              "budget": budget if isinstance(budget, int) or budget is None else repr(budget),
              "seed": None if generator is None else int(generator.initial_seed()),
              "prefill_s": t_prefill - t_start, "decode_s": t_end - t_prefill},
    )


def generate(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             policy: KVPolicy, budget: int | BudgetLike | None, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             logprobs_topk: int = 20, eos_token_id: int | list[int] | None = None,
             backend: str = "auto", generator: torch.Generator | None = None, progress: bool = False,
             pruner: Any | None = None, group_size: int | None = None) -> RolloutBatch:
    """Sample responses with a sparse KV policy and record the sampler's log-probs.

    Args:
        model: a Hugging Face causal LM (Llama, Qwen2, Qwen3 architectures tested).
        input_ids: prompts; ragged prompts are given with ``attention_mask`` (any padding side).
        attention_mask: ``[B, P]`` 1 for prompt tokens.
        policy: a KV policy (``Dense()``, ``StreamingLLM()``, ``SnapKV()``, ``RKV()``, ``BlockTopK()``).
        budget: KV tokens kept (eviction) or attended (selection) per layer and head; an int, or an
            object with ``budget_at(context_len) -> int | None`` (None = dense at that length).
        max_new_tokens: generation length.
        temperature: sampling temperature; 0 = greedy (log-probs then of the untempered model).
        top_k: sample from the top-k support (log-probs renormalised over it).
        top_p: nucleus sampling (log-probs renormalised over the kept support).
        logprobs_topk: k of the recorded top-k log-probs (Sparrow: 20).
        eos_token_id: stop a row after it samples one of these.
        backend: ``"auto"`` / ``"torch"`` (reference) / ``"flashinfer"``.
        generator: RNG for sampling (seeded runs are reproducible).
        progress: show a progress bar.
        pruner: an ARRoL pruner (``sparsecorr.pruning.Pruner``) deciding at ``pruner.detect_len``.
        group_size: rollouts per prompt (consecutive rows), required with ``pruner``.

    Shapes:
        input_ids, attention_mask: ``[B, P]`` -> a `RolloutBatch` with ``T = max_new_tokens``.
    """
    if pruner is not None and (group_size is None or input_ids.shape[0] % group_size):
        raise ValueError(f"group_size: expected an int dividing B={input_ids.shape[0]} with a pruner, got {group_size!r}")
    if pruner is not None and not 1 <= pruner.window <= pruner.detect_len:
        raise ValueError(f"pruner.window: expected 1 <= window <= detect_len ({pruner.detect_len}), "
                         f"got {pruner.window!r}")
    return _run(model, input_ids, attention_mask, policy=policy, budget=budget,
                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                logprobs_topk=logprobs_topk, eos_token_id=eos_token_id, backend=backend,
                generator=generator, progress=progress, forced=None, forced_mask=None,
                pruner=pruner, group_size=group_size)


def teacher_forced_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, response_ids: torch.Tensor, *,
                            policy: KVPolicy, budget: int | BudgetLike | None,
                            attention_mask: torch.Tensor | None = None,
                            response_mask: torch.Tensor | None = None, temperature: float = 1.0,
                            top_k: int | None = None, top_p: float | None = None,
                            logprobs_topk: int = 20, backend: str = "auto",
                            progress: bool = False, grad: bool = False) -> RolloutBatch:
    """The sparse policy's log-probs (and top-k) of given response tokens, by the same decode
    path with the tokens forced: for the tokens ``generate`` sampled, it reproduces its
    ``rollout_logp``.

    With ``grad=True`` the decode loop runs with autograd on, so ``rollout_logp`` carries the
    gradient of the sparse forward pass (eviction is a gather of the kept K/V, differentiable in
    the kept entries; the kept *set* is not). DistillSparse uses it to train the sparse
    sampler's LoRA adapter on the log-probs of the sparse path itself. Memory grows with the
    response length (the graph of every step is kept).

    Shapes:
        input_ids, attention_mask: ``[B, P]``; response_ids, response_mask: ``[B, T]``.
    """
    if response_ids.dim() != 2 or response_ids.shape[0] != input_ids.shape[0]:
        raise ValueError(f"response_ids: expected [{input_ids.shape[0]}, T], got {tuple(response_ids.shape)}")
    if response_mask is None:
        response_mask = torch.ones_like(response_ids, dtype=torch.bool)
    return _run(model, input_ids, attention_mask, policy=policy, budget=budget,
                max_new_tokens=response_ids.shape[1], temperature=temperature, top_k=top_k,
                top_p=top_p, logprobs_topk=logprobs_topk, eos_token_id=None, backend=backend,
                generator=None, progress=progress, forced=response_ids.cpu(),
                forced_mask=response_mask.bool().cpu(), pruner=None, group_size=None, grad=grad)
