"""Hypothesis strategies for ``[B, T]`` log-prob tensors with bool masks.

Tensors are generated from a drawn seed (fast, and shrinking still reduces shapes and flags),
covering fp32/bf16, all-masked rows, T = 1, extreme values (±50) and, when asked for,
NaN/inf sprinkled into the rollout log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

__all__ = ["LogpBatch", "logp_batches", "masks", "shapes"]


@dataclass(frozen=True)
class LogpBatch:
    """``old_logp``, ``rollout_logp`` and ``logp`` ``[B, T]`` with a bool ``mask`` ``[B, T]``."""

    old_logp: torch.Tensor
    rollout_logp: torch.Tensor
    logp: torch.Tensor
    mask: torch.Tensor
    seed: int

    @property
    def log_ratio_raw(self) -> torch.Tensor:
        return self.old_logp.float() - self.rollout_logp.float()


def shapes(*, max_b: int = 6, max_t: int = 24) -> st.SearchStrategy[tuple[int, int]]:
    """``(B, T)`` with B >= 1 and T >= 1 (T = 1 included)."""
    return st.tuples(st.integers(1, max_b), st.integers(1, max_t))


@st.composite
def masks(draw: st.DrawFn, shape: tuple[int, int], *, allow_empty_rows: bool = True) -> torch.Tensor:
    """A bool mask of ``shape``: right-padded ragged rows, optionally holes, optionally empty rows."""
    b, t = shape
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lo = 0 if allow_empty_rows else 1
    lengths = torch.randint(lo, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if draw(st.booleans()):  # holes inside rows (e.g. tool-output tokens masked out)
        mask &= torch.rand(b, t, generator=g) > 0.2
    if allow_empty_rows and b > 1 and draw(st.booleans()):
        mask[draw(st.integers(0, b - 1))] = False
    if not allow_empty_rows:
        mask[:, 0] = True
    return mask


@st.composite
def logp_batches(
    draw: st.DrawFn,
    *,
    max_b: int = 6,
    max_t: int = 24,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    scale: float | None = None,
    extreme: bool = True,
    nonfinite: bool = False,
    allow_empty_rows: bool = True,
    zero_mismatch: bool = False,
) -> LogpBatch:
    """A batch of three-policy log-probs.

    Args:
        scale: standard deviation of the rollout-vs-old log-ratio; drawn when None.
        extreme: sprinkle values at ±50 into the log-ratio (far outside any clamp).
        nonfinite: sprinkle NaN / +inf / -inf into ``rollout_logp``.
        zero_mismatch: ``rollout_logp == old_logp`` exactly.
    """
    b, t = draw(shapes(max_b=max_b, max_t=max_t))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = draw(masks((b, t), allow_empty_rows=allow_empty_rows))
    sd = draw(st.sampled_from([0.01, 0.1, 0.5, 1.0, 3.0])) if scale is None else scale
    old = -torch.rand(b, t, generator=g) * 6.0
    noise = torch.randn(b, t, generator=g) * sd
    if extreme and draw(st.booleans()):
        spots = torch.rand(b, t, generator=g) < 0.05
        signs = torch.where(torch.rand(b, t, generator=g) < 0.5, -50.0, 50.0)
        noise = torch.where(spots, signs, noise)
    rollout = old.clone() if zero_mismatch else old - noise
    logp = old + torch.randn(b, t, generator=g) * 0.1
    if nonfinite and draw(st.booleans()):
        spots = torch.rand(b, t, generator=g) < 0.1
        kinds = torch.randint(0, 3, (b, t), generator=g)
        bad = torch.tensor([float("nan"), float("inf"), float("-inf")])[kinds]
        rollout = torch.where(spots, bad, rollout)
    # padded positions hold garbage: results must not depend on it
    pad = ~mask
    old = torch.where(pad, torch.randn(b, t, generator=g) * 100, old)
    rollout = torch.where(pad, torch.randn(b, t, generator=g) * 100, rollout)
    return LogpBatch(
        old_logp=old.to(dtype),
        rollout_logp=rollout.to(dtype),
        logp=logp.to(dtype),
        mask=mask,
        seed=seed,
    )
