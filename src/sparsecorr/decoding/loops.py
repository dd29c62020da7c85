r"""The three loops: prefill and chunked teacher forcing over the
[`Engine`][sparsecorr.decoding.engine.Engine], sampling (``generate``) over the
[`ModelRunner`][sparsecorr.decoding.runner.ModelRunner].

Per-step records stay on the device (tokens, log-probs, top-k) or are computed on the host
(budgets, attended KV). The decode loop sees only what each runner step returns
(`sparsecorr.decoding.runner.StepOutput`): the new tokens and which rows finished; how the step
ran, and when it checks for EOS, are the runner's.
"""

from __future__ import annotations

import torch

from .engine import Engine
from .runner import ModelRunner
from .sampling import Sampling, device_generator, sample, sample_categorical

__all__ = ["Sampling", "decode_loop", "device_generator", "forced_loop", "prefill", "sample", "sample_categorical"]

_BLOCK = 1 << 24  # float32 logits elements processed at once when scoring a chunk


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


def _prune(pruner, hidden, rows, rec, *, group_size, step) -> torch.Tensor:
    """ARRoL decision at the detection length over the running ``rows`` (CPU long): marks the rows
    the pruner cuts and returns them."""
    decision = pruner.decide(hidden, group_size=group_size).cpu()
    cut = rows[~decision[rows]]
    rec.pruned[cut] = True
    rec.pruned_at[cut] = step
    for r in cut.tolist():
        rec.finish[r] = "pruned"
    return cut


def _finished(rec: _Records, rows: torch.Tensor, t: int) -> None:
    """Rows ``rows`` stopped at EOS; a row whose EOS was read after its next forward was fed
    that token: its attended-KV record of step ``t`` is cleared, as a row that stops at once
    never records one."""
    for r in rows.tolist():
        rec.finish[r] = "eos"
        rec.kept[r, t] = 0.0


def decode_loop(runner: ModelRunner, logits: torch.Tensor, *, prompt_len: torch.Tensor, steps: int,
                samp: Sampling, eos, pruner, group_size, bar) -> dict:
    """Sample ``steps`` tokens per row (fewer for rows that stop); returns RolloutBatch fields.

    Each step of the [`ModelRunner`][sparsecorr.decoding.runner.ModelRunner] returns the rows'
    next tokens (`StepOutput`); this loop records them, with the budget and the attended KV of
    each fed token, and marks the rows that finished (EOS, or cut by the pruner, which reads the
    hidden states of the tokens ``detect_len - window .. detect_len - 1``).
    """
    b, dev, t = logits.shape[0], runner.engine.device, 0
    rec = _Records(b, steps, samp.k, dev)
    hidden = None if pruner is None else torch.zeros(b, pruner.window, runner.engine.spec.hidden_size, device=dev)
    out = runner.start(logits, sampling=samp, eos=eos)
    for t in range(steps):
        rows, sel = out.rows, None
        if t > 0:
            slot = None if pruner is None else t - 1 - (pruner.detect_len - pruner.window)
            want_hidden = slot is not None and 0 <= slot < pruner.window
            out = runner.step(hidden_layer=pruner.layer if want_hidden else None)
            rec.kept[out.fed, t - 1] = out.kept
            _finished(rec, out.late_eos, t - 1)
            if want_hidden:  # hidden states of generated tokens detect_len - window ... detect_len - 1
                hidden[out.fed.to(dev), slot] = out.hidden.float()
            rows = out.rows
            if pruner is not None and t == pruner.detect_len:
                cut = _prune(pruner, hidden, rows, rec, group_size=group_size, step=t)
                runner.drop(cut)
                sel = ~torch.isin(rows, cut)
                rows = rows[sel]
            if rows.numel() == 0:
                break
        tok, lp, top = out.tokens, out.logp, out.topk
        if sel is not None and not bool(sel.all()):
            at = sel.nonzero().squeeze(1).to(dev)
            tok, lp, top = tok[at], lp[at], None if top is None else (top[0][at], top[1][at])
        at_rows = rows.to(dev, non_blocking=True)
        rec.tok[at_rows, t], rec.logp[at_rows, t] = tok, lp
        if top is not None:
            rec.tk[at_rows, t], rec.ti[at_rows, t] = top
        rec.length[rows] += 1
        rec.budget[rows, t] = runner.budget_at(prompt_len[rows] + t)
        eos_rows = out.eos if sel is None else out.eos[torch.isin(out.eos, rows)]
        _finished(rec, eos_rows, t)
        bar.update(1)
        if t + 1 == steps or runner.running == 0:
            break
    _finished(rec, runner.finish(), t)
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
