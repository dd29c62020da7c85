r"""The sparse KV cache (a transformers cache, through [`hf`][sparsecorr.decoding.hf]) and the attention hook.

The cache writes each forward's K/V into the preallocated [`KVPool`][sparsecorr.decoding.pool.KVPool]
at the slots the engine planned (``Step``), and the attention function registered with
transformers' attention interface under the name ``"sparsecorr"`` reads the active cache from
a context variable and attends: every row's valid slots are ``[0, count_b)``, so a query at
slot \(j\) may read slots \(\le j\) (one ``[B, 1, Q, S]`` mask built once per forward and shared
by every layer; none at all for a single-token step of equal-length rows). What the policy adds
(its buffers, its part of the step, how a layer attends, what a compression keeps) runs through
its state's hooks (`sparsecorr.decoding.policies.state.PolicyState`); a paged backend reads
single-token steps through page tables. Positions are passed explicitly, so RoPE is right after
eviction.

Layer kinds (`sparsecorr.decoding.hf.ModelSpec`): a full-attention layer writes into the pool and
attends through the policy's state, which sees pool layer indices only; a sliding-window layer
writes into the `sparsecorr.decoding.pool.WindowRing` and attends its window (the step's first
sliding layer records the chunk's ring positions and makes the mask the others share). A model
with learned sinks or a logit soft cap sees its backend through `_Features`, so every
``attend`` / ``decode`` call (a policy's own included) gets them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .backends import AttentionBackend
from .hf import CacheBase, register_attention
from .policies import KeepSet, KVPolicy, compress
from .policies.base import hook_name
from .policies.state import PolicyState
from .pool import KVPool, WindowRing

__all__ = ["ATTN_NAME", "SparseKVCache", "Step", "active", "active_cache", "forced_keep", "load_step", "step_twin"]

ATTN_NAME = "sparsecorr"
_ACTIVE: contextvars.ContextVar[SparseKVCache | None] = contextvars.ContextVar("sparsecorr_cache", default=None)


@dataclass(frozen=True)
class Step:
    """What one forward writes and reads, planned once by the engine on the host
    (`sparsecorr.decoding.engine.Engine.plan`) and not changed after: what a forward makes from
    it (the additive masks, the sliding layers' window mask) lives on the cache for that forward
    (`SparseKVCache.step` resets it), and a captured step's plan is copied into its static
    buffers (`step_twin`, `load_step`), never rebound. (``part`` is the policy's own object:
    `PolicyState.derive` fills its device work.)

    Shapes:
        slots, positions ``[B, Q]`` (device): write slot and true position of each token (padding
        goes to the scratch page); counts ``[B]`` (device): valid slots before this forward; mask
        ``[B, 1, Q, kv_len]`` or None; part: the policy's part (`PolicyState.plan`); page_plan:
        a paged step's table plan (the keywords of the backend's ``begin_step``); ring_slots,
        ring_pos ``[B, Q]`` (device): the sliding-window layers' ring slots and positions
        (`sparsecorr.decoding.pool.WindowRing.plan`).
    """

    q_len: int
    kv_len: int
    slots: torch.Tensor
    positions: torch.Tensor
    counts: torch.Tensor
    mask: torch.Tensor | None = None
    paged: bool = False  # single-token step through the backend's page tables
    part: Any = None
    page_plan: dict | None = None
    ring_slots: torch.Tensor | None = None  # [B, Q] the sliding layers' ring slots (WindowRing.plan)
    ring_pos: torch.Tensor | None = None  # [B, Q] their ring positions (EMPTY for padding)


def _tensor_fields(obj) -> list[str]:
    """The device tensors of a step or its part (a field with ``metadata={"host": True}`` stays on
    the host: the planner reads it, a graph does not)."""
    return [f.name for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), torch.Tensor) and not f.metadata.get("host")]


def step_twin(step: Step, device: torch.device) -> Step:
    """Static device buffers of the same shapes as a host-planned ``step`` (and its policy part),
    for a CUDA graph to read at fixed addresses (`load_step` refreshes them)."""
    def twin(obj):
        return dataclasses.replace(obj, **{n: torch.zeros_like(getattr(obj, n), device=device)
                                           for n in _tensor_fields(obj)})
    part = None if step.part is None else twin(step.part)
    return dataclasses.replace(twin(step), part=part)


def load_step(twin: Step, step: Step) -> None:
    """Copy the host-planned ``step``'s tensors into its static ``twin`` (non-blocking)."""
    for dst, src in ((twin, step), (twin.part, step.part)):
        if src is not None:
            for n in _tensor_fields(src):
                getattr(dst, n).copy_(getattr(src, n), non_blocking=True)


