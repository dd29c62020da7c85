r"""``generate``'s batch through the [`Scheduler`][sparsecorr.decoding.scheduler.Scheduler] when
the memory plan fits fewer rows than the batch: admission instead of an out-of-memory error.

`needs_scheduler` decides (only where a cap is given or the device is CUDA: a CPU call without
``max_num_seqs`` / ``max_kv_bytes`` runs today's one-pool path, unchanged); `run_scheduled`
serves the batch's non-empty rows as requests of the call's settings and assembles their outputs
into ``RolloutBatch`` fields, rows in input order. The scheduler's pool is sized for the same
longest context and prefill chunk as the one-pool path, so its budget table, capacity and kept
sets are the same; greedy outputs equal, log-probs up to the float rounding of another batch
shape.
"""

from __future__ import annotations

import time

import torch

from .graphs import graph_meta
from .memory import plan_for
from .policies import KVPolicy
from .rollout import blank_fields
from .scheduler import RequestParams, Scheduler

__all__ = ["needs_scheduler", "run_scheduled"]


def needs_scheduler(model, lens: torch.Tensor, *, policy: KVPolicy, budget, max_new_tokens: int,
                    prefill_chunk: int | None, max_num_seqs: int | None, max_kv_bytes: int | None) -> bool:
    """Whether the memory plan fits fewer rows than the batch's non-empty prompts (one pool of
    ``B`` rows, no pristine row, as ``generate`` allocates)."""
    device = next(model.parameters()).device
    n = int((lens > 0).sum())
    if n == 0 or (max_num_seqs is None and max_kv_bytes is None and device.type != "cuda"):
        return False
    try:
        _, plan = plan_for(model, policy, budget, longest=int(lens.max()) + max_new_tokens,
                           chunk=prefill_chunk or int(lens.max()), max_num_seqs=max_num_seqs,
                           max_kv_bytes=max_kv_bytes, extra_rows=0)
    except ValueError:
        return True  # not one row without the pristine row either: the scheduler says so by name
    return plan.rows < n


def run_scheduled(model, ids: torch.Tensor, lens: torch.Tensor, *, policy: KVPolicy, budget, max_new_tokens: int,
                  samp, backend, prefill_chunk: int | None, eos_token_id, cuda_graph: bool, fused: bool,
                  max_num_seqs: int | None, max_kv_bytes: int | None) -> tuple[dict, dict]:
    """Serve the non-empty rows of ``ids`` ``[B, P]`` (right-aligned, ``lens`` ``[B]``) through one
    scheduler; returns the ``RolloutBatch`` fields and what ``meta`` records. A step's error is
    raised (the call fails as the one-pool path would)."""
    b, t_max, k = ids.shape[0], max_new_tokens, samp.k
    live = (lens > 0).nonzero().squeeze(1).tolist()
    longest = int(lens.max()) + t_max
    sched = Scheduler(model, policy=policy, budget=budget, max_model_len=longest, backend=backend,
                      cuda_graph=cuda_graph, fused=fused, prefill_chunk=prefill_chunk or int(lens.max()),
                      max_num_seqs=max_num_seqs, max_kv_bytes=max_kv_bytes, eos_token_id=eos_token_id,
                      generator=samp.generator)
    params = RequestParams(max_tokens=t_max, temperature=samp.temperature, top_k=samp.top_k, top_p=samp.top_p,
                           logprobs=k)
    outs = {}
    t0 = time.perf_counter()
    try:
        host = ids.cpu()
        for i in live:
            sched.add_request(str(i), host[i, :int(lens[i])], params)
        while sched.has_unfinished():
            for o in sched.step():
                if o.error is not None:
                    raise o.error
                outs[int(o.request_id)] = o
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)
        info = {"prefill_s": 0.0, "decode_s": time.perf_counter() - t0,
                "kv_pool_bytes": sched.pool_bytes,
                **graph_meta(None if sched.runner is None else sched.runner.graphs),
                "scheduler": {"rows": sched.plan.rows, "source": sched.plan.source,
                              "max_resident": sched.max_resident}}
        peak, label, groups = sched.peak_kv_bytes, sched.backend_label, dict(sched.kv_groups)
    finally:
        sched.close()
    out = blank_fields(b, t_max, k, prompt_lengths=lens)
    reasons = list(out["finish_reason"])
    table = sched.table
    for i, o in outs.items():
        n = len(o.token_ids)
        out["tokens"][i, :n] = torch.tensor(o.token_ids, dtype=torch.long)
        out["mask"][i, :n] = True
        out["lengths"][i] = n
        out["rollout_logp"][i, :n] = o.logprobs
        if k:
            out["topk_logp"][i, :n], out["topk_ids"][i, :n] = o.topk_logp, o.topk_ids
        out["budget"][i, :n] = table[(int(lens[i]) + torch.arange(n)).clamp(max=table.numel() - 1)]
        out["kv_kept"][i, :n] = torch.tensor(o.kv_kept)
        reasons[i] = o.finish_reason
    out["finish_reason"] = tuple(reasons)
    out["peak_kv_bytes"] = peak
    return out, {**info, **groups, "backend": label}
