r"""The sparse KV cache (a ``transformers.Cache`` subclass) and the attention hook.

The cache stores, per layer, keys and values ``[B, H_kv, S, D]`` together with the true
position and validity of every slot, so after eviction RoPE stays right (positions are passed
explicitly) and attention masks are built from positions: a query at position \(p\) may read a
valid slot at position \(\le p\). The attention function registered with
``transformers.AttentionInterface`` under the name ``"sparsecorr"`` reads the active cache from
a context variable, applies the selection policy (if any) and calls the backend.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from .backends import AttentionBackend
from .policies import KVPolicy, compress

__all__ = ["ATTN_NAME", "SparseKVCache", "active_cache"]

ATTN_NAME = "sparsecorr"
_ACTIVE: contextvars.ContextVar[SparseKVCache | None] = contextvars.ContextVar("sparsecorr_cache", default=None)


class SparseKVCache(Cache):
    """Per-layer K/V with true positions and validity; compressed in place by eviction policies."""

    def __init__(self, num_layers: int, *, policy: KVPolicy, backend: AttentionBackend) -> None:
        super().__init__(layers=[])
        self.num_layers, self.policy, self.backend = num_layers, policy, backend
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.pos: list[torch.Tensor | None] = [None] * num_layers
        self.valid: list[torch.Tensor | None] = [None] * num_layers
        self.queries: list[torch.Tensor | None] = [None] * num_layers
        self.new_pos: torch.Tensor | None = None  # [B, Q] positions of the tokens of this step
        self.new_valid: torch.Tensor | None = None  # [B, Q]
        self.step_budget: torch.Tensor | None = None  # [B] long, -1 = dense
        self.attended = None  # [B] sum over layers of the mean attended slots
        self.peak_bytes = 0

    # -- transformers.Cache API -------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        b, h, q, _ = key_states.shape
        pos = self.new_pos[:, None, :].expand(b, h, q)
        val = self.new_valid[:, None, :].expand(b, h, q)
        if self.k[layer_idx] is None:
            self.k[layer_idx], self.v[layer_idx] = key_states, value_states
            self.pos[layer_idx], self.valid[layer_idx] = pos.clone(), val.clone()
        else:
            self.k[layer_idx] = torch.cat([self.k[layer_idx], key_states], dim=2)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], value_states], dim=2)
            self.pos[layer_idx] = torch.cat([self.pos[layer_idx], pos], dim=2)
            self.valid[layer_idx] = torch.cat([self.valid[layer_idx], val], dim=2)
        return self.k[layer_idx], self.v[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.k[layer_idx] is None else self.k[layer_idx].shape[2]

    def __len__(self) -> int:
        return self.num_layers

    # -- engine side --------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of the batch (finished or pruned rows free their KV)."""
        for lst in (self.k, self.v, self.pos, self.valid, self.queries):
            for i, t in enumerate(lst):
                if t is not None:
                    lst[i] = t.index_select(0, rows)
        if self.step_budget is not None:
            self.step_budget = self.step_budget.index_select(0, rows)

    def compress_if_needed(self, budgets: torch.Tensor) -> None:
        """Evict down to ``budgets`` ([B], -1 = dense) where a row exceeds budget + buffer."""
        if not self.policy.evicts:
            return
        buffer = getattr(self.policy, "buffer", 0)
        for i in range(self.num_layers):
            valid = self.valid[i]
            n = valid.sum(dim=(1, 2)) // valid.shape[1]  # valid slots per row (equal over heads)
            need = (budgets >= 0) & (n > budgets + buffer)
            if not bool(need.any()):
                continue
            eff = torch.where(need, budgets, n)
            q = self.queries[i]
            if q is None:  # a policy that scores without queries (StreamingLLM)
                q = self.k[i].new_zeros(self.k[i].shape[0], self.k[i].shape[1], 0, self.k[i].shape[-1])
            keep = compress(self.policy, keys=self.k[i], queries=q, valid=valid,
                            positions=self.pos[i], budget=eff)
            idx4 = keep.index[..., None].expand(-1, -1, -1, self.k[i].shape[-1])
            self.k[i] = self.k[i].gather(2, idx4)
            self.v[i] = self.v[i].gather(2, idx4)
            self.pos[i] = self.pos[i].gather(2, keep.index)
            self.valid[i] = keep.valid

    def remember_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        w = getattr(self.policy, "window", 0)
        if w <= 0 or not self.policy.evicts:
            return
        prev = self.queries[layer_idx]
        q = query if prev is None else torch.cat([prev, query], dim=2)
        self.queries[layer_idx] = q[:, :, -w:]


@contextlib.contextmanager
def active_cache(cache: SparseKVCache) -> Iterator[SparseKVCache]:
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def sparsecorr_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function: masked attention over the active cache's kept slots."""
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError("sparsecorr attention used outside sparsecorr.decoding.generate")
    layer = module.layer_idx
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    valid, kpos = cache.valid[layer], cache.pos[layer]
    allowed = valid[:, :, None, :] & (kpos[:, :, None, :] <= cache.new_pos[:, None, :, None])
    if cache.policy.kind == "selection" and query.shape[2] == 1:
        budgets = cache.step_budget
        sel = cache.policy.attend_mask(keys=key, query=query, valid=valid, positions=kpos,
                                       budget=int(budgets.clamp(min=0).max()), layer_idx=layer)
        dense_rows = (budgets < 0)[:, None, None]
        allowed = allowed & (sel | dense_rows)[:, :, None, :]
    cache.remember_queries(layer, query)
    if query.shape[2] == 1:
        seen = allowed[:, :, -1, :].sum(-1).float().mean(1)
        cache.attended = seen if cache.attended is None else cache.attended + seen
    out = cache.backend.attend(query, key, value, allowed, scaling=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, sparsecorr_attention)