class SparseKVCache(CacheBase):
    """Writes into a [`KVPool`][sparsecorr.decoding.pool.KVPool] per the engine's ``Step``; the
    policy's ``state`` (`PolicyState`) does the rest."""

    def __init__(self, pool: KVPool, *, policy: KVPolicy, state: PolicyState, backend: AttentionBackend,
                 ring: WindowRing | None = None, sliding: tuple[int, ...] = (), softcap: float | None = None,
                 sinks: bool = False) -> None:
        n_full = len(pool.k)
        super().__init__(n_full + len(sliding))
        self.pool, self.policy, self.state, self.ring = pool, policy, state, ring
        # model layer -> (sliding?, index in the ring or in the pool); the policy sees pool layers only
        full = [i for i in range(self.num_layers) if i not in sliding]
        self.where = {i: (False, j) for j, i in enumerate(full)} | {i: (True, j) for j, i in enumerate(sliding)}
        self.last_full = n_full - 1
        self.softcap = softcap
        # a model with soft-capping or sinks: every attend/decode the backend gets carries them
        self.backend = backend if softcap is None and not sinks else _Features(backend, softcap)
        self.step = None

    @property
    def step(self) -> Step | None:
        """The plan of the forward running now (None between forwards)."""
        return self._step

    @step.setter
    def step(self, step: Step | None) -> None:
        """Start a forward over ``step``: what the previous forward made from its plan is dropped
        (the additive masks of `step_mask`; the sliding layers' window mask, ``[B, 1, Q, R + 1]``,
        made by this forward's first sliding layer, inside a captured graph too)."""
        self._step = step
        self._biases: list = []
        self._ring_mask = None

    # -- the cache protocol of hf.CacheBase ---------------------------------------------------
    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():  # traced: sparsecorr::attend writes (decoding.fused)
            return key, value
        st, pool = self.step, self.pool
        sliding, i = self.where[layer_idx]
        if sliding:
            return self._write_ring(i, key, value, st)
        if i == 0 and pool.pos is not None:  # every layer's positions, once per step
            pool.write_positions(st.slots, st.positions)
        pool.write(i, key, value, st.slots)
        self.state.written(i, key, st)
        if i == self.last_full:  # every layer's new keys, once per step
            self.state.all_written(st)
        return pool.k[i][:, :, :st.kv_len], pool.v[i][:, :, :st.kv_len]

    def _write_ring(self, i: int, key: torch.Tensor, value: torch.Tensor, st: Step):
        """A sliding layer's write into its ring; the step's first sliding layer records the
        chunk's ring positions and makes the window mask every sliding layer reads."""
        ring = self.ring
        if i == 0:
            ring.write_positions(st.ring_slots, st.ring_pos)
            self._ring_mask = ring.mask(st.positions)
        ring.write(i, key, value, st.ring_slots)
        return ring.k[i], ring.v[i]

    def capacity_error(self, needed: int, where: str):
        """Raise the ``ValueError`` of a pool the policy's `KVPolicy.capacity` sized too small
        (``needed`` slots per row by ``where``); before any write past the pool."""
        pool, policy = self.pool, self.policy
        raise ValueError(f"{hook_name(policy, 'capacity')}: expected at least {needed} slots per row ({where} "
                         f"needs them), got a pool of {pool.capacity} (capacity() rounded up to pages of "
                         f"{pool.page_size}): capacity(table, longest=, chunk=) must cover the most slots a "
                         f"row holds before a compression reduces it (an eviction policy: max budget + buffer "
                         f"+ chunk, as EvictionPolicy.capacity)")

    def seq_length(self) -> int:
        return 0 if self.step is None else self.step.kv_len

    def warm_up_buffers(self) -> list[torch.Tensor]:
        """What a CUDA graph's warm-up step adds to and must restore (`PolicyState.added_to`)."""
        return self.state.added_to()

    def allocated_bytes(self) -> int:
        """Bytes of the pool and of every buffer the policy keeps beside it."""
        ring = 0 if self.ring is None else self.ring.allocated_bytes()
        return self.pool.allocated_bytes() + ring + sum(t.numel() * t.element_size() for t in self.state.buffers())

    # -- engine side --------------------------------------------------------------------------
    def attend(self, layer: int, query, key, value, scaling: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Model layer ``layer``'s attention: a sliding layer over its window in the ring, a full
        layer through the policy's state (which sees pool layer indices). ``sinks`` ``[H_q]``:
        the module's learned sink logits, passed on with the soft cap (`_Features`)."""
        if isinstance(self.backend, _Features):
            self.backend.sinks = sinks
        sliding, i = self.where[layer]
        st = self.step
        if sliding:
            return self.backend.attend(query, key, value, self.step_mask(self._ring_mask, query.dtype), scaling=scaling)
        self.state.observe(i, query, st)
        return self.state.attend(self, i, query, key, value, scaling)

    def attend_dense(self, layer: int, query, key, value, scaling: float) -> torch.Tensor:
        """Attention over every valid slot: through the page tables (a paged single-token step)
        or the step's mask."""
        st = self.step
        if st.paged:
            return self.backend.decode(query, self.pool.k[layer], self.pool.v[layer])
        return self.backend.attend(query, key, value, self.step_mask(st.mask, query.dtype), scaling=scaling)

    def step_mask(self, mask, dtype: torch.dtype):
        """A single-token step's bool mask as the additive bias (0 / -inf in ``dtype``) that a
        backend declaring ``additive_mask = True`` takes, so SDPA converts nothing per layer: made
        by the first layer that asks and shared by the forward's other layers (kept on the cache
        for this forward, keyed by the mask object: the step's mask and a selection's gather mask
        are two)."""
        st = self.step
        if (st.q_len != 1 or not self.backend.additive_mask
                or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
            return mask
        for m, bias in self._biases:
            if m is mask:
                return bias
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)
        self._biases.append((mask, bias))
        return bias

    def compress(self, budgets: torch.Tensor, counts: torch.Tensor, ctx: torch.Tensor, *,
                 forced: torch.Tensor | None = None, due: torch.Tensor | None = None,
                 record: bool = False) -> torch.Tensor | None:
        """Evict every layer down to ``budgets`` (host ``[B]``; a row's own count = keep all).

        ``ctx`` (host ``[B]``): tokens fed per row (what the policy's state reads of the step, for
        instance which observation-window queries are real). ``forced`` replaces the policy's
        choice on the ``due`` rows by given kept positions (a replay of recorded kept sets); with
        ``record`` the kept true positions of every layer are returned (-1 padded).

        Shapes:
            budgets, counts, ctx ``[B]`` CPU long (valid slots per row before); forced
            ``[B, L, H_kv, K']`` (device, -1 padded), due ``[B]`` (device bool) ->
            ``[B, L, H_kv, K]`` or None.
        """
        pool, n = self.pool, len(self.pool.k)  # the policy's (full) layers
        s, top = int(counts.max()), int(budgets.max())
        if s > pool.capacity:  # host ints, once per event (a captured step's writes are not checked)
            self.capacity_error(s, "a compression event")
        dev = pool.pos_all.device
        budgets_host, counts_host = budgets, counts
        budgets, counts = budgets.to(dev, non_blocking=True), counts.to(dev, non_blocking=True)  # once, not per layer
        event = self.state.event(counts=counts, counts_host=counts_host, budgets_host=budgets_host, most=s, top=top,
                                 ctx=ctx, forced=forced is not None)
        # every layer in one call (the stacked pool); with grad (per-layer K/V tensors) one layer
        # at a time, so the keys are never copied into a stack
        group = n if pool.k_all is not None else 1
        kept = [self._compress_layers(range(lo, min(lo + group, n)), s=s, top=top, budgets=budgets, counts=counts,
                                      forced=forced, due=due, record=record, event=event)
                for lo in range(0, n, group)]
        return torch.cat(kept, 1) if record else None

    def _compress_layers(self, layers: range, *, s: int, top: int, budgets, counts, forced, due, record: bool,
                         event) -> torch.Tensor | None:
        """Score, keep and compact ``layers`` in one `compress` call: the layers are stacked along
        the batch axis (``[n·B, ...]``, layer-major; each (row, head) is scored and kept on its
        own, so nothing mixes layers). Returns the kept positions ``[B, n, H_kv, K]`` if
        ``record``. The policy's state reads what it scores by (`PolicyState.score_inputs`) and
        follows the compaction (`compacting`, `compacted`)."""
        pool, n, lo, hi = self.pool, len(layers), layers.start, layers.stop
        b, h = pool.pos_all.shape[1:3]
        valid = (torch.arange(s, device=counts.device) < counts.repeat(n)[:, None])[:, None, :].expand(n * b, h, s)
        positions = pool.pos_all[lo:hi, ..., :s].reshape(n * b, h, s)
        if forced is None:
            keys = pool.keys(s, lo, hi)
            keys = keys.reshape(n * b, *keys.shape[2:])
            keep = compress(self.policy, keys=keys, valid=valid, positions=positions, budget=budgets.repeat(n),
                            max_budget=top, **self.state.score_inputs(event, keys, lo, hi, s))
        else:
            want = forced[:, lo:hi].transpose(0, 1).reshape(n * b, *forced.shape[2:])
            keep = forced_keep(positions, valid, want, due.repeat(n), k=min(top, s))
        kept = None
        if record:
            kept = torch.where(keep.valid, positions.gather(-1, keep.index), -1).reshape(n, b, h, -1).transpose(0, 1)
        index, kept_valid = keep.index.reshape(n, b, h, -1), keep.valid.reshape(n, b, h, -1)
        self.state.compacting(event, valid.reshape(n, b, h, s), index, kept_valid, lo)
        pool.compact_all(index, lo)
        self.state.compacted(event, index, kept_valid, lo)
        return kept


def forced_keep(positions: torch.Tensor, valid: torch.Tensor, want: torch.Tensor, due: torch.Tensor, *,
                k: int) -> KeepSet:
    """The kept set that keeps exactly the positions ``want`` on the ``due`` rows (every valid
    slot elsewhere), sorted by position as `compress` sorts it.

    Shapes:
        positions, valid ``[B, H, S]``; want ``[B, H, K']`` (-1 padded); due ``[B]`` -> ``K = k``.
    """
    hit = (positions[..., None] == want[:, :, None, :]).any(-1) & valid
    kept = torch.where(due[:, None, None], hit, valid)
    order = torch.where(kept, positions, torch.iinfo(torch.long).max).argsort(dim=-1)[..., :k]
    return KeepSet(index=order, valid=kept.gather(-1, order))


@contextlib.contextmanager
def active_cache(cache: SparseKVCache) -> Iterator[SparseKVCache]:
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def active() -> SparseKVCache:
    """The cache of the enclosing `active_cache` block."""
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError("sparsecorr attention used outside sparsecorr.decoding.generate")
    return cache


def sparsecorr_attention(layer: int, query, key, value, scaling: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention function: attention over the active cache's kept / selected slots (a
    sliding layer: its window). Traced by ``torch.compile`` (the fused step), it is the opaque
    op ``sparsecorr::attend`` (`sparsecorr.decoding.fused`), which writes the K/V and attends at
    run time."""
    if torch.compiler.is_compiling():
        if sinks is None:
            return torch.ops.sparsecorr.attend(query, key, value, layer, scaling)
        return torch.ops.sparsecorr.attend(query, key, value, layer, scaling, sinks)
    cache = active()
    if sinks is None:  # the five-argument call of a model without sinks
        return cache.attend(layer, query, key, value, scaling)
    return cache.attend(layer, query, key, value, scaling, sinks=sinks)


class _Features:
    """A backend seen through a model's attention features: every ``attend`` / ``decode`` call
    (the cache's, and a policy's own, e.g. BlockTopK's selected pages) gets ``softcap=`` (the
    config's) and ``sinks=`` (the calling layer's module parameter, set by
    `SparseKVCache.attend` before each layer attends), each only when not None, and a paged
    step's ``begin_step`` gets ``softcap=`` too; everything else is the backend's."""

    def __init__(self, backend, softcap: float | None) -> None:
        self._backend, self.softcap, self.sinks = backend, softcap, None

    def _features(self) -> dict:
        return {k: v for k, v in (("softcap", self.softcap), ("sinks", self.sinks)) if v is not None}

    def attend(self, *args, **kwargs):
        return self._backend.attend(*args, **kwargs, **self._features())

    def decode(self, *args, **kwargs):
        return self._backend.decode(*args, **kwargs, **self._features())

    def begin_step(self, **kwargs):
        """A paged step's plan with the model's soft-cap (``softcap=``, where it has one), so the
        kernels are planned with it once per step and the first `decode` does not plan again."""
        if self.softcap is not None:
            kwargs.setdefault("softcap", self.softcap)
        return self._backend.begin_step(**kwargs)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)


register_attention(ATTN_NAME, sparsecorr_attention)
