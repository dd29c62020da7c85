r"""How per-token losses become one scalar: the four aggregation modes of the RL trainers.

With \(\ell_{i,t}\) the per-token loss, \(m_{i,t}\) the mask (after rejection), \(n_i = \sum_t
m_{i,t}\), \(N = \sum_i n_i\), \(S = |\{i : n_i > 0\}|\) and \(L\) a fixed length:

| mode | formula | used by |
|---|---|---|
| ``token-mean`` | \(\frac{1}{N}\sum_{i,t} m_{i,t}\,\ell_{i,t}\) | DAPO, verl default, OpenRLHF ``token_level_loss=True``, TRL ``dapo``/``bnpo`` |
| ``seq-mean-token-mean`` | \(\frac{1}{S}\sum_i \frac{1}{n_i}\sum_t m_{i,t}\,\ell_{i,t}\) | GRPO paper, Sparse-RL, TRL ``grpo``, OpenRLHF ``token_level_loss=False`` |
| ``seq-mean-token-sum`` | \(\frac{1}{S}\sum_i \sum_t m_{i,t}\,\ell_{i,t}\) | verl ``seq-mean-token-sum`` |
| ``seq-mean-token-sum-norm`` | \(\frac{1}{S}\sum_i \frac{1}{L}\sum_t m_{i,t}\,\ell_{i,t}\) | Dr. GRPO (Liu et al. 2025), TRL ``dr_grpo`` |

Every mode is a weighted sum \(\sum_{i,t} c_{i,t}\,\ell_{i,t}\);
[`aggregation_coefficients`][sparsecorr.losses.aggregation_coefficients] returns \(c\)
and [`row_scales`][sparsecorr.losses.aggregation.row_scales] the \(r_i\) of \(c_{i,t} = m_{i,t} r_i\). Rows with
no valid token are skipped (they count in neither \(N\) nor \(S\)). Data-parallel callers pass
the *global* \(N\) (``num_tokens``) or \(S\) (``num_sequences``) so that the per-rank losses sum
to the loss of the whole batch (the per-sequence \(n_i\) is always local: a sequence lives on one
rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import check_choice, check_float_tensor, check_mask, check_number, count
from .._masks import total

__all__ = ["AGGREGATIONS", "Aggregation", "aggregate", "aggregation_coefficients", "row_scales"]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_count(name: str, value: object) -> None:
    """A normaliser is None, a finite number >= 0, or a 1-element tensor."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected a number or a 1-element tensor, got shape {tuple(value.shape)}")
        return
    check_number(name, value, low=0)


def _count(value: float | int | torch.Tensor | None, default: torch.Tensor, name: str) -> torch.Tensor:
    """The normaliser as a 0-d float32 tensor. A tensor that is NaN, ±inf or negative cannot be
    refused without a host sync: the local count ``default`` is used instead (``sparse_grpo``
    reports it as ``loss/normalizer_fallback``)."""
    _check_count(name, value)
    if value is None:
        return default
    if isinstance(value, torch.Tensor):
        v = value.reshape(()).to(device=default.device, dtype=torch.float32)
        return torch.where((v >= 0) & (v < math.inf), v, default)
    return torch.tensor(float(value), device=default.device)


def _inverse(n: torch.Tensor) -> torch.Tensor:
    """``1 / n``, and 0 for ``n = 0`` (nothing to normalise: every row is empty)."""
    return torch.where(n > 0, 1.0 / n.clamp(min=1e-30), 0.0)


