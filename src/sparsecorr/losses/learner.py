r"""The learner side of ``sparse_grpo``: which tokens the loss keeps (a finite
\(\text{logp} - \text{old\_logp}\), a finite reference and advantage) and the buffers it works
in, taken from the batch's ``Mismatch`` record when the call built it."""

from __future__ import annotations

import math

import torch

from .._checks import count_int, finite, finite_in, finite_in_scratch, host_all_finite
from .._masks import and_rows, float_into_, row_any
from ..mismatch import Mismatch

__all__ = ["advantages_kept", "learner_raw", "learner_side"]


def advantages_kept(advantages: torch.Tensor, kept: torch.Tensor):
    """Float32 advantages (``[B, 1]`` or ``[B, T]``), 0 where non-finite; kept minus those
    rows / tokens (a new mask: ``kept`` may be the caller's); a function giving ``(count,
    coef, offset)`` of the rows with a non-finite advantage (``offset + coef * count``)."""
    adv = advantages.detach().float()
    if adv.dim() == 1 or adv.shape[1] == 1:
        adv = adv.reshape(-1, 1)
    if host_all_finite(adv):
        # nothing to count: a zero all the same (a metric plan's layout must not depend on the data)
        return adv, kept, lambda: (torch.zeros((), device=adv.device), 1.0, 0.0)
    ok = finite(adv)
    if adv.shape[1] == 1:
        return (adv.nan_to_num(0.0, 0.0, 0.0), and_rows(kept, ok.reshape(-1)),
                lambda: (count_int(ok), -1.0, float(ok.shape[0])))  # B - finite rows
    bad = kept & ~ok
    return (adv.nan_to_num(0.0, 0.0, 0.0), kept & ok,
            lambda: (count_int(row_any(bad)), 1.0, 0.0))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def learner_raw(logp: torch.Tensor, old_logp: torch.Tensor, own: Mismatch | None,
                weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 ``logp - old_logp`` (detached) and a spare ``[B, T]`` float32 buffer or None.
    With ``own``, a record this call built and has finished reading, both are its buffers
    (``Mismatch.take_buffers``): two fresh ``[B, T]`` buffers fewer, whose first writes cost
    as much as the arithmetic on the CPU. Not when the correction's weights live in the
    log-ratio's storage; the spare is never one that anything else holds (``take_buffers``
    checks it: a hand-made correction may return ``mm.valid_f`` itself)."""
    lp, old = logp.detach(), old_logp.detach()
    if own is None or lp.dtype != torch.float32 or old.dtype != torch.float32:
        return lp.float() - old.float(), None
    if weights is not None and _shares_memory(weights, own.log_ratio):
        return lp - old, None
    a, b = own.take_buffers()
    return torch.sub(lp, old, out=a), b


def learner_side(raw: torch.Tensor, base: torch.Tensor, ref_logp: torch.Tensor | None,
                 advantages: torch.Tensor, buf: torch.Tensor | None = None):
    """The loss's tokens from ``base``: those with a finite ``raw = logp - old_logp`` (and
    ``ref_logp``) and a finite advantage. Returns ``kept``, its float mask, ``raw`` in place as
    the log-ratio (0 off ``kept``), the log-ratio's sum or None, and ``advantages_kept``' outputs.
    ``buf``: a free float32 buffer of ``raw``'s shape for the float mask (else a fresh one).
    On the CPU ``raw`` is masked first (a NaN or ±inf stays non-finite) and summed once: a
    finite sum means nothing to drop, and it is the kept tokens' sum the PPO metric reads."""
    lr_sum = None
    if raw.device.type == "cpu" and raw.shape == base.shape:
        kept_f = float_into_(torch.empty_like(raw) if buf is None else buf, base)
        total = raw.mul_(kept_f).sum()
        kept = base if math.isfinite(total.item()) else finite_in(raw, base)
        lr_sum = total if kept is base else None
    else:
        kept, kept_f = finite_in_scratch(raw, base)  # the buffer is filled below
    if ref_logp is not None:
        kept = finite_in(ref_logp, kept)
    adv, kept, bad_adv = advantages_kept(advantages, kept)
    if kept is not base or lr_sum is None:  # something dropped, or no host test: mask again
        float_into_(kept_f, kept)
        raw.nan_to_num_(0.0, 0.0, 0.0).mul_(kept_f)
        lr_sum = None
    return kept, kept_f, raw, lr_sum, adv, bad_adv
