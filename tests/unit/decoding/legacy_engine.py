"""The previous decoding engine, kept as an independent oracle for the tests.

One token per forward, a ``torch.cat``-grown cache with per-slot positions and validity, left-
padded prompts, float32 attention with a position mask, BlockTopK by rescanning the cache
(``BlockTopK.attend_mask``), compression of the whole prompt once after a dense prefill, and the
same compression rule (``compress`` when a row's cache exceeds budget + buffer). Teacher forcing
is the same loop with the tokens given. Nothing here is shared with the new engine except the
policies' scoring rules.
"""

from __future__ import annotations

import torch

from sparsecorr.decoding.hf import CacheBase, forward, register_attention, sparse_attention
from sparsecorr.decoding.loops import Sampling, sample
from sparsecorr.decoding.policies import compress

NAME = "sparsecorr_legacy_oracle"
_STATE: dict = {}


class LegacyCache(CacheBase):
    def __init__(self, n_layers, policy):
        super().__init__(n_layers)
        self.n, self.policy = n_layers, policy
        self.k, self.v, self.pos, self.valid, self.q = ([None] * n_layers for _ in range(5))
        self.new_pos = self.new_valid = self.budgets = None
        self.seen = None

    def write(self, layer_idx, key_states, value_states):
        b, h, q, _ = key_states.shape
        pos = self.new_pos[:, None, :].expand(b, h, q)
        val = self.new_valid[:, None, :].expand(b, h, q)
        if self.k[layer_idx] is None:
            self.k[layer_idx], self.v[layer_idx] = key_states, value_states
            self.pos[layer_idx], self.valid[layer_idx] = pos.clone(), val.clone()
        else:
            cat = lambda a, x: torch.cat([a, x], dim=2)  # noqa: E731
            self.k[layer_idx], self.v[layer_idx] = cat(self.k[layer_idx], key_states), cat(self.v[layer_idx], value_states)
            self.pos[layer_idx], self.valid[layer_idx] = cat(self.pos[layer_idx], pos), cat(self.valid[layer_idx], val)
        return self.k[layer_idx], self.v[layer_idx]

    def seq_length(self):
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def compress_if_needed(self):
        pol = self.policy
        if not pol.evicts:
            return
        for i in range(self.n):
            n = self.valid[i].sum(dim=(1, 2)) // self.valid[i].shape[1]
            need = (self.budgets >= 0) & (n > self.budgets + pol.buffer)
            if not bool(need.any()):
                continue
            q = self.q[i] if self.q[i] is not None else self.k[i].new_zeros(*self.k[i].shape[:2], 0, self.k[i].shape[-1])
            keep = compress(pol, keys=self.k[i], queries=q, valid=self.valid[i], positions=self.pos[i],
                            budget=torch.where(need, self.budgets, n))
            idx = keep.index[..., None].expand(-1, -1, -1, self.k[i].shape[-1])
            self.k[i], self.v[i] = self.k[i].gather(2, idx), self.v[i].gather(2, idx)
            self.pos[i], self.valid[i] = self.pos[i].gather(2, keep.index), keep.valid


