r"""Sampling: one setting for a whole batch (`Sampling`, `sample`: ``generate``'s batch, run inside
the model runner's step, `sparsecorr.decoding.runner`) and per-row settings (`RowSampling`,
`sample_rows`: every row of one step with its own request's temperature, top-k, top-p, recorded
top-k and random stream: the scheduler's rows).

Per row, `sample_rows` does the same processing as `sample` (transformers' and vLLM's order): temperature,
then top-k, then top-p (`sparsecorr.mismatch.truncate_logits`, vectorised over rows with
per-row ``k`` and ``p``); a row with temperature 0 is greedy with the untempered log-probs and no
truncation. A sampling row draws with the exponential race of `sample_categorical`
(\(\arg\max_v p_v / E_v\), \(E_v \sim \mathrm{Exp}(1)\)); a row with its own generator draws its
``E`` from it alone, so its tokens depend on nothing else in the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..mismatch import truncate_logits

__all__ = ["RowSampling", "Sampling", "device_generator", "sample", "sample_categorical", "sample_rows"]


@dataclass(frozen=True)
class Sampling:
    """One sampling setting for every row: ``temperature`` (0 = greedy), ``top_k`` / ``top_p``
    (None = off), ``k`` (top-k log-probs recorded, 0 = none) and ``generator`` (None: torch's
    default)."""

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


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None, *,
                       rows: torch.Tensor | None = None, batch: int | None = None) -> torch.Tensor:
    r"""One draw per row of ``probs [N, V]`` (unnormalised is fine): \(\arg\max_v p_v / E_v\)
    with \(E_v \sim \mathrm{Exp}(1)\) i.i.d. (the exponential race; equivalent to Gumbel-max),
    which is how ``torch.multinomial`` draws a single sample, so on the same generator state it
    returns exactly ``torch.multinomial(probs, 1, generator=generator)``. The noise is drawn on
    ``probs``' device from ``generator`` (which must live there: see `device_generator`); no
    host sync. With ``rows`` (device long ``[N]``, each ``< batch``) the noise is drawn for the
    whole batch (``[batch, V]``) and row ``i`` races with row ``rows[i]`` of it (`sample`).
    Shapes: ``[N, V]`` -> ``[N]``."""
    shape = probs.shape if rows is None else (batch, probs.shape[-1])
    noise = probs.new_empty(shape).exponential_(1, generator=generator)
    return (probs / (noise if rows is None else noise[rows])).argmax(-1)


def sample(logits: torch.Tensor, samp: Sampling, forced: torch.Tensor | None = None, *,
           rows: torch.Tensor | None = None, batch: int | None = None):
    """Next token, its log-prob and the top-k, all from the processed distribution.

    Temperature first, then top-k, then top-p (as transformers and vLLM do); ``temperature=0``
    is greedy with the untempered log-probs.

    ``rows`` / ``batch``: the noise of a sampling step is drawn for the whole batch of ``batch``
    rows (``[batch, V]``, one draw per step whatever rows are running) and row ``i`` reads row
    ``rows[i]`` of it, so a row's token depends on its index in the batch only, not on which
    other rows share the step or on padding rows (the model runner's graph step runs padded
    batches, its eager step does not: both draw the same noise). Without ``rows``, the noise is
    ``[N, V]`` (both: `sample_categorical`).

    Shapes:
        logits ``[N, V]``; forced ``[N]``; rows ``[N]`` long (device, ``< batch``) -> token ``[N]``, log-prob ``[N]`` float32, top-k
        (values, indices) ``[N, k]`` or None.
    """
    z = logits.float()
    if samp.temperature > 0:
        z = truncate_logits(z / samp.temperature, samp.top_k, samp.top_p)
    logp_all = torch.log_softmax(z, dim=-1)
    if forced is not None:
        tok = forced
    elif samp.temperature > 0:
        tok = sample_categorical(logp_all.exp(), samp.generator, rows=rows, batch=batch)
    else:
        tok = logp_all.argmax(-1)
    top = logp_all.topk(min(samp.k, logp_all.shape[-1]), dim=-1) if samp.k > 0 else None
    return tok, logp_all.gather(1, tok[:, None]).squeeze(1), top


@dataclass(frozen=True, slots=True, kw_only=True)
class RowSampling:
    """One row's settings: ``temperature`` (0 = greedy), ``top_k`` / ``top_p`` (None = off),
    ``logprobs`` (top-k log-probs to record) and ``generator`` (the row's own RNG on the logits'
    device, or None: the step's shared one)."""

    temperature: float
    top_k: int | None
    top_p: float | None
    logprobs: int
    generator: torch.Generator | None


def _truncate(z: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`truncate_logits` with a ``k`` and a ``p`` per row (``k = V`` / ``p = 1``: off)."""
    v, dev = z.shape[-1], z.device
    if any(k < v for k in top_k):
        kk = torch.tensor(top_k, device=dev)
        kth = z.sort(dim=-1, descending=True).values.gather(1, (kk - 1)[:, None])
        z = z.masked_fill(z < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        pp = torch.tensor(top_p, device=dev, dtype=z.dtype)
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        drop_sorted = ((probs.cumsum(-1) - probs) >= pp[:, None]) & (pp < 1.0)[:, None]
        drop_sorted[:, 0] = False  # the most likely token is always kept
        z = z.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    return z


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling], shared: torch.Generator | None):
    """Next token, its log-prob and the top-k of each row, from that row's processed distribution.

    ``shared``: the generator of the sampling rows without their own (on the logits' device, or
    None: torch's default). The top-k is taken at the largest ``logprobs`` of the step (a row
    reads its first ``logprobs`` columns).

    Shapes:
        logits ``[N, V]`` -> token ``[N]`` long, log-prob ``[N]`` float32, top-k (values,
        indices) ``[N, k_max]`` or None when no row records one.
    """
    z = logits.float()
    n, v = z.shape
    dev = z.device
    hot = [r.temperature > 0 for r in rows]
    if any(hot):
        temp = torch.tensor([r.temperature if h else 1.0 for r, h in zip(rows, hot)], device=dev)
        zt = _truncate(z / temp[:, None],
                       [min(r.top_k, v) if h and r.top_k is not None else v for r, h in zip(rows, hot)],
                       [float(r.top_p) if h and r.top_p is not None else 1.0 for r, h in zip(rows, hot)])
        hot_t = torch.tensor(hot, device=dev)
        z = torch.where(hot_t[:, None], zt, z)
    logp_all = torch.log_softmax(z, dim=-1)
    tok = logp_all.argmax(-1)
    if any(hot):
        noise = [None] * n
        pooled = [i for i, (r, h) in enumerate(zip(rows, hot)) if h and r.generator is None]
        if pooled:
            block = torch.empty(len(pooled), v, device=dev).exponential_(1, generator=shared)
            for j, i in enumerate(pooled):
                noise[i] = block[j]
        for i, (r, h) in enumerate(zip(rows, hot)):
            if h and r.generator is not None:
                noise[i] = torch.empty(v, device=dev).exponential_(1, generator=r.generator)
        ones = torch.ones(v, device=dev)
        drawn = (logp_all.exp() / torch.stack([ones if e is None else e for e in noise])).argmax(-1)
        tok = torch.where(hot_t, drawn, tok)
    k = min(max((r.logprobs for r in rows), default=0), v)
    top = logp_all.topk(k, dim=-1) if k > 0 else None
    return tok, logp_all.gather(1, tok[:, None]).squeeze(1), top
