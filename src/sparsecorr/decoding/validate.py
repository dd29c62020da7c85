"""Argument checks of ``generate`` / ``teacher_forced_logprobs``, run before any model work.

Every bad input raises a ``ValueError`` naming the argument, what was expected and what was
given (sparsecorr's contract; see the guarantees in the decoding guide).
"""

from __future__ import annotations

import torch

from .._checks import check_int, check_number, is_int
from .hf import config_vocab_size
from .policies import KVPolicy

__all__ = ["budget_table", "check_run_args", "check_sampling", "check_token_ids", "clamp_topk", "vocab_size"]


def check_sampling(*, temperature: object, top_k: object, top_p: object) -> None:
    """``temperature`` finite >= 0 (0 = greedy); ``top_k`` None or an int >= 1; ``top_p`` None
    or a number in (0, 1] (1 = no truncation)."""
    check_number("temperature", temperature, low=0, why=" (0 = greedy)")
    check_int("top_k", top_k, low=1, allow_none=True, why=" (None = no truncation)")
    check_number("top_p", top_p, low=0, high=1, low_open=True, allow_none=True, why=" (1 = no truncation)")


def vocab_size(model) -> int:
    """Rows of the model's input embedding (the ids the model can read)."""
    emb = model.get_input_embeddings()
    return int(getattr(emb, "num_embeddings", None) or config_vocab_size(model))


def clamp_topk(model, logprobs_topk: int) -> int:
    """``logprobs_topk`` capped at the size ``V`` of the model's logits (the output embedding's
    rows, else the input vocabulary): a top-k of ``min(k, V)`` columns holds the whole
    distribution, so the acceptance computed from it is exact. Called after ``check_run_args``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    v = int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else vocab_size(model)
    return min(int(logprobs_topk), v)


def check_token_ids(name: str, ids: object, *, vocab: int, mask: torch.Tensor | None = None,
                    ndim: int = 2) -> torch.Tensor:
    """An integer tensor with ``ndim`` dims whose (masked-in) ids lie in ``[0, vocab)``."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor of token ids, got dtype {ids.dtype}")
    if ids.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims [B, ...], got shape {tuple(ids.shape)}")
    real = ids if mask is None else ids[mask.to(ids.device)]
    if real.numel():
        lo, hi = int(real.min()), int(real.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{name}: expected token ids in [0, {vocab}) (the model's vocabulary), "
                             f"got values in [{lo}, {hi}]")
    return ids


def check_mask(name: str, mask: object, shape: tuple[int, ...]) -> torch.Tensor:
    """A 0/1 (bool or integer) mask of ``shape``, returned as bool."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise ValueError(f"{name}: expected a bool or 0/1 integer tensor, got dtype {mask.dtype}")
    if mask.dtype != torch.bool and mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name}: expected 0/1 values, got values in [{int(mask.min())}, {int(mask.max())}]")
    return mask.bool()


def check_run_args(*, policy: object, max_new_tokens: object, logprobs_topk: object,
                   eos_token_id: object, prefill_chunk: object) -> None:
    """The non-tensor arguments shared by ``generate`` and ``teacher_forced_logprobs``."""
    if not isinstance(policy, KVPolicy):
        raise ValueError(f"policy: expected a KVPolicy (Dense(), RKV(), ...), got {type(policy).__name__}")
    check_int("max_new_tokens", max_new_tokens, low=1)
    check_int("logprobs_topk", logprobs_topk, low=0, why=" (0 = none)")
    ids = [eos_token_id] if is_int(eos_token_id) else eos_token_id
    if eos_token_id is not None and (not isinstance(ids, (list, tuple, set)) or not all(is_int(x) for x in ids)):
        raise ValueError(f"eos_token_id: expected None, an int or a list of ints, got {eos_token_id!r}")
    check_int("prefill_chunk", prefill_chunk, low=1, allow_none=True, why=" (None = the whole prompt)")


def budget_table(budget: object, *, dense: bool, longest: int) -> torch.Tensor:
    """``table[c]`` = budget in force at context length ``c`` (``0 … longest``), -1 = dense.

    ``budget``: None (dense), an int >= 1, or an object with ``budget_at(context_len) -> int |
    None``, evaluated once per context length here (not once per row and step).
    """
    if dense or budget is None:
        return torch.full((longest + 1,), -1, dtype=torch.long)
    if is_int(budget):
        if budget < 1:
            raise ValueError(f"budget: expected a positive int, None or a schedule, got {budget!r}")
        return torch.full((longest + 1,), int(budget), dtype=torch.long)
    if not hasattr(budget, "budget_at"):
        raise ValueError(f"budget: expected an int or an object with budget_at(context_len), got "
                         f"{type(budget).__name__}")
    vals = [budget.budget_at(c) for c in range(longest + 1)]
    bad = [v for v in vals if v is not None and (not is_int(v) or v < 1)]
    if bad:
        raise ValueError(f"budget: budget_at must return None or an int >= 1, got {bad[0]!r}")
    return torch.tensor([-1 if v is None else int(v) for v in vals], dtype=torch.long)
