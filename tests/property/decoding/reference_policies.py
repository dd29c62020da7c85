"""The policies' math as it stood before issue 36 (commit 1ac3959), kept as the reference the
closed-form and op-lean versions are checked against: float32 copies of the keys, unit keys
normalised twice, position argsorts, per-layer keep counts. Since issue 51 SnapKV's votes are
causal inside the window and pooled before it (`snapkv_score`), and R-KV's earlier scoring is
``RKV(scoring="minmax")`` (`rkv_score`; R-KV's own rule is checked against a port of its code in
``tests/unit/decoding/references``). Test code only, never imported by ``src``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_scores(queries, keys, valid, query_valid=None):
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    q = queries.float().reshape(b, hkv, g, w, d)
    logits = torch.einsum("bhgwd,bhsd->bhgws", q, keys.float()) * d**-0.5
    logits = logits.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if query_valid is not None:
        probs = probs * query_valid[:, None, None, :, None].to(probs.dtype)
    return probs.sum(dim=3).mean(dim=2)


def pool_scores(scores, *, kernel, pooling):
    if kernel <= 1:
        return scores
    b, h, s = scores.shape
    x = scores.reshape(b * h, 1, s)
    pad = kernel // 2
    if pooling == "max":
        y = F.max_pool1d(F.pad(x, (pad, pad), value=float("-inf")), kernel, stride=1)
    else:
        y = F.avg_pool1d(F.pad(x, (pad, pad), value=0.0), kernel, stride=1)
    return y.reshape(b, h, -1)[..., :s]


def causal_group_scores(queries, keys, valid, query_valid=None):
    """`group_scores` with SnapKV's causal mask inside the observation window (issue 51): window
    query ``t`` is the token of the ``t``-th of the last ``W`` valid keys and sees keys up to it
    (every key where its own is gone; padding queries are not masked, they do not vote)."""
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    q = queries.float().reshape(b, hkv, g, w, d)
    logits = torch.einsum("bhgwd,bhsd->bhgws", q, keys.float()) * d**-0.5
    rank = valid.long().cumsum(-1)  # [B, H, S]
    own = valid.sum(-1)[:, :, None] - w + 1 + torch.arange(w)  # [B, H, W]
    hidden = (rank[:, :, None, :] > own[..., None]) & (own[..., None] >= 1)
    if query_valid is not None:
        hidden = hidden & query_valid[:, None, :, None]
    logits = logits.masked_fill(hidden[:, :, None], float("-inf"))
    logits = logits.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if query_valid is not None:
        probs = probs * query_valid[:, None, None, :, None].to(probs.dtype)
    return probs.sum(dim=3).mean(dim=2)


def snapkv_score(pol, keys, queries, valid, query_valid=None):
    """SnapKV since issue 51: causal votes, kept only for the keys before the window, pooled."""
    imp = causal_group_scores(queries, keys, valid, query_valid)
    rank = valid.long().cumsum(-1)
    scored = valid & (rank <= valid.sum(-1, keepdim=True) - pol.window)
    return pool_scores(imp.masked_fill(~scored, 0.0), kernel=pol.kernel, pooling=pol.pooling)


def _unit_keys(keys, valid):
    return F.normalize(keys.float(), dim=-1) * valid[..., None]


def key_redundancy(keys, valid, *, chunk=4096):
    s = keys.shape[2]
    total = keys.new_zeros(keys.shape[:2] + keys.shape[3:], dtype=torch.float32)
    for lo in range(0, s, chunk):
        total += _unit_keys(keys[:, :, lo:lo + chunk], valid[:, :, lo:lo + chunk]).sum(2)
    n = valid.sum(-1, keepdim=True).float()
    parts = []
    for lo in range(0, s, chunk):
        u = _unit_keys(keys[:, :, lo:lo + chunk], valid[:, :, lo:lo + chunk])
        parts.append(torch.einsum("bhsd,bhd->bhs", u, total) - u.square().sum(-1))
    red = torch.cat(parts, -1) / (n - 1).clamp(min=1)
    return torch.where(valid, red, 0.0)


def _minmax(x, valid):
    lo = torch.where(valid, x, torch.inf).amin(-1, keepdim=True)
    hi = torch.where(valid, x, -torch.inf).amax(-1, keepdim=True)
    return torch.where(valid, (x - lo) / (hi - lo).clamp(min=1e-12), 0.0)


def rkv_score(pol, keys, queries, valid, query_valid=None):
    """``RKV(scoring="minmax")`` (R-KV's scoring before issue 51)."""
    imp = pool_scores(group_scores(queries, keys, valid, query_valid).masked_fill(~valid, 0.0),
                      kernel=pol.kernel, pooling="max")
    red = key_redundancy(keys, valid)
    return pol.mix * _minmax(imp, valid) - (1.0 - pol.mix) * _minmax(red, valid)


def score(pol, keys, queries, valid, positions, query_valid=None):
    if pol.name == "streaming_llm":
        return positions.float()
    if pol.name == "snapkv":
        return snapkv_score(pol, keys, queries, valid, query_valid)
    return rkv_score(pol, keys, queries, valid, query_valid)


def _protected(policy, valid, positions):
    sink, recent = getattr(policy, "sink", 0), getattr(policy, "window", 0)
    big = torch.iinfo(torch.long).max
    pos = torch.where(valid, positions, big)
    order = pos.argsort(dim=-1)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(pos.shape[-1]).expand_as(order))
    n = valid.sum(-1, keepdim=True)
    return valid & ((rank < sink) | (rank >= n - recent))