def _attention(layer, query, key, value, scaling):
    cache: LegacyCache = _STATE["cache"]
    valid, kpos = cache.valid[layer], cache.pos[layer]
    allowed = valid[:, :, None, :] & (kpos[:, :, None, :] <= cache.new_pos[:, None, :, None])
    pol = cache.policy
    if pol.kind == "selection" and query.shape[2] == 1:
        rows = []
        for r in range(query.shape[0]):  # each row with its own budget
            bud = int(cache.budgets[r])
            sel = valid[r:r + 1] if bud < 0 else pol.attend_mask(
                keys=key[r:r + 1], query=query[r:r + 1], valid=valid[r:r + 1], positions=kpos[r:r + 1],
                budget=bud, layer_idx=layer)
            rows.append(sel)
        allowed = allowed & torch.cat(rows)[:, :, None, :]
    w = getattr(pol, "window", 0)
    if pol.evicts and w > 0:
        prev = cache.q[layer]
        cache.q[layer] = (query if prev is None else torch.cat([prev, query], 2))[:, :, -w:].clone()
    if query.shape[2] == 1:
        seen = allowed[:, :, -1, :].sum(-1).float().mean(1)
        cache.seen = seen if cache.seen is None else cache.seen + seen
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    qf = query.float().reshape(b, hkv, hq // hkv, q, d)
    logits = torch.einsum("bhgqd,bhsd->bhgqs", qf, key.float()) * scaling
    probs = torch.softmax(logits.masked_fill(~allowed[:, :, None], float("-inf")), -1).nan_to_num(0.0)
    out = torch.einsum("bhgqs,bhsd->bhgqd", probs, value.float()).reshape(b, hq, q, d).to(query.dtype)
    return out


register_attention(NAME, _attention)


def legacy_run(model, input_ids, attention_mask=None, *, policy, budget, steps, temperature=0.0,
               top_k=None, top_p=None, k=20, generator=None, forced=None, forced_len=None):
    """tokens, rollout_logp, topk_logp, topk_ids, kv_kept, budget records, lengths (all [B, T] / [B])."""
    b = input_ids.shape[0]
    m = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    order = (~m).long().argsort(dim=1, descending=True, stable=True)  # left padding
    ids, m = input_ids.gather(1, order), m.gather(1, order)
    plen = m.sum(1)
    def tab(c):
        if budget is None or isinstance(budget, int):
            return -1 if budget is None else budget
        v = budget.budget_at(c)
        return -1 if v is None else v

    cache = LegacyCache(model.config.num_hidden_layers, policy)
    samp = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, k=k, generator=generator)
    rec = {n: torch.zeros(b, steps) for n in ("logp", "kept")}
    rec["tok"] = torch.zeros(b, steps, dtype=torch.long)
    rec["budget"] = torch.full((b, steps), -1, dtype=torch.long)
    rec["tk"], rec["ti"] = torch.full((b, steps, k), float("-inf")), torch.zeros(b, steps, k, dtype=torch.long)
    alive, lengths = torch.ones(b, dtype=torch.bool), torch.zeros(b, dtype=torch.long)
    _STATE["cache"] = cache
    with sparse_attention(model, NAME):
        with torch.no_grad():
            pos = (m.long().cumsum(1) - 1).clamp(min=0)
            cache.new_pos, cache.new_valid = pos, m
            cache.budgets = torch.tensor([tab(int(p)) for p in plen])
            logits = forward(model, input_ids=ids, position_ids=pos, cache=cache).logits[:, -1]
            cache.compress_if_needed()
            for t in range(steps):
                f = None if forced is None else forced[:, t]
                tok, lp, top = sample(logits, samp, f)
                r = alive.nonzero().squeeze(1)
                rec["tok"][r, t], rec["logp"][r, t], lengths[r] = tok[r], lp[r], t + 1
                rec["budget"][r, t] = cache.budgets[r]
                if top is not None:
                    rec["tk"][r, t], rec["ti"][r, t] = top.values[r], top.indices[r]
                if forced_len is not None:
                    alive &= forced_len > t + 1
                if t + 1 == steps or not bool(alive.any()):
                    break
                cache.new_pos, cache.new_valid = (plen + t)[:, None], torch.ones(b, 1, dtype=torch.bool)
                cache.budgets = torch.tensor([tab(int(p) + t + 1) for p in plen])
                cache.seen = None
                logits = forward(model, input_ids=tok[:, None], position_ids=(plen + t)[:, None],
                                 cache=cache).logits[:, -1]
                rec["kept"][alive, t] = (cache.seen / cache.n)[alive]
                cache.compress_if_needed()
    return {**rec, "lengths": lengths}
