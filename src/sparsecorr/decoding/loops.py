r"""The three loops over the [`Engine`][sparsecorr.decoding.engine.Engine]: prefill, sampling
(``generate``) and chunked teacher forcing (``teacher_forced_logprobs``).

Per-step records stay on the device (tokens, log-probs, top-k) or are computed on the host
(budgets, attended KV). The EOS check is the one host read per step: eager steps read it at once;
CUDA-graph steps read step t's flags at step t + 1 (a pinned copy and an event), so the host runs
a forward ahead of the GPU instead of waiting for it every token. Without an EOS token, no read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..mismatch import truncate_logits
from .engine import Engine

__all__ = ["Sampling", "decode_loop", "device_generator", "forced_loop", "prefill", "sample", "sample_categorical"]

_BLOCK = 1 << 24  # float32 logits elements processed at once when scoring a chunk


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int | None
    top_p: float | None
    k: int  # recorded top-k (0 = none)
    generator: torch.Generator | None


def device_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """A generator on ``device`` for sampling there: ``generator`` itself when it already lives
    on that device (or is None), else a new one seeded by one draw from ``generator`` (a host
    draw, no device sync), so seeded runs stay reproducible. Call once per ``generate`` call."""
    if generator is None or generator.device == torch.device(device):
        return generator
    seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
    return torch.Generator(device=device).manual_seed(seed)


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    r"""One draw per row of ``probs [N, V]`` (unnormalised is fine): \(\arg\max_v p_v / E_v\)
    with \(E_v \sim \mathrm{Exp}(1)\) i.i.d. (the exponential race; equivalent to Gumbel-max),
    which is how ``torch.multinomial`` draws a single sample, so on the same generator state it
    returns exactly ``torch.multinomial(probs, 1, generator=generator)``. The noise is drawn on
    ``probs``' device from ``generator`` (which must live there: see `device_generator`); no
    host sync. Shapes: ``[N, V]`` -> ``[N]``."""
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)


def sample(logits: torch.Tensor, samp: Sampling, forced: torch.Tensor | None = None):
    """Next token, its log-prob and the top-k, all from the processed distribution.

    Temperature first, then top-k, then top-p (as transformers and vLLM do); ``temperature=0``
    is greedy with the untempered log-probs.

    Shapes:
        logits ``[N, V]``; forced ``[N]`` -> token ``[N]``, log-prob ``[N]`` float32, top-k
        (values, indices) ``[N, k]`` or None.
    """
    z = logits.float()
    if samp.temperature > 0:
        z = truncate_logits(z / samp.temperature, samp.top_k, samp.top_p)
    logp_all = torch.log_softmax(z, dim=-1)
    if forced is not None:
        tok = forced
    elif samp.temperature > 0:
        tok = sample_categorical(logp_all.exp(), samp.generator)
    else:
        tok = logp_all.argmax(-1)
    top = logp_all.topk(min(samp.k, logp_all.shape[-1]), dim=-1) if samp.k > 0 else None
    return tok, logp_all.gather(1, tok[:, None]).squeeze(1), top


def prefill(engine: Engine, ids: torch.Tensor, lens: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed right-aligned prompts in chunks; logits at each row's last prompt token.

    Only the positions where some row's prompt ends are projected onto the vocabulary. Eviction
    policies compress between chunks, unless they keep the prompt whole
    (``compress_in_prefill`` False: `Engine.compress_due`'s ``prefill``).

    Shapes:
        ids ``[B, P]`` (device); lens ``[B]`` (CPU, each >= 1) -> logits ``[B, V]``.
    """
    b, p = ids.shape
    dev = engine.device
    last = None
    for c0 in range(0, p, chunk):
        c1 = min(p, c0 + chunk)
        real = (lens - c0).clamp(0, c1 - c0)
        end = lens - 1 - c0
        ending = (end >= 0) & (end < c1 - c0)
        cols = torch.unique(end[ending]) if bool(ending.any()) else torch.tensor([c1 - c0 - 1])
        out = engine.feed(ids[:, c0:c1], real, decode=False, logits_to_keep=cols.to(dev))
        if bool(ending.any()):
            rows = ending.nonzero().squeeze(1)
            got = out.logits[rows.to(dev), torch.searchsorted(cols, end[rows]).to(dev)]
            last = got.new_zeros(b, got.shape[-1]) if last is None else last
            last = last.index_put((rows.to(dev),), got)
        engine.compress_due(prefill=True)
    return last


