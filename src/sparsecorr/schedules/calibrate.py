"""``calibrate``: measure the tail acceptance of candidate budgets on a model, per length bin.

For each budget, rollouts are generated with `sparsecorr.decoding` (by the sparse policy,
or by the dense model with ``sample_with="dense"``), the other side's distribution is obtained at
the same positions by teacher forcing, and the per-token acceptance
(`sparsecorr.mismatch.acceptance_rate_topk`, exact when ``logprobs_topk`` covers the
vocabulary) fills the table over bins of total context length.

**Validation first.** Every argument is checked, and ``out`` proven writable, before the first
rollout: a bad ``q`` or an unwritable directory fails in milliseconds, not after a budget.

**Resume.** With ``out``, the table is saved atomically after every budget, and a rerun with
the same ``out`` resumes. When `calibrate` returns, ``out/calibration.json`` holds the returned
table. The file records the settings the tokens were measured under; a rerun

- *extends* the table: budgets already done are kept (not recomputed), requested budgets not
  done yet are calibrated; a budget in the file that is neither done nor requested is dropped
  (it holds no data);
- *re-reads* it at a new ``q``: the table keeps full histograms, so a different tail level is
  exact without recomputation; the file is re-written at the new ``q`` (atomically) even when no
  budget is left to measure;
- *refuses* (``ValueError`` naming each differing setting, file untouched) when ``bin_size``,
  ``n_bins``, the policy, ``sample_with``, ``max_new_tokens``, ``samples_per_prompt``,
  ``temperature``, ``logprobs_topk``, ``seed`` or the prompts differ: tokens measured under
  other settings cannot be mixed. Use another ``out`` or delete the file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .._checks import (
    check_choice,
    check_int,
    check_int_list,
    check_int_tensor,
    check_number,
    check_probability,
)
from .._io import check_writable_dir
from ..mismatch import acceptance_rate_topk
from .table import CalibrationTable, check_table_size

if TYPE_CHECKING:  # decoding is imported lazily at call time
    from ..decoding import KVPolicy

__all__ = ["CalibrationPlan", "calibrate", "plan_calibration"]

#: settings recorded in ``meta`` that a resumed run must share with the file
RESUME_SETTINGS = ("policy", "sample_with", "max_new_tokens", "samples_per_prompt", "temperature",
                   "logprobs_topk", "seed", "prompts")


def calibrate(model: torch.nn.Module, prompts: torch.Tensor, *, policy: KVPolicy, budgets: list[int], bin_size: int = 2000,
              n_bins: int = 20, q: float = 0.05, max_new_tokens: int, samples_per_prompt: int = 1,
              sample_with: str = "sparse", attention_mask: torch.Tensor | None = None,
              temperature: float = 1.0, logprobs_topk: int = 20, seed: int = 0,
              out: str | Path | None = None, progress: bool = False) -> CalibrationTable:
    """Fill a `CalibrationTable` for ``budgets`` (see the module docstring for resume rules).

    Args:
        model: a causal LM (Hugging Face transformers).
        prompts: prompt token ids (left-padded when ``attention_mask`` is given).
        policy: the sparse KV policy (`sparsecorr.decoding`).
        budgets: candidate budgets, positive ints.
        bin_size: tokens of total context per bin (Sparrow: 2,000).
        n_bins: number of bins (Sparrow: 20).
        q: tail level in [0, 1] (Sparrow: 0.05).
        max_new_tokens: generated tokens per rollout.
        samples_per_prompt: rollouts per prompt.
        sample_with: ``"sparse"`` (the sparse policy samples, the dense model is teacher-forced)
            or ``"dense"``.
        attention_mask: ``[B, P]`` 0/1 or bool mask of ``prompts``.
        temperature: sampling temperature, finite and > 0.
        logprobs_topk: top-k log-probs kept per position for the acceptance bound.
        seed: sampling seed (the same for every budget).
        out: directory for ``calibration.json`` (resumable); checked writable up front.
        progress: show a progress bar.

    Shapes:
        prompts, attention_mask: ``[B, P]`` (repeated ``samples_per_prompt`` times).
    """
    from ..decoding import Dense, generate, teacher_forced_logprobs

    plan = plan_calibration(prompts, policy=policy, budgets=budgets, bin_size=bin_size,
                            n_bins=n_bins, q=q, max_new_tokens=max_new_tokens,
                            samples_per_prompt=samples_per_prompt, sample_with=sample_with,
                            attention_mask=attention_mask, temperature=temperature,
                            logprobs_topk=logprobs_topk, seed=seed, out=out)
    table, path = plan.table, plan.path
    ids = prompts.repeat_interleave(samples_per_prompt, 0)
    am = None if attention_mask is None else attention_mask.repeat_interleave(samples_per_prompt, 0)
    for budget in tqdm(plan.todo, disable=not progress, desc="calibrate"):
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
        table.meta["done"].append(budget)
        if path is not None:
            table.save(path)
    if path is not None and not plan.todo:
        table.save(path)  # nothing measured: the file still gets the new q (and drops empty budgets)
    return table


@dataclass(frozen=True)
class CalibrationPlan:
    """What `calibrate` will do, decided before any rollout.

    Attributes:
        table: the table to fill (fresh, or resumed from ``path`` with the done budgets).
        path: ``out/calibration.json`` (None without ``out``).
        reused: budgets already done in the file (not recomputed).
        todo: budgets still to calibrate, in order.
    """

    table: CalibrationTable
    path: Path | None
    reused: list[int]
    todo: list[int]


def plan_calibration(prompts: torch.Tensor, *, policy: KVPolicy, budgets: list[int], bin_size: int = 2000,
                     n_bins: int = 20, q: float = 0.05, max_new_tokens: int,
                     samples_per_prompt: int = 1, sample_with: str = "sparse",
                     attention_mask: torch.Tensor | None = None, temperature: float = 1.0,
                     logprobs_topk: int = 20, seed: int = 0,
                     out: str | Path | None = None) -> CalibrationPlan:
    """Validate `calibrate`'s arguments, check ``out`` and apply the resume rules, without a
    model: what a command runs before loading anything expensive. Same arguments as
    `calibrate` (minus ``model`` and ``progress``)."""
    settings = _validated_settings(prompts, policy=policy, budgets=budgets, bin_size=bin_size,
                                   n_bins=n_bins, q=q, max_new_tokens=max_new_tokens,
                                   samples_per_prompt=samples_per_prompt, sample_with=sample_with,
                                   attention_mask=attention_mask, temperature=temperature,
                                   logprobs_topk=logprobs_topk, seed=seed)
    path = None if out is None else check_writable_dir("out", out) / "calibration.json"
    if path is not None and path.is_dir():
        raise ValueError(f"out: {path} is a directory, expected the calibration table file")
    table = CalibrationTable(budgets=list(budgets), bin_size=bin_size, n_bins=n_bins, q=q,
                             meta={**settings, "done": []})
    if path is not None and path.exists():
        table = _resume(path, settings, budgets=list(budgets), bin_size=bin_size, n_bins=n_bins, q=q)
    done = list(table.meta["done"])
    return CalibrationPlan(table=table, path=path, reused=done,
                           todo=[b for b in table.budgets if b not in done])


def _validated_settings(prompts: Any, *, policy: Any, budgets: Any, bin_size: Any, n_bins: Any,
                        q: Any, max_new_tokens: Any, samples_per_prompt: Any, sample_with: Any,
                        attention_mask: Any, temperature: Any, logprobs_topk: Any,
                        seed: Any) -> dict[str, Any]:
    """Check every argument (before any work) and return the settings recorded for resume."""
    check_int_tensor("prompts", prompts, ndim=2)
    if prompts.shape[0] == 0 or prompts.shape[1] == 0:
        raise ValueError(f"prompts: expected at least one non-empty prompt, got shape {tuple(prompts.shape)}")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != prompts.shape:
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask: expected shape {tuple(prompts.shape)}, got {got}")
    check_int_list("budgets", budgets)
    check_int("bin_size", bin_size, low=1)
    check_int("n_bins", n_bins, low=1)
    check_table_size(len(set(budgets)), n_bins)
    check_probability("q", q)
    check_int("max_new_tokens", max_new_tokens, low=1)
    check_int("samples_per_prompt", samples_per_prompt, low=1)
    check_choice("sample_with", sample_with, ("sparse", "dense"))
    check_number("temperature", temperature, low=0, low_open=True)
    check_int("logprobs_topk", logprobs_topk, low=1)
    check_int("seed", seed, low=0)
    if policy is None:
        raise ValueError("policy: expected a KV policy from sparsecorr.decoding, got None")
    digest = hashlib.sha256(prompts.detach().cpu().long().numpy().tobytes())
    digest.update(str(tuple(prompts.shape)).encode())
    if attention_mask is not None:
        digest.update(attention_mask.detach().cpu().long().numpy().tobytes())
    return {"policy": repr(policy), "sample_with": sample_with, "max_new_tokens": max_new_tokens,
            "samples_per_prompt": samples_per_prompt, "temperature": float(temperature),
            "logprobs_topk": logprobs_topk, "seed": seed, "prompts": digest.hexdigest()[:16]}


def _resume(path: Path, settings: dict[str, Any], *, budgets: list[int], bin_size: int,
            n_bins: int, q: float) -> CalibrationTable:
    """The table to continue from ``path`` (rules in the module docstring)."""
    old = CalibrationTable.load(path)
    diffs = [f"{k}: {getattr(old, k)} in the file, {v} now"
             for k, v in (("bin_size", bin_size), ("n_bins", n_bins)) if getattr(old, k) != v]
    diffs += [f"{k}: {old.meta[k]!r} in the file, {v!r} now"
              for k, v in settings.items() if k in old.meta and old.meta[k] != v]
    if diffs:
        raise ValueError(f"out: {path} was calibrated with other settings ({'; '.join(diffs)}); "
                         "resuming would mix incomparable tokens: use another out directory or "
                         "remove the file")
    done = old.meta.get("done", [])
    if not isinstance(done, list) or any(b not in old.budgets for b in done):
        raise ValueError(f"meta.done: expected a list of budgets of the table, got {done!r} "
                         f"(in the calibration table {path})")
    # done budgets keep their sketches; budgets neither done nor requested (no data) are dropped
    return CalibrationTable(budgets=sorted(set(done) | set(budgets)), bin_size=bin_size,
                            n_bins=n_bins, q=q, meta={**old.meta, **settings, "done": list(done)},
                            sketches={b: old.sketches[b] for b in done})
