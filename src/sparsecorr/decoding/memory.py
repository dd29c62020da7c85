r"""The memory plan: how many rows of a KV pool (and of the policy's state beside it) fit.

A row's bytes are measured, not modelled: the pool and the policy's state are built on the
``meta`` device (no memory) for one and for two rows, and their ``allocated_bytes`` differ by
one row (K, V, positions, and what the policy keeps per row: an observation ring, key norms,
page sums; a model with sliding-window layers: their ring of ``min(window + chunk - 1,
max_model_len)`` slots per layer beside the full layers' pool). A row holds ``KVPolicy.capacity(table, longest=max_model_len, chunk=prefill_chunk)``
slots: ``budget + buffer + chunk`` for an eviction policy, the whole context for dense and
selection. The rows are then

\[ \text{rows} = \min\Big(\text{max\_num\_seqs},\ \Big\lfloor \frac{A - f}{r} \Big\rfloor - 1\Big) \]

with \(r\) the row's bytes, \(f\) what does not grow with rows, and \(A\) the byte bound: the
smaller of ``max_kv_bytes`` and 0.9 × the device's free memory (CUDA; ``torch.cuda.mem_get_info``
plus what torch's caching allocator reserved but does not use,
as vLLM's ``gpu_memory_utilization`` leaves headroom for activations); the ``- 1`` is the
scheduler's pristine row (`sparsecorr.decoding.scheduler`). On another device the free memory is
not read: without ``max_num_seqs`` or ``max_kv_bytes``, ``max_num_seqs`` defaults to
`CPU_DEFAULT_ROWS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hf import model_spec
from .policies import KVPolicy
from .policies.base import row_capacity
from .pool import KVPool, WindowRing, ring_slots
from .validate import budget_table

__all__ = ["CPU_DEFAULT_ROWS", "FREE_FRACTION", "MemoryPlan", "check_caps", "plan_for", "plan_memory", "row_bytes"]

FREE_FRACTION = 0.9  # of the device's free memory the pool may take
CPU_DEFAULT_ROWS = 64  # rows on a non-CUDA device when neither cap is given


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """How many rows fit.

    Attributes:
        rows: most rows resident at once.
        row_bytes: KV pool + policy-state bytes of one row.
        capacity: KV slots per row (``KVPolicy.capacity`` at ``max_model_len``).
        bytes_allowed: the byte bound used (None: only ``max_num_seqs`` bounded it).
        source: what bound the rows: ``"max_num_seqs"`` | ``"max_kv_bytes"`` | ``"free memory"``.
    """

    rows: int
    row_bytes: int
    capacity: int
    bytes_allowed: int | None
    source: str


def row_bytes(model, policy: KVPolicy, table: torch.Tensor, capacity: int, *,
              chunk: int | None = None) -> tuple[int, int]:
    """``(bytes per row, fixed bytes)`` of the pool and the policy's state for ``model`` at
    ``capacity`` slots per row, measured on the meta device (nothing allocated). Per layer group,
    as the engine allocates (`sparsecorr.decoding.engine.Engine`): the full layers' pool at
    ``capacity`` slots, the sliding-window layers' ring at `ring_slots` (``chunk``: the most
    tokens a forward feeds; None: the context); a model whose layers all slide runs no policy."""
    spec = model_spec(model)
    dtype = next(model.parameters()).dtype
    meta = torch.device("meta")
    if not spec.full:  # as Engine: the window bounds every layer, the base (dense) policy over an empty pool
        policy, capacity = KVPolicy(), table.numel()
    longest = max(table.numel() - 1, 1)
    sizes = []
    for batch in (1, 2):
        pool = KVPool(layers=len(spec.full), batch=batch, kv_heads=spec.heads_kv, head_dim=spec.head_dim,
                      capacity=capacity, page_size=policy.pool_page_size, dtype=dtype, device=meta,
                      positions=policy.tracks_positions, grad=False)
        state = policy.new_state(pool, q_heads=spec.heads_q, table=table)
        ring = 0
        if spec.sliding:
            slots = ring_slots(spec.window, chunk=longest if chunk is None else chunk, longest=longest)
            ring = WindowRing(layers=len(spec.sliding), batch=batch, kv_heads=spec.heads_kv, head_dim=spec.head_dim,
                              window=spec.window, slots=slots, dtype=dtype, device=meta, grad=False).allocated_bytes()
        sizes.append(pool.allocated_bytes() + ring + sum(t.numel() * t.element_size() for t in state.buffers()))
    per = sizes[1] - sizes[0]
    return per, sizes[0] - per


def check_caps(*, max_num_seqs: object, max_kv_bytes: object) -> None:
    """Each cap None or an int >= 1 (ValueError naming it)."""
    _check_cap("max_num_seqs", max_num_seqs)
    _check_cap("max_kv_bytes", max_kv_bytes)


def _check_cap(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}: expected None or an int >= 1, got {value!r}")


def plan_memory(*, per_row: int, fixed: int, capacity: int, device: torch.device, max_num_seqs: int | None,
                max_kv_bytes: int | None, extra_rows: int = 1) -> MemoryPlan:
    """The rows that fit (see the module docstring); ``extra_rows`` allocated rows that hold no
    request (the scheduler's pristine row). ValueError, naming the bound, when not one row fits."""
    check_caps(max_num_seqs=max_num_seqs, max_kv_bytes=max_kv_bytes)
    device = torch.device(device)
    bounds: list[tuple[int, str]] = []  # (bytes, source)
    if max_kv_bytes is not None:
        bounds.append((max_kv_bytes, "max_kv_bytes"))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # what torch's caching allocator holds but does not use is free to this process too
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        bounds.append((int(free * FREE_FRACTION), "free memory"))
    elif max_num_seqs is None and max_kv_bytes is None:
        max_num_seqs = CPU_DEFAULT_ROWS
    allowed, src = min(bounds) if bounds else (None, "max_num_seqs")
    rows, source = (max_num_seqs, "max_num_seqs") if max_num_seqs is not None else (None, src)
    if allowed is not None:
        by_bytes = (allowed - fixed) // max(per_row, 1) - extra_rows
        if rows is None or by_bytes < rows:
            rows, source = by_bytes, src
        if by_bytes < 1:
            need = fixed + (1 + extra_rows) * per_row
            what = "max_kv_bytes" if src == "max_kv_bytes" else "free device memory (max_model_len, budget)"
            raise ValueError(f"{what}: not one row fits: a row of {capacity} KV slots needs {need} bytes "
                             f"(with the scheduler's pristine row), the bound allows {allowed}")
    return MemoryPlan(rows=int(rows), row_bytes=per_row, capacity=capacity, bytes_allowed=allowed, source=source)


def plan_for(model, policy: KVPolicy, budget, *, longest: int, chunk: int, max_num_seqs: int | None,
             max_kv_bytes: int | None, extra_rows: int = 1,
             prompt: int | None = None) -> tuple[torch.Tensor, MemoryPlan]:
    """The budget table (budget by context length, as ``generate`` builds it) and the memory plan
    of rows of ``longest`` tokens read in prefill chunks of ``chunk``: each row's capacity is
    `KVPolicy.capacity` (`sparsecorr.decoding.policies.base.row_capacity`: with the whole prompt
    of up to ``prompt`` tokens, None = ``longest - 1``, for a policy that keeps it through the
    prefill), its bytes `row_bytes`, the rows `plan_memory` (``extra_rows``: the scheduler's
    pristine row; 0 for a one-pool ``generate``)."""
    table = budget_table(budget, dense=policy.ignores_budget, longest=longest)
    capacity = row_capacity(policy, table, longest=longest, chunk=chunk, prompt=prompt)
    per, fixed = row_bytes(model, policy, table, capacity, chunk=chunk)
    device = next(model.parameters()).device
    return table, plan_memory(per_row=per, fixed=fixed, capacity=capacity, device=device, max_num_seqs=max_num_seqs,
                              max_kv_bytes=max_kv_bytes, extra_rows=extra_rows)