class _Records:
    """Per-step outputs of ``generate`` for the original rows (device tensors + host stats)."""

    def __init__(self, b: int, t: int, k: int, device: torch.device) -> None:
        self.tok = torch.zeros(b, t, dtype=torch.long, device=device)
        self.logp = torch.zeros(b, t, device=device)
        self.tk = torch.full((b, t, k), float("-inf"), device=device)
        self.ti = torch.zeros(b, t, k, dtype=torch.long, device=device)
        self.length = torch.zeros(b, dtype=torch.long)
        self.budget = torch.full((b, t), -1, dtype=torch.long)
        self.kept = torch.zeros(b, t)
        self.finish = ["length"] * b
        self.pruned = torch.zeros(b, dtype=torch.bool)
        self.pruned_at = torch.full((b,), -1, dtype=torch.long)

    def fields(self) -> dict:
        t = self.tok.shape[1]
        made = torch.arange(t)[None] < self.length[:, None]
        return dict(tokens=self.tok, mask=made & ~self.pruned[:, None], lengths=self.length,
                    rollout_logp=torch.where(made.to(self.logp.device), self.logp, 0.0), topk_logp=self.tk,
                    topk_ids=self.ti, budget=self.budget, kv_kept=self.kept, finish_reason=tuple(self.finish),
                    pruned=self.pruned, pruned_at=self.pruned_at)


def _prune(engine, pruner, hidden, active, rec, *, group_size, step):
    """ARRoL decision at the detection length: drop the rows the pruner cuts."""
    decision = pruner.decide(hidden, group_size=group_size).cpu()
    cut = ~decision[active]
    rec.pruned[active[cut]] = True
    rec.pruned_at[active[cut]] = step
    for r in active[cut].tolist():
        rec.finish[r] = "pruned"
    return ~cut