def compress_from_scores(policy, scores, *, valid, positions, budget):
    """Today's ``compress`` after ``policy.score``: (index, valid) sorted by position."""
    b, _, s = valid.shape
    budgets = torch.as_tensor(budget).reshape(-1).long()
    k = int(min(int(budgets.max()), s))
    budgets = budgets.expand(b)
    scores = scores.double() + positions.double() * 1e-12
    scores = torch.where(_protected(policy, valid, positions), 1e15 + positions.double(), scores)
    scores = scores.masked_fill(~valid, -torch.inf)
    top = scores.topk(k, dim=-1).indices
    rank = torch.arange(k)
    kept = valid.gather(-1, top) & (rank[None, None, :] < budgets[:, None, None])
    big = torch.iinfo(torch.long).max
    pos = torch.where(kept, positions.gather(-1, top), big)
    order = pos.argsort(dim=-1)
    return top.gather(-1, order), kept.gather(-1, order)


def keep_counts(policy, *, slots, budgets):
    n_pages = slots // policy.page_size + 1
    want = (budgets // policy.page_size).clamp(min=policy.keep_first_pages + policy.keep_last_pages)
    return torch.where(budgets < 0, n_pages, torch.minimum(want, n_pages))


def select_pages(policy, *, summaries, query, slots, budgets, k):
    b, h, n_pages, d = summaries.shape
    q_len = query.shape[2]
    mean_q = query.float().reshape(b, h, -1, q_len, d).mean(2)
    score = torch.einsum("bhqd,bhpd->bhqp", mean_q, summaries.float())
    page = torch.arange(n_pages)
    current = (slots // policy.page_size)[:, None, :, None]
    forced = (page < policy.keep_first_pages) | (page > current - policy.keep_last_pages)
    score = torch.where(forced, torch.inf, score).masked_fill(page > current, -torch.inf)
    k = min(k, n_pages)
    top = score.topk(k, dim=-1).indices
    ok = torch.arange(k) < keep_counts(policy, slots=slots, budgets=budgets)[:, None, :, None]
    pages = torch.where(ok, top, n_pages).sort(-1).values
    return pages, pages < n_pages, score


def scatter_selected_pages(buffer, indptr, pages, ok, *, pages_per_row):
    r = pages.shape[0] * pages.shape[1]
    flat, okf = pages.reshape(r, -1), ok.reshape(r, -1)
    rows = torch.arange(r)[:, None]
    pos = indptr[:-1].long()[:, None] + torch.arange(flat.shape[1])
    pos = torch.where(okf, pos, buffer.numel() - 1)
    vals = torch.where(okf, rows * pages_per_row + flat, 0).to(buffer.dtype)
    buffer.scatter_(0, pos.reshape(-1), vals.reshape(-1))