@dataclass(frozen=True)
class Aggregation:
    r"""An aggregation mode with its normalisers (see the module table).

    Attributes:
        mode: one of ``AGGREGATIONS``.
        num_tokens: global \(N\) for ``token-mean`` over data-parallel ranks (and gradient
            accumulation windows); default: the local kept count.
        num_sequences: global \(S\) for the ``seq-mean-*`` modes; default: local non-empty rows.
            Pass the number of rows ``B`` to count empty rows as 0 (TRL's ``grpo``, Dr. GRPO).
        norm_length: \(L\) of ``seq-mean-token-sum-norm`` (default ``T``).
    """

    mode: str = "token-mean"
    num_tokens: float | torch.Tensor | None = None
    num_sequences: float | torch.Tensor | None = None
    norm_length: float | None = None

    def __post_init__(self) -> None:
        check_choice("aggregation", self.mode, AGGREGATIONS)
        _check_count("num_tokens", self.num_tokens)
        _check_count("num_sequences", self.num_sequences)
        check_number("norm_length", self.norm_length, low=0, low_open=True, allow_none=True)

    def row_scales(self, mask: torch.Tensor, *, tokens: torch.Tensor | None = None) -> torch.Tensor:
        r"""Row scales \(r_i\) (``row_scales`` with this mode and normalisers): ``[B]``, or
        ``[1]`` when ``tokens`` (the mask's count, saves a pass) gives every row the same
        scale (sum rows with [`scaled_sum`][sparsecorr.losses.aggregation.scaled_sum])."""
        if self.mode == "token-mean" and self.num_tokens is None and tokens is not None:
            # a count: 0 means every row is empty, when any finite scale gives the same loss
            return tokens.clamp(min=1.0).reciprocal().reshape(1)
        return row_scales(mask, mode=self.mode, num_tokens=self.num_tokens,
                          num_sequences=self.num_sequences, norm_length=self.norm_length)

    def normalizer_fallback(self) -> torch.Tensor | None:
        """0-d: 1.0 when a tensor normaliser was non-finite or negative (replaced by the local
        count), else 0.0; None when no tensor normaliser was given."""
        bad = [((v < 0) | ~(v.abs() < math.inf)).reshape(()) for v in (self.num_tokens, self.num_sequences)
               if isinstance(v, torch.Tensor)]
        return None if not bad else torch.stack(bad).any().float()


def scaled_sum(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    r"""0-d \(\sum_i r_i \sum_t x_{i,t}\) for ``[B]`` or ``[1]`` row scales ``r``."""
    if scales.numel() == 1:
        return (total(x) * scales).reshape(())
    return (x.sum(dim=1) * scales).sum()


def row_scales(
    mask: torch.Tensor,
    *,
    mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    r"""Per-row scale \(r_i\) with \(c_{i,t} = m_{i,t}\, r_i\) (every mode is a row-scaled sum).

    Args:
        mask: bool, True = the token counts (rejected tokens already removed).
        mode: one of `AGGREGATIONS`.
        num_tokens: global \(N\) for ``token-mean`` (default: ``mask.sum()``).
        num_sequences: global \(S\) for the ``seq-mean-*`` modes (default: local non-empty rows).
        norm_length: \(L\) for ``seq-mean-token-sum-norm`` (default: ``T``, the padded length;
            pass the generation budget to match Dr. GRPO exactly).

    Shapes:
        mask: ``[B, T]`` -> ``[B]`` float32.
    """
    check_choice("aggregation", mode, AGGREGATIONS)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"mask: expected a [B, T] bool tensor, got {getattr(mask, 'dtype', type(mask))} "
                         f"of shape {tuple(getattr(mask, 'shape', ()))}")
    b = mask.shape[0]
    if mode == "token-mean":
        n = _count(num_tokens, count(mask), "num_tokens")
        return _inverse(n).expand(b)
    n_i = count(mask, dim=1)
    s = _count(num_sequences, (n_i > 0).float().sum(), "num_sequences")
    if mode == "seq-mean-token-mean":
        return torch.where(s > 0, 1.0 / (n_i.clamp(min=1.0) * s.clamp(min=1e-30)), 0.0)
    if mode == "seq-mean-token-sum":
        return _inverse(s).expand(b)
    check_number("norm_length", norm_length, low=0, low_open=True, allow_none=True)
    length = float(max(mask.shape[1], 1)) if norm_length is None else float(norm_length)
    return _inverse(length * s).expand(b)


def aggregation_coefficients(
    mask: torch.Tensor,
    *,
    mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    r"""Per-token coefficients \(c_{i,t}\) with ``loss = (c * token_loss).sum()`` (module table).

    Arguments as in `row_scales`.

    Shapes:
        mask: ``[B, T]`` -> ``[B, T]`` float32 (0 where mask is False).
    """
    r = row_scales(mask, mode=mode, num_tokens=num_tokens, num_sequences=num_sequences,
                   norm_length=norm_length)
    return mask.float() * r[:, None]


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss to a scalar with one of the `AGGREGATIONS` modes.

    Masked positions are ignored even if they hold NaN/inf.

    Shapes:
        token_loss, mask: ``[B, T]`` -> ``[]`` float32.
    """
    check_float_tensor("token_loss", token_loss, ndim=2)
    check_mask(mask, token_loss)
    r = row_scales(mask, mode=mode, num_tokens=num_tokens, num_sequences=num_sequences,
                   norm_length=norm_length)
    return (torch.where(mask, token_loss.float(), 0.0).sum(dim=1) * r).sum()