def bucket(n: int) -> int:
    """The CUDA-graph batch bucket of ``n`` live rows: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def rows_to_keep(live: torch.Tensor, *, padded: bool) -> torch.Tensor:
    """Engine rows to keep (CPU bool ``[B]``) once some rows finished (``live`` False).

    Eager decoding keeps the live rows. CUDA-graph decoding (``padded``) keeps finished rows as
    masked dummies while the live count stays in the batch's bucket, and otherwise shrinks the
    batch to the live count's bucket (the live rows plus the first finished ones), so a run
    captures one graph per power of two met, not one per batch size.
    """
    if not padded:
        return live
    target = bucket(int(live.sum()))
    if target >= live.numel():
        return torch.ones_like(live)
    fill = (~live).nonzero().squeeze(1)[: target - int(live.sum())]
    return live.clone().index_fill_(0, fill, True)


def _eos_flags(tok: torch.Tensor, eos_t: torch.Tensor):
    """Which sampled tokens are EOS, copied to the host without waiting: ``(host bool [N], event)``
    (read it with `_read_eos` once the event has passed)."""
    flags = torch.isin(tok, eos_t)
    host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=flags.is_cuda)
    host.copy_(flags, non_blocking=True)
    event = None
    if flags.is_cuda:
        event = torch.cuda.Event()
        event.record()
    return host, event


def _read_eos(pending, rec: _Records, t: int) -> torch.Tensor:
    """The EOS flags of step ``t`` (``pending = (ids, host flags, event)``); marks those rows
    finished. A row read one step late was fed its EOS token: its attended-KV record of that
    step is cleared, as a row that stops at once never records one."""
    ids, host, event = pending
    if event is not None:
        event.synchronize()  # the sampling of step t, long done: the GPU is a forward ahead
    done = host.clone()
    for r in ids[done].tolist():
        rec.finish[r] = "eos"
        rec.kept[r, t] = 0.0
    return done


def _drop_finished(engine: Engine, active, live, done):
    """Mark the ``done`` live rows finished; shrink the engine's batch where `rows_to_keep` says
    so. Returns ``(active, live, kept engine rows or None)``."""
    live[live.nonzero().squeeze(1)[done]] = False
    keep = rows_to_keep(live, padded=engine.graphs is not None and engine.graphs.status == "on")
    if bool(keep.all()):
        return active, live, None
    kept = engine.select_rows(keep)
    return active[kept], live[kept], kept


def decode_loop(engine: Engine, logits: torch.Tensor, *, prompt_len: torch.Tensor, steps: int,
                samp: Sampling, eos, pruner, group_size, bar) -> dict:
    """Sample ``steps`` tokens per row (fewer for rows that stop); returns RolloutBatch fields.

    ``active`` maps engine rows to batch rows; ``live`` marks the rows still decoding (in
    CUDA-graph mode finished rows may stay as dummies: fed, never advanced, never recorded).
    With CUDA graphs (and no pruner) the EOS flags of a step are read one step late, so the
    host never waits for the step it has just launched: a row that sampled EOS is fed once more
    (its result unused) and leaves the batch at the next step. Eager steps read them at once.
    """
    b, dev = logits.shape[0], engine.device
    samp = replace(samp, generator=device_generator(samp.generator, logits.device))
    rec = _Records(b, steps, samp.k, dev)
    eos_t = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), device=dev)
    hidden = None if pruner is None else torch.zeros(b, pruner.window, engine.spec.hidden_size, device=dev)
    active, live = torch.arange(b), torch.ones(b, dtype=torch.bool)
    lagged = eos_t is not None and pruner is None and engine.graphs is not None and engine.graphs.status == "on"
    pending = None
    for t in range(steps):
        if pending is not None:  # the EOS flags of step t - 1
            done, pending = _read_eos(pending, rec, t - 1), None
            if bool(done.all()):
                break
            if bool(done.any()):
                active, live, kept = _drop_finished(engine, active, live, done)
                logits = logits if kept is None else logits[kept.to(dev)]
        padded = not bool(live.all())
        at = live.nonzero().squeeze(1).to(dev, non_blocking=True) if padded else None  # live engine rows
        ids = active[live]
        rows = ids.to(dev, non_blocking=True)
        tok, lp, top = sample(logits[at] if padded else logits, samp)
        rec.tok[rows, t], rec.logp[rows, t] = tok, lp
        if top is not None:
            rec.tk[rows, t], rec.ti[rows, t] = top.values, top.indices
        rec.length[ids] += 1
        rec.budget[ids, t] = engine.budget_at(prompt_len[ids] + t)
        done = torch.zeros(len(ids), dtype=torch.bool)
        if lagged:
            pending = (ids, *_eos_flags(tok, eos_t))
        elif eos_t is not None:
            done = _read_eos((ids, *_eos_flags(tok, eos_t)), rec, t)
        bar.update(1)
        if t + 1 == steps or bool(done.all()):
            break
        if padded:  # dummies are fed token 0
            tok = torch.zeros(len(active), dtype=tok.dtype, device=dev).index_copy_(0, at, tok)
        if bool(done.any()):
            active, live, kept = _drop_finished(engine, active, live, done)
            tok = tok if kept is None else tok[kept.to(dev)]
        slot = None if pruner is None else t - (pruner.detect_len - pruner.window)
        want_hidden = slot is not None and 0 <= slot < pruner.window
        out = engine.feed(tok[:, None], live.long(), decode=True, logits_to_keep=1, hidden=want_hidden)
        logits = out.logits[:, -1]
        rec.kept[active[live], t] = engine.attended(1)[live, 0]
        if want_hidden:  # hidden states of generated tokens detect_len - window ... detect_len - 1
            hidden[active.to(dev), slot] = out.hidden_states[pruner.layer][:, -1].float()
        if pruner is not None and t + 1 == pruner.detect_len:  # no dummies: a pruner runs eagerly
            keep = _prune(engine, pruner, hidden, active, rec, group_size=group_size, step=t + 1)
            if not bool(keep.any()):
                break
            if not bool(keep.all()):
                rows_kept = engine.select_rows(keep)
                active, live, logits = active[rows_kept], live[rows_kept], logits[rows_kept.to(dev)]
        engine.compress_due()
    if pending is not None:
        _read_eos(pending, rec, t)
    return rec.fields()


def _score(logits: torch.Tensor, tokens: torch.Tensor, samp: Sampling):
    """Log-probs (and top-k) of forced ``tokens [b, n]`` from ``logits [b, n, V]``, in blocks."""
    b, n, v = logits.shape
    flat, toks = logits.reshape(b * n, v), tokens.reshape(b * n)
    step = max(1, _BLOCK // v)
    parts = [sample(flat[i:i + step], samp, toks[i:i + step]) for i in range(0, b * n, step)]
    lp = torch.cat([p[1] for p in parts]).reshape(b, n)
    if samp.k == 0:
        return lp, None
    vals = torch.cat([p[2].values for p in parts]).reshape(b, n, -1)
    idx = torch.cat([p[2].indices for p in parts]).reshape(b, n, -1)
    return lp, (vals, idx)


def forced_loop(engine: Engine, logits: torch.Tensor, forced: torch.Tensor, forced_len: torch.Tensor, *,
                prompt_len: torch.Tensor, chunk: int, samp: Sampling, bar) -> dict:
    """Replay ``forced [B, T]`` (row b: its first ``forced_len_b`` tokens) in chunks that end where
    a compression is due; returns RolloutBatch fields."""
    b, t_max = forced.shape
    dev = engine.device
    active = torch.arange(b)
    pieces = [(active, 0, *_score(logits[:, None], forced[:, :1], samp))]
    kept = torch.zeros(b, t_max)
    t = 0
    while True:
        alive = forced_len[active] > t + 1
        if not bool(alive.any()):
            break
        if not bool(alive.all()):
            active = active[engine.select_rows(alive)]
        rows = active.to(dev)
        n = engine.tokens_until_compress(min(chunk, int(forced_len[active].max()) - 1 - t))
        out = engine.feed(forced[rows, t:t + n], torch.full((len(active),), n), decode=True, logits_to_keep=0)
        kept[active, t:t + n] = engine.attended(n)
        pieces.append((active, t + 1, *_score(out.logits, forced[rows, t + 1:t + n + 1], samp)))
        engine.compress_due()
        t += n
        bar.update(n)
    return _assemble(pieces, forced, forced_len, kept, engine=engine, prompt_len=prompt_len, k=samp.k)


def _assemble(pieces, forced, forced_len, kept, *, engine, prompt_len, k) -> dict:
    b, t_max = forced.shape
    dev = forced.device
    logp = torch.zeros(b, t_max, device=dev)
    tk = torch.full((b, t_max, k), float("-inf"), device=dev)
    ti = torch.zeros(b, t_max, k, dtype=torch.long, device=dev)
    for rows, t0, lp, top in pieces:
        idx = (rows.to(dev)[:, None], torch.arange(t0, t0 + lp.shape[1], device=dev)[None])
        logp = logp.index_put(idx, lp)
        if top is not None:
            tk, ti = tk.index_put(idx, top[0]), ti.index_put(idx, top[1])
    mask = torch.arange(t_max)[None] < forced_len[:, None]
    m = mask.to(dev)  # chunks run to the longest row: clear what lies past a row's end
    logp, tk, ti = torch.where(m, logp, 0.0), torch.where(m[..., None], tk, float("-inf")), torch.where(m[..., None], ti, 0)
    budget = torch.where(mask, engine.budget_at(prompt_len[:, None] + torch.arange(t_max)), -1)
    fed = torch.arange(t_max)[None] < forced_len[:, None] - 1
    return dict(tokens=torch.where(mask.to(dev), forced, 0), mask=mask, lengths=forced_len,
                rollout_logp=logp, topk_logp=tk, topk_ids=ti, budget=budget,
                kv_kept=torch.where(fed, kept, 0.0), finish_reason=("length",) * b,
                pruned=torch.zeros(b, dtype=torch.bool), pruned_at=torch.full((b,), -1, dtype=torch.long))
