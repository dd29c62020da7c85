r"""The decoding engine: feeds chunks of tokens through the model into the KV pool.

One primitive serves the prefill, the decode steps and teacher forcing: ``feed`` writes a
``[B, Q]`` chunk (row ``b`` has ``real_b`` real tokens, the rest padding) at each row's next
free slots and runs one forward; ``compress_due`` then evicts the rows whose cache exceeds
``budget + buffer`` (host-side bookkeeping: every row's slot count and context length live on
the host, so no decision syncs the device). The per-context budget is a table looked up, not a
schedule called per step.

- **Prefill** feeds the prompt in chunks of ``prefill_chunk`` tokens and compresses between
  chunks, so an eviction policy's cache never holds more than ``budget + buffer +
  prefill_chunk`` slots; logits are computed only at each row's last prompt token. A policy
  with ``compress_in_prefill`` False (``RKV(variant="sparse_rl")``) keeps the whole prompt: its
  first compression is the first decode step past ``budget + buffer``.
- **Decode** feeds one token per row.
- **Teacher forcing** feeds the forced tokens in chunks that end exactly where some row's next
  compression is due (``tokens_until_compress``), so the kept set seen by every token is the one
  the one-token-per-step loop sees, with one forward per chunk instead of per token.

A model with sliding-window layers (Gemma 2/3, GPT-OSS, EXAONE 4, Mistral / Qwen2 with a window)
keeps them in a ring of ``window + chunk - 1`` slots beside the full layers' pool; the policy
runs on the full layers only (see `Engine`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.attention.bias import causal_lower_right

from .backends import AttentionBackend, check_backend
from .cache import SparseKVCache, Step
from .graphs import CaptureSpec
from .hf import forward, model_spec
from .policies import KVPolicy
from .policies.base import row_capacity
from .policies.state import PlanInputs
from .pool import KVPool, WindowRing, ring_slots

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Engine", "backend_features", "layer_groups", "pool_capacity"]


def pool_capacity(policy: KVPolicy, table: torch.Tensor, *, longest: int, chunk: int,
                  prompt: int | None = None) -> int:
    """Most slots a row can hold (the policy answers, `KVPolicy.capacity`; with the whole prompt
    of ``prompt`` tokens where the policy keeps it through the prefill:
    `sparsecorr.decoding.policies.base.row_capacity`)."""
    return row_capacity(policy, table, longest=longest, chunk=chunk, prompt=prompt)


def backend_features(spec) -> dict:
    """What `sparsecorr.decoding.backends.select_backend` must know of a model's attention
    beyond its shape: ``sinks`` / ``softcap`` where the model has them (nothing otherwise)."""
    out = {}
    if spec.sinks:
        out["sinks"] = True
    if spec.softcap is not None:
        out["softcap"] = spec.softcap
    return out


def layer_groups(engine: Engine) -> dict:
    """``meta`` entries of a model with sliding-window layers (none otherwise): ``kv_layers``
    (full and sliding layer counts, the window, the ring's slots, whether the policy ran: not
    when every layer slides) and ``peak_kv`` (the full and sliding layers' bytes of the forward
    that read the most; their sum is ``peak_kv_bytes``)."""
    spec = engine.spec
    if not spec.sliding:
        return {}
    full, sliding = engine.peak_kv
    return {"kv_layers": {"full": len(spec.full), "sliding": len(spec.sliding), "window": spec.window,
                          "ring_slots": engine.ring.slots,
                          "policy": "on the full layers" if spec.full else "none: every layer slides (dense)"},
            "peak_kv": {"full_bytes": full, "sliding_bytes": sliding}}


class Engine:
    """Model + KV pool + host bookkeeping for one ``generate`` / teacher-forcing call.

    Args:
        model: the Hugging Face causal LM (its attention routed to ``"sparsecorr"``).
        policy: the KV policy.
        backend: the attention backend.
        table: budget by context length (``table[c]``, -1 = dense), CPU long.
        batch: rows.
        capacity: slots per row to allocate (see `pool_capacity`).
        grad: autograd on (every pool update out of place).
        rows: the caller's row index of each engine row (CPU long ``[batch]``; default
            ``arange``), kept through `select_rows` (kept-set records are keyed by it).
        chunk: the most tokens one forward feeds a row (prefill chunk, teacher-forcing chunk);
            sizes a sliding-window model's ring (`sparsecorr.decoding.pool.ring_slots`; None: a
            ring as long as the context, which never wraps).

    **Layer kinds** (`sparsecorr.decoding.hf.ModelSpec`): the full-attention layers live in the
    pool and run the policy (its state sees pool layer indices ``0 .. L_full - 1``); the
    sliding-window layers live in a `WindowRing` of ``min(window + chunk - 1, longest)`` slots
    and attend their window, as the model's own attention does. A model whose layers all slide
    has nothing for a policy to bound (the window does): the engine runs the base `KVPolicy`
    (dense, no state) on it, over an empty pool.

    The engine owns the pool and the backend's per-call state (the CUDA graphs are the model
    runner's: `sparsecorr.decoding.runner.ModelRunner`); `close` drops them (``generate`` calls
    it in a ``finally``), and no reference cycle runs through it, so dropping the engine frees
    them at once.
    """

    def __init__(self, model: PreTrainedModel, *, policy: KVPolicy, backend: AttentionBackend, table: torch.Tensor,
                 batch: int, capacity: int, grad: bool,
                 rows: torch.Tensor | None = None, chunk: int | None = None) -> None:
        self.spec = spec = model_spec(model)  # refuses attention variants it would get wrong
        if not spec.full:  # every layer slides: the window bounds the cache, no policy runs
            policy, capacity = KVPolicy(), table.numel()  # the base policy: dense, no state
        self.model, self.policy, self.table = model, policy, table
        self.n_layers, self.heads_q, self.heads_kv = len(spec.full), spec.heads_q, spec.heads_kv
        self.head_dim = spec.head_dim
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.pool = KVPool(layers=self.n_layers, batch=batch, kv_heads=self.heads_kv, head_dim=self.head_dim,
                           capacity=capacity, page_size=policy.pool_page_size, dtype=self.dtype,
                           device=self.device, positions=policy.tracks_positions, grad=grad)
        self.ring = None
        if spec.sliding:
            longest = max(table.numel() - 1, 1)
            slots = ring_slots(spec.window, chunk=longest if chunk is None else chunk, longest=longest)
            self.ring = WindowRing(layers=len(spec.sliding), batch=batch, kv_heads=self.heads_kv,
                                   head_dim=self.head_dim, window=spec.window, slots=slots, dtype=self.dtype,
                                   device=self.device, grad=grad)
        state = policy.new_state(self.pool, q_heads=self.heads_q, table=table)
        self.cache = SparseKVCache(self.pool, policy=policy, state=state, backend=check_backend(backend), ring=self.ring,
                                   sliding=spec.sliding, softcap=spec.softcap, sinks=spec.sinks)
        self.count = torch.zeros(batch, dtype=torch.long)  # valid slots per row (host)
        self.ctx = torch.zeros(batch, dtype=torch.long)  # tokens fed per row (host)
        self.peak_slots = 0  # max over forwards of rows x full-layer slots read
        self.peak_kv = (0, 0)  # (full, sliding) bytes read by the forward that read the most
        self.rows = torch.arange(batch) if rows is None else rows  # the caller's row of each engine row
        self.kept_events: list | None = None  # set to [] to record every compression's kept sets
        self.forced_keep: dict | None = None  # {(row, context): positions [L, H, K]}: replay these
        # what a captured step needs, and nothing of the engine: no cycle through it to collect
        self.capture = CaptureSpec(model=model, cache=self.cache, device=self.device, heads_kv=self.heads_kv,
                                   group=self.heads_q // self.heads_kv, head_dim=self.head_dim)

    # -- host-side plans -----------------------------------------------------------------
    def budget_at(self, ctx: torch.Tensor) -> torch.Tensor:
        return self.table[ctx.clamp(max=self.table.numel() - 1)]

    def tokens_until_compress(self, cap: int) -> int:
        """Largest n <= cap such that feeding n tokens to every row triggers no compression
        before the n-th (the n-th may trigger one)."""
        if cap <= 1:
            return max(cap, 1)
        n = torch.arange(1, cap + 1)
        hit = self.policy.due(self.count[:, None] + n, self.ctx[:, None] + n, budget_at=self.budget_at)
        if hit is None:  # the policy never compresses
            return cap
        due = hit[0]
        first = torch.where(due.any(1), due.float().argmax(1) + 1, cap)
        return int(first.min())

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        """Host bookkeeping to the device without a stream sync (the host copy is staged first)."""
        return t.to(self.device, non_blocking=True)

    def plan(self, q_len: int, real: torch.Tensor, *, decode: bool, static: bool = False) -> Step:
        """The one plan of a forward over a ``[B, Q]`` chunk (row ``b``: ``real_b`` real tokens,
        then padding, which is written to the scratch page), on the host: write slots, positions,
        the mask, the policy's part (`PolicyState.plan`, `derive`) and a paged step's table plan.

        ``static``: a CUDA graph's step, at its fixed sizes (every slot of the pool read, the
        policy's static page count); its tensors stay on the host for the graph runner to copy
        into its static twin, and the mask and the policy's device work are made inside the graph.
        """
        state = self.cache.state
        i = torch.arange(q_len)
        slots = torch.where(i < real[:, None], self.count[:, None] + i, self.pool.scratch)
        to_dev = (lambda t: t) if static else self._dev
        part = state.plan(PlanInputs(count=self.count, ctx=self.ctx, real=real, slots=slots, offsets=i, q_len=q_len,
                                     decode=decode, static=static, budget_at=self.budget_at, to_dev=to_dev))
        # a paged kernel has no backward: a grad-enabled forward stays on the autograd path
        paged = (self.cache.backend.paged and q_len == 1 and decode
                 and not torch.is_grad_enabled() and self.n_layers > 0)
        needed = int((self.count + real).max())  # host ints, every path (a graph step reads kv_len = capacity)
        if needed > self.pool.capacity:  # a policy whose capacity() is too small: refused before any write
            self.cache.capacity_error(needed, "a forward")
        kv_len = self.pool.capacity if static else needed
        counts = to_dev(self.count)
        ring = {}
        if self.ring is not None:
            self._check_ring(q_len)
            ring_slots_, ring_pos = self.ring.plan(self.ctx, real, i)
            ring = dict(ring_slots=to_dev(ring_slots_), ring_pos=to_dev(ring_pos))
        page_plan = None
        if paged:  # one table plan per step, shared by every layer
            keep, k = state.page_selection(part)
            page_plan = dict(lengths=self.count + 1, keep=keep, k=k, heads=self.heads_kv,
                             group=self.heads_q // self.heads_kv, head_dim=self.head_dim,
                             pages_per_row=self.pool.pages_per_row, page_size=self.pool.page_size,
                             dtype=self.dtype, scale=self.spec.scaling, device=self.device)
        mask = None
        if not static:
            uniform = q_len == 1 and bool((self.count + 1 == kv_len).all())
            # full rows at one count: plain causal attention aligned to the end (SDPA, no mask tensor)
            aligned = (q_len > 1 and bool((real == q_len).all() and (self.count + q_len == kv_len).all())
                       and not state.needs_mask(decode))
            dev = self.device
            mask = None if uniform else causal_lower_right(q_len, kv_len) if aligned else (
                torch.arange(kv_len, device=dev) <= (counts[:, None] + torch.arange(q_len, device=dev))[:, :, None]
            )[:, None]
            state.derive(part)
        return Step(q_len=q_len, kv_len=kv_len, slots=to_dev(slots), positions=to_dev(self.ctx[:, None] + i),
                    counts=counts, mask=mask, paged=paged, part=part, page_plan=page_plan, **ring)

    def _check_ring(self, q_len: int) -> None:
        """A forward of ``q_len`` tokens must fit the ring (`ring_slots`): host ints, before any write."""
        ring, longest = self.ring, self.table.numel() - 1
        if ring.slots < longest and q_len > ring.slots - ring.window + 1:
            raise ValueError(f"chunk: expected at most {ring.slots - ring.window + 1} tokens per forward (the "
                             f"sliding layers' ring of {ring.slots} slots for a window of {ring.window} was "
                             f"sized for it), got a forward of {q_len}; pass Engine(chunk=) the largest chunk")

    def _peak(self, b: int, real: torch.Tensor) -> None:
        """Track the KV bytes a forward reads (rows x slots, every layer): the full layers' slots
        before it plus its tokens, and the sliding layers' window union ``min(ctx + q, W + q - 1)``
        per row (a chunk's queries read ``W - 1`` positions before their first token)."""
        full = b * int((self.count + real).max()) * self.pool.slot_bytes()
        self.peak_slots = max(self.peak_slots, b * int((self.count + real).max()))
        sliding = 0
        if self.ring is not None:
            ring = self.ring
            read = torch.where(real > 0, torch.minimum(self.ctx + real, ring.window + real - 1), 0)
            sliding = b * int(read.max()) * ring.slot_bytes()
        if full + sliding > sum(self.peak_kv):
            self.peak_kv = (full, sliding)

    @property
    def peak_kv_bytes(self) -> int:
        """The most KV bytes one forward read, full and sliding layers together (`peak_kv`)."""
        return sum(self.peak_kv)

    # -- device work ---------------------------------------------------------------------------
    def feed(self, ids: torch.Tensor, real: torch.Tensor, *, decode: bool, logits_to_keep,
             hidden: bool = False):
        """One eager forward over a ``[B, Q]`` chunk; returns the model output (a CUDA-graph
        decode step is the model runner's: `sparsecorr.decoding.runner.ModelRunner`).

        Shapes:
            ids ``[B, Q]`` (device); real ``[B]`` (CPU) real tokens per row (a prefix).
        """
        st = self.plan(ids.shape[1], real, decode=decode)
        if st.page_plan is not None:
            self.cache.backend.begin_step(**st.page_plan)
        self.cache.step = st
        out = forward(self.model, input_ids=ids, position_ids=st.positions, cache=self.cache,
                      logits_to_keep=logits_to_keep, output_hidden_states=hidden)
        self.advance(ids.shape[0], real)
        return out

    def advance(self, b: int, real: torch.Tensor) -> None:
        """The host bookkeeping after a forward of ``b`` rows fed ``real`` (CPU ``[b]``) tokens
        each: the peak KV read (`_peak`), then every row's slot count and context length."""
        self._peak(b, real)
        self.count += real
        self.ctx += real

    def compress_due(self, *, prefill: bool = False) -> None:
        """Evict the rows whose cache exceeds what the policy allows at their context length
        (`KVPolicy.due`: ``budget + buffer`` for an eviction policy; never for the others).
        ``prefill``: called between prefill chunks, where a policy with ``compress_in_prefill``
        False (Sparse-RL's ``RKV``) keeps every prompt token: nothing is evicted."""
        if prefill and not self.policy.compress_in_prefill:
            return
        hit = self.policy.due(self.count, self.ctx, budget_at=self.budget_at)
        if hit is None:  # the policy never compresses
            return
        due, budget = hit
        if not bool(due.any()):
            return
        eff = torch.where(due, budget, self.count)
        forced = None if self.forced_keep is None else self._forced(due)
        kept = self.cache.compress(eff, self.count, self.ctx, forced=forced, due=self._dev(due),
                                   record=self.kept_events is not None)
        if kept is not None:  # the due rows' kept positions, keyed by (caller's row, context)
            at = due.nonzero().squeeze(1)
            kept = kept[self._dev(at)]
            if self.ring is not None:
                kept = self._with_windows(kept, at)
            self.kept_events.append((self.rows[due], self.ctx[due], kept))
        self.count = torch.minimum(self.count, eff)

    def _with_windows(self, kept: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Every model layer's kept positions at an event: the full layers' ``kept`` and, for a
        sliding layer, the positions its ring holds inside the window of the last fed token
        (``ctx - W <= p < ctx``; read from the ring, so a test sees what it holds).

        Shapes:
            kept ``[n, L_full, H_kv, K]``; at ``[n]`` (CPU, engine rows) -> ``[n, L, H_kv, K']``."""
        ring, spec = self.ring, self.spec
        pos = ring.pos[self._dev(at)]
        inside = pos >= self._dev(self.ctx[at] - ring.window)[:, None]
        win = torch.where(inside, pos, torch.iinfo(torch.long).max).sort(-1).values[:, :ring.window]
        win = torch.where(win == torch.iinfo(torch.long).max, -1, win)
        width = max(kept.shape[-1], win.shape[-1])
        out = kept.new_full((kept.shape[0], spec.layers, kept.shape[2], width), -1)
        out[:, list(spec.full), :, :kept.shape[-1]] = kept
        out[:, list(spec.sliding), :, :win.shape[-1]] = win[:, None, None, :]
        return out

    def _forced(self, due: torch.Tensor) -> torch.Tensor:
        """The recorded kept positions of the due rows at their context (``[B, L, H, K]``)."""
        table = self.forced_keep
        rows = []
        for r, c, d in zip(self.rows.tolist(), self.ctx.tolist(), due.tolist()):
            if d and (r, c) not in table:
                raise ValueError(f"keep_sets: no kept set recorded for row {r} at context length {c} (the "
                                 "replay must use the decode's prompts, tokens, policy, budget and prefill_chunk)")
            rows.append(table[(r, c)] if d else None)
        if self.ring is not None:  # sets recorded for every layer: the policy's are the full layers'
            rows = [None if t is None else t[list(self.spec.full)] for t in rows]
        shape = next(t for t in rows if t is not None).shape
        blank = torch.full(shape, -1, dtype=torch.long)
        return self._dev(torch.stack([blank if t is None else t for t in rows]))

    def select_rows(self, keep: torch.Tensor) -> torch.Tensor:
        """Keep the rows where ``keep`` (CPU bool ``[B]``) is True; returns their indices."""
        rows = keep.nonzero().squeeze(1)
        self.take_rows(rows)
        return rows

    def take_rows(self, index: torch.Tensor) -> None:
        """Rows ``index`` (CPU long ``[B']``, duplicates allowed) of the pool, of the policy's
        state (`PolicyState.select_rows`) and of the host bookkeeping, in place where ``B' <= B``
        (`sparsecorr.decoding.pool.take_rows`). The scheduler resets a row by taking a never-fed
        row into it (``index = [0, 1, P, 3, ...]``), so no policy needs a reset hook."""
        on_dev = index.to(self.device)
        self.pool.select_rows(on_dev)
        if self.ring is not None:
            self.ring.select_rows(on_dev)
        self.cache.state.select_rows(on_dev)
        self.count, self.ctx, self.rows = self.count[index], self.ctx[index], self.rows[index]

    def reset_rows(self, rows: torch.Tensor, *, source: int) -> None:
        """Make rows ``rows`` (CPU long) copies of row ``source`` (a never-fed row): the pool's
        K, V and positions of those rows only (an indexed copy), the policy's state through its
        `PolicyState.select_rows` with the index ``[0, 1, source, 3, ...]`` (every row of its
        buffers gathered: an observation ring, key norms, page sums, a small part of the pool's
        bytes), and the host bookkeeping. The scheduler's admission: no policy needs a reset
        hook, and the pool is not copied whole. Needs the stacked pool (``grad=False``)."""
        index = torch.arange(self.count.numel())
        index[rows] = source
        self.cache.state.select_rows(index.to(self.device))
        dst = rows.to(self.device)
        for buf in (self.pool.k_all, self.pool.v_all, self.pool.pos_all):
            if buf is not None:
                buf[:, dst] = buf[:, source].unsqueeze(1).clone()  # a view of buf: torch refuses the overlap
        if self.ring is not None:
            self.ring.reset_rows(dst, source)
        self.count, self.ctx, self.rows = self.count[index], self.ctx[index], self.rows[index]

    def close(self) -> None:
        """Drop the pool and the cache (with the backend's plans and buffers), so nothing this
        call allocated outlives it, even while a traceback still holds the engine."""
        if self.cache is not None:
            self.cache.step = None
            if self.cache.backend.paged:  # eager kernels again, their graph buffers dropped
                self.cache.backend.reset_graph()
        self.cache = self.pool = self.ring = self.capture = None

    def attended(self, q_len: int) -> torch.Tensor:
        """Mean KV slots attended per layer and KV head by each of the last fed queries, on the
        host (`PolicyState.attended`: every valid slot, unless the policy reads fewer). Call after
        ``feed``. Shapes: ``[B, q_len]``."""
        after = self.count[:, None] - q_len + torch.arange(1, q_len + 1)  # slots incl. the query
        full = self.cache.state.attended(after, ctx=self.ctx, budget_at=self.budget_at, layers=self.n_layers)
        if self.ring is None:
            return full
        # a sliding layer reads the last min(position + 1, W) tokens: the layers' mean
        seen = (self.ctx[:, None] - q_len + torch.arange(1, q_len + 1)).clamp(max=self.ring.window).float()
        n_s = len(self.spec.sliding)
        return (full * self.n_layers + seen * n_s) / (self.n_layers + n_s)
