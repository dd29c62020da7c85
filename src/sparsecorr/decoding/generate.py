r"""Sparse decoding over Hugging Face causal LMs: ``generate`` and ``teacher_forced_logprobs``.

Both run on the [`Engine`][sparsecorr.decoding.engine.Engine]: the (ragged) prompts are
right-aligned so row ``b``'s tokens fill KV slots ``[0, len_b)`` of a preallocated pool, fed in
chunks (logits only at each row's last prompt token), then ``generate`` samples one token per
step for every active row and ``teacher_forced_logprobs`` replays given tokens in chunks that
end exactly where a compression event is due, so it reproduces ``generate``'s log-probs with one
forward per chunk. The model's attention is routed through the ``"sparsecorr"`` attention
function; positions are passed explicitly (true positions, so RoPE is right after eviction).
Rows that finish (EOS) or are pruned leave the batch, freeing their compute and KV.
"""

from __future__ import annotations

import time
import traceback
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tqdm.auto import tqdm

from . import graphs
from .backends import select_backend
from .cache import ATTN_NAME, active_cache
from .engine import Engine, backend_features, layer_groups, pool_capacity
from .hf import check_transformers, eval_modules, model_spec, sparse_attention
from .loops import Sampling, decode_loop, forced_loop, prefill
from .memory import check_caps
from .policies import KVPolicy
from .rollout import KeptSets, RolloutBatch, blank_fields, kept_sets
from .runner import ModelRunner
from .scheduled import needs_scheduler, run_scheduled
from .validate import (
    budget_table,
    check_mask,
    check_run_args,
    check_sampling,
    check_token_ids,
    clamp_topk,
    vocab_size,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["BudgetLike", "generate", "teacher_forced_logprobs"]


class BudgetLike(Protocol):
    def budget_at(self, context_len: int) -> int | None: ...


def _prompts(model, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated prompts, right-aligned: ids ``[B, P]`` (padding = 0) and lengths ``[B]`` (CPU)."""
    check_token_ids("input_ids", input_ids, vocab=vocab_size(model), ndim=2,
                    mask=None if attention_mask is None else check_mask("attention_mask", attention_mask,
                                                                         tuple(input_ids.shape)))
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    if attention_mask is None:
        return ids, torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long)
    m = attention_mask.to(device).bool()
    order = (~m).long().argsort(dim=1, stable=True)  # real tokens first, their order kept
    m = m.gather(1, order)
    return torch.where(m, ids.gather(1, order), 0), m.sum(1).cpu()


def _meta(model, policy, budget, samp: Sampling, backend_name: str, **extra) -> dict[str, Any]:
    return {"policy": repr(policy), "backend": backend_name, "dtype": str(next(model.parameters()).dtype),
            "temperature": samp.temperature, "top_k": samp.top_k, "top_p": samp.top_p,
            "budget": budget if isinstance(budget, int) or budget is None else repr(budget),
            "seed": None if samp.generator is None else int(samp.generator.initial_seed()), **extra}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(model, ids, lens, *, policy, budget, max_new_tokens, samp, backend, progress, prefill_chunk,
         eos_token_id=None, pruner=None, group_size=None, forced=None, forced_len=None, chunk_size=None,
         grad=False, cuda_graph=False, fused=False, topk_requested=None, record_keep=False, keep_sets=None) -> RolloutBatch:
    """Decode (or replay ``forced``) the non-empty rows; empty prompts get blank rows."""
    check_transformers()
    spec = model_spec(model)  # refuses an attention variant up front, even for an empty batch
    param = next(model.parameters())
    device = param.device
    b_all, t_max = ids.shape[0], max_new_tokens
    live = (lens > 0).nonzero().squeeze(1)
    back, backend_label = select_backend(backend, device=device, dtype=param.dtype, head_dim=spec.head_dim,
                                         group_size=spec.heads_q // spec.heads_kv, **backend_features(spec))
    budget_table(budget, dense=policy.ignores_budget, longest=0)  # checked even for an empty batch
    base = dict(budget=budget, samp=samp, backend_name=backend_label, prefill_chunk=prefill_chunk,
                logprobs_topk=samp.k, logprobs_topk_requested=topk_requested)
    if live.numel() == 0:
        return RolloutBatch(**blank_fields(b_all, t_max, samp.k, prompt_lengths=lens),
                            meta=_meta(model, policy, **base, prefill_s=0.0, decode_s=0.0, kv_pool_bytes=0))
    ids, lens = ids[live.to(device)], lens[live]
    longest = int(lens.max()) + t_max
    table = budget_table(budget, dense=policy.ignores_budget, longest=longest)
    chunk = prefill_chunk or int(lens.max())
    engine = Engine(model, policy=policy, backend=back, table=table, batch=live.numel(),
                    capacity=pool_capacity(policy, table, longest=longest, chunk=chunk, prompt=int(lens.max())),
                    grad=grad, rows=live,
                    chunk=max(chunk, chunk_size or 1))  # the most tokens a forward feeds (the ring's size)
    engine.kept_events = [] if record_keep else None
    engine.forced_keep = None if keep_sets is None else keep_sets.lookup()
    runner = ModelRunner(engine, cuda_graph=cuda_graph, fused=fused)
    del engine  # the runner owns it
    bar = tqdm(total=t_max, disable=not progress, desc=f"decode {policy.name}")
    try:
        fields, times = _loops(runner, ids, lens, live, chunk=chunk, t_max=t_max, samp=samp,
                               eos_token_id=eos_token_id, pruner=pruner, group_size=group_size, forced=forced,
                               forced_len=forced_len, chunk_size=chunk_size, grad=grad, bar=bar)
        info = _engine_info(runner)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # the loops' frames hold pool tensors: drop them
        raise
    finally:
        runner.close()  # the pool, graphs and plans go now, on every path (no collector needed)
        del runner  # a traceback keeps this frame: it must not keep the runner either
        bar.close()
    out = blank_fields(b_all, t_max, samp.k, prompt_lengths=torch.zeros(b_all, dtype=torch.long))
    for name, value in fields.items():
        if name == "finish_reason":
            reasons = list(out[name])
            for i, r in zip(live.tolist(), value):
                reasons[i] = r
            out[name] = tuple(reasons)
        else:
            out[name] = out[name].index_put((live,), value.cpu())
    out["prompt_lengths"] = out["prompt_lengths"].index_put((live,), lens)
    out["peak_kv_bytes"] = info.pop("peak_kv_bytes")
    return RolloutBatch(**out, kept_sets=info.pop("kept_sets"), meta=_meta(model, policy, **base, **times, **info))


def _loops(runner, ids, lens, live, *, chunk, t_max, samp, eos_token_id, pruner, group_size, forced,
           forced_len, chunk_size, grad, bar) -> tuple[dict, dict]:
    """Prefill, then the decode or teacher-forcing loop; the fields and the wall times."""
    engine = runner.engine
    device = engine.device
    with eval_modules(engine.model), sparse_attention(engine.model, ATTN_NAME), active_cache(engine.cache), \
            torch.set_grad_enabled(grad):
        t0 = time.perf_counter()
        logits = prefill(engine, ids, lens, chunk)
        _sync(device)
        t1 = time.perf_counter()
        if forced is None:
            fields = decode_loop(runner, logits, prompt_len=lens, steps=t_max, samp=samp, eos=eos_token_id,
                                 pruner=pruner, group_size=group_size, bar=bar)
        else:
            fields = forced_loop(engine, logits, forced[live.to(device)], forced_len[live], prompt_len=lens,
                                 chunk=chunk_size, samp=samp, bar=bar)
        _sync(device)
        t2 = time.perf_counter()
    return fields, {"prefill_s": t1 - t0, "decode_s": t2 - t1}


def _engine_info(runner) -> dict:
    """What ``meta`` records about the runner's engine and graphs (read before they are closed)."""
    engine = runner.engine
    return {"peak_kv_bytes": engine.peak_kv_bytes, **layer_groups(engine),
            "kv_pool_bytes": engine.cache.allocated_bytes(), **graphs.graph_meta(runner.graphs),
            "kept_sets": None if engine.kept_events is None else
            kept_sets(engine.kept_events, layers=engine.spec.layers, heads=engine.heads_kv)}


def generate(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
             policy: KVPolicy, budget: int | BudgetLike | None, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             logprobs_topk: int = 20, eos_token_id: int | list[int] | None = None,
             backend: str = "auto", generator: torch.Generator | None = None, progress: bool = False,
             pruner: Any | None = None, group_size: int | None = None,
             prefill_chunk: int | None = 512, cuda_graph: bool = False, fused: bool | None = None,
             record_keep: bool = False, max_num_seqs: int | None = None,
             max_kv_bytes: int | None = None) -> RolloutBatch:
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
        top_k: sample from the top-k support (log-probs renormalised over it); None = off.
        top_p: nucleus sampling in (0, 1] (log-probs renormalised over the kept support).
        logprobs_topk: k of the recorded top-k log-probs (Sparrow: 20; 0 = none). A k above the
            vocabulary size V is clamped to V (the top-V holds the whole distribution):
            ``topk_logp`` then has V columns, and ``meta["logprobs_topk"]`` records the k used,
            ``meta["logprobs_topk_requested"]`` the k asked for.
        eos_token_id: stop a row after it samples one of these.
        backend: ``"auto"`` (FlashInfer on CUDA when installed and its kernels support the
            model's head_dim and dtype, else ``"torch"``, with the reason in ``meta["backend"]``), ``"torch"``
            (SDPA in the model's dtype), ``"reference"`` (float32 oracle), ``"flashinfer"``, or a
            backend object.
        generator: RNG for sampling (seeded runs are reproducible).
        progress: show a progress bar.
        pruner: an ARRoL pruner (``sparsecorr.pruning.Pruner``) deciding at ``pruner.detect_len``.
        group_size: rollouts per prompt (consecutive rows), required with ``pruner``; when
            given, an int (not a bool) dividing ``B``.
        prefill_chunk: prompt tokens per prefill forward (None = the whole prompt at once).
            Eviction policies compress between chunks, so their cache never exceeds
            ``budget + buffer + prefill_chunk`` slots; with one chunk the prompt is compressed
            once, after it is read. ``RKV(variant="sparse_rl")`` keeps the whole prompt instead
            (``compress_in_prefill`` False): its pool holds ``max(longest prompt + 1, budget +
            buffer + prefill_chunk)`` slots per row, at most the context.
        cuda_graph: replay each single-token decode step as a CUDA graph (CUDA only, no pruner;
            see [`sparsecorr.decoding.graphs`][sparsecorr.decoding.graphs]). A model on another
            device is refused with a ValueError (there is no CPU fallback). Falls back to eager
            steps, with a warning, if capture fails on CUDA; ``meta["cuda_graph"]`` records which ran:
            ``"on"``, ``"failed: <error>"``, ``"unused"`` (asked for, but no decode step ran)
            or ``"off"``; ``meta["fused"]`` likewise for the fused step (a fused step that failed
            for this model in its current state is not attempted again: the same
            ``"failed: <error>"``, no second warning; see `sparsecorr.decoding.fused`).
        record_keep: record the kept set of every compression event on
            ``RolloutBatch.kept_sets`` (eviction policies; a debugging and parity tool: one
            device-to-host copy of the kept positions per event). ``teacher_forced_logprobs(...,
            keep_sets=batch.kept_sets)`` replays them.
        max_num_seqs: most rows decoded at once (None: no cap). With ``max_kv_bytes`` or on
            CUDA (where 0.9 × the free memory bounds the pool), the memory plan
            (`sparsecorr.decoding.memory`) is made first: when it fits fewer rows than the
            batch, the batch runs through the continuous-batching
            [`Scheduler`][sparsecorr.decoding.scheduler.Scheduler] (rows admitted as others
            finish; the same fields, rows in input order; greedy outputs equal) instead of
            failing with out-of-memory; otherwise the one-pool path runs as without it. The
            scheduler path refuses ``pruner`` and ``record_keep`` (ValueError), and records
            ``meta["scheduler"]`` (rows, what bounded them, rows resident at most).
        max_kv_bytes: bytes the KV pool and the policy's state may take (None: no cap).

    The model runs in eval mode for the call (a decoder layer with gradient checkpointing
    active in train mode would drop the cache) and each module's ``training`` flag is restored
    afterwards; its hooks and checkpointing flags are not touched.

    The call holds nothing after it returns: the KV pool, the captured graphs and the backend's
    plans are released when it returns or raises (no reference cycle, so no wait for Python's
    cycle collector); the returned batch holds host tensors only.

    Returns:
        A [`RolloutBatch`][sparsecorr.decoding.RolloutBatch]. ``B = 0`` gives an empty batch;
        rows without a prompt token get ``lengths = 0``, an all-False mask and finish reason
        ``"empty"``.

    Shapes:
        input_ids, attention_mask: ``[B, P]`` -> a `RolloutBatch` with ``T = max_new_tokens``.
    """
    check_run_args(policy=policy, max_new_tokens=max_new_tokens, logprobs_topk=logprobs_topk,
                   eos_token_id=eos_token_id, prefill_chunk=prefill_chunk)
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    if pruner is not None or group_size is not None:  # a group size given is checked, bools refused
        n = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) else None
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1 \
                or n is None or n % group_size:
            raise ValueError(f"group_size: expected an int dividing B={n} (required with a pruner), "
                             f"got {group_size!r}")
    if pruner is not None:
        if not 1 <= pruner.window <= pruner.detect_len:
            raise ValueError(f"pruner.window: expected 1 <= window <= detect_len ({pruner.detect_len}), "
                             f"got {pruner.window!r}")
    if cuda_graph not in (True, False):
        raise ValueError(f"cuda_graph: expected a bool, got {cuda_graph!r}")
    if cuda_graph and pruner is not None:
        raise ValueError("cuda_graph: needs no pruner (the pruner reads hidden states the captured step "
                         "does not return), got a pruner with cuda_graph=True")
    if fused is not None and not isinstance(fused, bool):
        raise ValueError(f"fused: expected None (on with cuda_graph), True or False, got {fused!r}")
    if fused and not cuda_graph:
        raise ValueError("fused: True compiles the captured decode step, so it needs cuda_graph=True; "
                         "got fused=True with cuda_graph=False")
    if cuda_graph:
        graphs.check_graph_device(next(model.parameters()).device)
    ids, lens = _prompts(model, input_ids, attention_mask)
    if pruner is not None and bool((lens == 0).any()):
        raise ValueError("attention_mask: every row needs a prompt token when a pruner keeps groups")
    _check_keep_args(record_keep, None)
    samp = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, k=clamp_topk(model, logprobs_topk),
                    generator=generator)
    check_caps(max_num_seqs=max_num_seqs, max_kv_bytes=max_kv_bytes)
    if needs_scheduler(model, lens, policy=policy, budget=budget, max_new_tokens=max_new_tokens,
                       prefill_chunk=prefill_chunk, max_num_seqs=max_num_seqs, max_kv_bytes=max_kv_bytes):
        if pruner is not None or record_keep:
            raise ValueError("max_num_seqs / max_kv_bytes: the batch does not fit the memory plan, and the "
                             "scheduler that admits its rows takes no pruner and no record_keep; got "
                             f"pruner={type(pruner).__name__}, record_keep={record_keep}")
        fields, info = run_scheduled(model, ids, lens, policy=policy, budget=budget, max_new_tokens=max_new_tokens,
                                     samp=samp, backend=backend, prefill_chunk=prefill_chunk,
                                     eos_token_id=eos_token_id, cuda_graph=cuda_graph,
                                     fused=cuda_graph if fused is None else fused, max_num_seqs=max_num_seqs,
                                     max_kv_bytes=max_kv_bytes)
        return RolloutBatch(**fields, meta=_meta(model, policy, budget, samp, info.pop("backend"),
                                                 prefill_chunk=prefill_chunk, logprobs_topk=samp.k,
                                                 logprobs_topk_requested=logprobs_topk, **info))
    return _run(model, ids, lens, policy=policy, budget=budget, max_new_tokens=max_new_tokens, samp=samp,
                backend=backend, progress=progress, prefill_chunk=prefill_chunk,
                eos_token_id=eos_token_id, pruner=pruner, group_size=group_size, cuda_graph=cuda_graph,
                fused=cuda_graph if fused is None else fused, topk_requested=logprobs_topk, record_keep=record_keep)


def _check_keep_args(record_keep: object, keep_sets: object) -> None:
    if not isinstance(record_keep, bool):
        raise ValueError(f"record_keep: expected a bool, got {record_keep!r}")
    if keep_sets is not None and not isinstance(keep_sets, KeptSets):
        raise ValueError(f"keep_sets: expected a KeptSets (RolloutBatch.kept_sets of a generate call with "
                         f"record_keep=True) or None, got {type(keep_sets).__name__}")


def teacher_forced_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, response_ids: torch.Tensor, *,
                            policy: KVPolicy, budget: int | BudgetLike | None,
                            attention_mask: torch.Tensor | None = None,
                            response_mask: torch.Tensor | None = None, temperature: float = 1.0,
                            top_k: int | None = None, top_p: float | None = None,
                            logprobs_topk: int = 20, backend: str = "auto",
                            progress: bool = False, grad: bool = False,
                            prefill_chunk: int | None = 512, chunk_size: int = 256,
                            record_keep: bool = False, keep_sets: KeptSets | None = None) -> RolloutBatch:
    """The sparse policy's log-probs (and top-k) of given response tokens: for the tokens
    ``generate`` sampled (same policy, budget, sampling settings and ``prefill_chunk``), it
    reproduces its ``rollout_logp``.

    The response is replayed in chunks of up to ``chunk_size`` tokens, one forward each; a chunk
    ends where some row's cache reaches ``budget + buffer``, and the compression runs there, so
    every token sees the kept set it saw when it was decoded (a dense policy replays the whole
    response in ``T / chunk_size`` forwards; an eviction policy in about ``T / (buffer + 1)``).
    A row's response ends at the first False of ``response_mask``.

    With ``grad=True`` autograd is on, so ``rollout_logp`` carries the gradient of the sparse
    forward pass (eviction is a gather of the kept K/V, differentiable in the kept entries; the
    kept *set* is not). DistillSparse uses it to train the sparse sampler's LoRA adapter on the
    log-probs of the sparse path itself. Memory grows with the number of chunks (each keeps its
    graph).

    ``logprobs_topk`` above the vocabulary size is clamped to it, as in ``generate``.

    ``keep_sets`` (``generate(..., record_keep=True).kept_sets``) forces the decode's kept sets
    at every compression instead of recomputing them, so the replay differs from the decode
    only by numerics (an eviction policy's top-k flips near-tied scores between a bf16 decode and
    a float32 replay); ``record_keep`` records the replay's own, for
    `KeptSets.agreement`. Like ``generate``, the call holds nothing after it returns (with
    ``grad=True``, only what autograd saved for the backward of the returned log-probs).

    Shapes:
        input_ids, attention_mask: ``[B, P]``; response_ids, response_mask: ``[B, T]``.
    """
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    _check_keep_args(record_keep, keep_sets)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
    b = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else None
    if not isinstance(response_ids, torch.Tensor) or response_ids.dim() != 2 or response_ids.shape[0] != b:
        raise ValueError(f"response_ids: expected [{b}, T], got "
                         f"{tuple(response_ids.shape) if isinstance(response_ids, torch.Tensor) else response_ids!r}")
    rmask = torch.ones_like(response_ids, dtype=torch.bool) if response_mask is None else \
        check_mask("response_mask", response_mask, tuple(response_ids.shape))
    rmask = rmask.cpu()
    check_token_ids("response_ids", response_ids, vocab=vocab_size(model), mask=rmask)
    t_max = response_ids.shape[1]
    check_run_args(policy=policy, max_new_tokens=max(t_max, 1), logprobs_topk=logprobs_topk,
                   eos_token_id=None, prefill_chunk=prefill_chunk)
    ids, lens = _prompts(model, input_ids, attention_mask)
    forced_len = rmask.long().cumprod(1).sum(1)  # up to the first False
    samp = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, k=clamp_topk(model, logprobs_topk),
                    generator=None)
    forced = torch.where(rmask.to(ids.device), response_ids.to(ids.device), 0)
    # a row with no response token to score is skipped (blank row, finish reason "empty")
    return _run(model, ids, torch.where(forced_len > 0, lens, 0), policy=policy, budget=budget, max_new_tokens=t_max, samp=samp, backend=backend,
                progress=progress, prefill_chunk=prefill_chunk, forced=forced, forced_len=forced_len,
                chunk_size=chunk_size, grad=grad, topk_requested=logprobs_topk, record_keep=record_keep,
                keep_sets=keep_sets)
