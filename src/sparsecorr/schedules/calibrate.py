"""``calibrate``: measure the tail acceptance of candidate budgets on a model, per length bin.

For each budget, rollouts are generated with `sparsecorr.decoding` (by the sparse policy,
or by the dense model with ``sample_with="dense"``), the other side's distribution is obtained at
the same positions by teacher forcing, and the per-token acceptance
(`acceptance_rate_topk`, exact when ``logprobs_topk`` covers the
vocabulary) fills the table over bins of total context length. The table is saved atomically
after every budget when ``out`` is given, and a rerun resumes after the budgets already done.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..mismatch import acceptance_rate_topk
from .table import CalibrationTable

__all__ = ["calibrate"]


def calibrate(model, prompts: torch.Tensor, *, policy, budgets: list[int], bin_size: int = 2000,
              n_bins: int = 20, q: float = 0.05, max_new_tokens: int, samples_per_prompt: int = 1,
              sample_with: str = "sparse", attention_mask: torch.Tensor | None = None,
              temperature: float = 1.0, logprobs_topk: int = 20, seed: int = 0,
              out: str | Path | None = None, progress: bool = False) -> CalibrationTable:
    """Fill a `CalibrationTable` for ``budgets`` (see the module docstring).

    Shapes:
        prompts, attention_mask: ``[B, P]`` (repeated ``samples_per_prompt`` times).
    """
    from ..decoding import Dense, generate, teacher_forced_logprobs

    if sample_with not in ("sparse", "dense"):
        raise ValueError(f"sample_with: expected 'sparse' or 'dense', got {sample_with!r}")
    path = None if out is None else Path(out) / "calibration.json"
    table = CalibrationTable(budgets=list(budgets), bin_size=bin_size, n_bins=n_bins, q=q,
                             meta={"policy": repr(policy), "sample_with": sample_with,
                                   "max_new_tokens": max_new_tokens, "done": []})
    if path is not None and path.is_file():
        table = CalibrationTable.load(path)  # resume
    ids = prompts.repeat_interleave(samples_per_prompt, 0)
    am = None if attention_mask is None else attention_mask.repeat_interleave(samples_per_prompt, 0)
    todo = [b for b in table.budgets if b not in table.meta.get("done", [])]
    for budget in tqdm(todo, disable=not progress, desc="calibrate"):
        gen = torch.Generator().manual_seed(seed)
        sampler = (policy, budget) if sample_with == "sparse" else (Dense(), None)
        other = (Dense(), None) if sample_with == "sparse" else (policy, budget)
        batch = generate(model, ids, am, policy=sampler[0], budget=sampler[1],
                         max_new_tokens=max_new_tokens, temperature=temperature,
                         logprobs_topk=logprobs_topk, generator=gen)
        forced = teacher_forced_logprobs(model, ids, batch.tokens, policy=other[0], budget=other[1],
                                         attention_mask=am, response_mask=batch.mask,
                                         temperature=temperature, logprobs_topk=logprobs_topk)
        acc = acceptance_rate_topk(batch.topk_logp, batch.topk_ids, forced.topk_logp, forced.topk_ids)
        table.add(budget, acc, batch.mask & forced.mask, batch.prompt_lengths)
        table.meta.setdefault("done", []).append(budget)
        if path is not None:
            table.save(path)
    return table
