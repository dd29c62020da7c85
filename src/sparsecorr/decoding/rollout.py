"""``RolloutBatch``: what a sparse sampler produced, with everything the trainer needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .._io import atomic_write_bytes, atomic_write_json

__all__ = ["RolloutBatch"]

_TENSORS = ("tokens", "mask", "lengths", "prompt_lengths", "rollout_logp", "topk_logp", "topk_ids",
            "budget", "kv_kept", "pruned", "pruned_at")


@dataclass(frozen=True)
class RolloutBatch:
    """Generated responses and their sparse-sampler statistics.

    Attributes:
        tokens: ``[B, T]`` response token ids (right-padded with 0).
        mask: ``[B, T]`` bool, True for generated tokens that count (pruned rows: all False).
        lengths: ``[B]`` generated tokens per row (pruned rows: tokens generated before pruning).
        prompt_lengths: ``[B]`` prompt tokens per row.
        rollout_logp: ``[B, T]`` float32 log-prob of each sampled token under the sparse policy,
            after temperature and top-k/top-p truncation (recorded in ``meta``).
        topk_logp: ``[B, T, k]`` float32 top-k log-probs of the same distribution.
        topk_ids: ``[B, T, k]`` their token ids.
        budget: ``[B, T]`` KV budget in force at each step (-1 = dense).
        kv_kept: ``[B, T]`` mean attended KV length (over layers and KV heads).
        finish_reason: per row ``"eos"``, ``"length"`` or ``"pruned"``.
        peak_kv_bytes: largest KV cache held during generation (bytes, all layers).
        pruned: ``[B]`` bool, stopped by a pruner.
        pruned_at: ``[B]`` generated length at which the row was pruned (-1 if not).
        meta: policy, backend, dtype, seed, sampling settings, prefill and decode wall time (s).
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    rollout_logp: torch.Tensor
    topk_logp: torch.Tensor
    topk_ids: torch.Tensor
    budget: torch.Tensor
    kv_kept: torch.Tensor
    finish_reason: tuple[str, ...]
    peak_kv_bytes: int
    pruned: torch.Tensor
    pruned_at: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> RolloutBatch:
        return replace(self, **{k: getattr(self, k).to(device) for k in _TENSORS})

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (safetensors: tensors) and ``path.json`` (the rest), atomically."""
        path = Path(path)
        tensors = {k: getattr(self, k).detach().contiguous().cpu() for k in _TENSORS}
        atomic_write_bytes(path, st_save(tensors))
        atomic_write_json(path.with_suffix(path.suffix + ".json"), {
            "finish_reason": list(self.finish_reason), "peak_kv_bytes": self.peak_kv_bytes,
            "meta": self.meta, "format": "sparsecorr.RolloutBatch/1"})
        return path

    @classmethod
    def load(cls, path: str | Path) -> RolloutBatch:
        """Read a batch written by `save` (validated: names the missing field)."""
        path = Path(path)
        side = path.with_suffix(path.suffix + ".json")
        if not path.is_file() or not side.is_file():
            raise ValueError(f"path: expected {path} and {side} written by RolloutBatch.save")
        tensors = st_load(path.read_bytes())
        info = json.loads(side.read_text())
        for k in _TENSORS:
            if k not in tensors:
                raise ValueError(f"path: {path} has no tensor {k!r}")
        for k in ("finish_reason", "peak_kv_bytes", "meta"):
            if k not in info:
                raise ValueError(f"path: {side} has no field {k!r}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in tensors.items() if k in names},
                   finish_reason=tuple(info["finish_reason"]),
                   peak_kv_bytes=int(info["peak_kv_bytes"]), meta=info["meta"])
