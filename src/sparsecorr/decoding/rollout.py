"""``RolloutBatch``: what a sparse sampler produced, with everything the trainer needs.

``save`` writes **one** safetensors file, atomically: the tensors, and the rest (finish reasons,
peak KV bytes, ``meta``) as JSON in the file's own header metadata, so a reader sees the old
file or the new one, never a mix. ``load`` checks everything it reads (names, dtypes, shapes,
consistency of mask and lengths, the metadata fields) and raises a ``ValueError`` naming the path
and what is wrong; it also reads the earlier two-file format (``path`` + ``path.json``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .._io import atomic_write_bytes

__all__ = ["KeptAgreement", "KeptSets", "RolloutBatch", "blank_fields"]

FORMAT = "sparsecorr.RolloutBatch/2"
LEGACY_FORMAT = "sparsecorr.RolloutBatch/1"
FINISH_REASONS = ("eos", "length", "pruned", "empty")
# name -> (dtype, shape in terms of B, T, k)
_SPEC = {
    "tokens": (torch.long, "BT"), "mask": (torch.bool, "BT"), "lengths": (torch.long, "B"),
    "prompt_lengths": (torch.long, "B"), "rollout_logp": (torch.float32, "BT"),
    "topk_logp": (torch.float32, "BTk"), "topk_ids": (torch.long, "BTk"), "budget": (torch.long, "BT"),
    "kv_kept": (torch.float32, "BT"), "pruned": (torch.bool, "B"), "pruned_at": (torch.long, "B"),
}
_TENSORS = tuple(_SPEC)


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
        finish_reason: per row ``"eos"``, ``"length"``, ``"pruned"`` or ``"empty"`` (no prompt).
        peak_kv_bytes: largest KV cache in use during generation (bytes of the slots read by a
            forward, all layers; the preallocated pool is ``meta["kv_pool_bytes"]``). A model
            with sliding-window layers: full layers' slots plus each sliding layer's window
            union, split in ``meta["peak_kv"]``.
        pruned: ``[B]`` bool, stopped by a pruner.
        pruned_at: ``[B]`` generated length at which the row was pruned (-1 if not).
        meta: policy, backend, dtype, seed, sampling settings, prefill and decode wall time (s).
        kept_sets: the kept set of every compression event (`KeptSets`), when the call asked
            for them (``record_keep=True``); None otherwise. Not written by `save`.
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
    kept_sets: KeptSets | None = None

    def to(self, device: torch.device | str) -> RolloutBatch:
        return replace(self, **{k: getattr(self, k).to(device) for k in _TENSORS})

    def save(self, path: str | Path) -> Path:
        """Write ``path``: one safetensors file (tensors + JSON metadata), atomically."""
        path = Path(path)
        tensors = {k: getattr(self, k).detach().contiguous().cpu() for k in _TENSORS}
        b, t = self.tokens.shape
        dims = {"B": b, "T": t, "k": self.topk_ids.shape[-1]}
        info = {"format": FORMAT, "dims": json.dumps(dims), "finish_reason": json.dumps(list(self.finish_reason)),
                "peak_kv_bytes": str(int(self.peak_kv_bytes)), "meta": json.dumps(self.meta)}
        atomic_write_bytes(path, st_save(tensors, metadata=info))
        return path

    @classmethod
    def load(cls, path: str | Path) -> RolloutBatch:
        """Read a batch written by `save`; every field is checked (``ValueError`` naming
        the path and the problem)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"path: expected a file written by RolloutBatch.save, got {path} (no such file)")
        data = path.read_bytes()
        try:
            tensors, header = st_load(data), _header(data)
        except Exception as exc:  # safetensors' own error names neither the path nor the cause
            raise ValueError(f"path: {path} is not a complete safetensors file (truncated or not written "
                             f"by RolloutBatch.save): {exc}") from None
        info = _info(path, header)
        _check_tensors(path, tensors, info.pop("dims"))
        batch = cls(**{k: tensors[k] for k in _TENSORS}, **info)
        _check_consistent(path, batch)
        return batch


def _header(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]).get("__metadata__") or {}


def _info(path: Path, header: dict) -> dict:
    """finish_reason / peak_kv_bytes / meta from the header (or the legacy ``.json`` sidecar)."""
    if header.get("format") == FORMAT:
        try:
            info = {"finish_reason": json.loads(header["finish_reason"]), "dims": json.loads(header["dims"]),
                    "peak_kv_bytes": json.loads(header["peak_kv_bytes"]), "meta": json.loads(header["meta"])}
        except (KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"path: {path} has unreadable RolloutBatch metadata ({exc!r})") from None
    else:
        side = path.with_suffix(path.suffix + ".json")
        if header.get("format") is not None or not side.is_file():
            raise ValueError(f"path: {path} is not a RolloutBatch file (format {header.get('format')!r}, "
                             f"expected {FORMAT!r})")
        try:
            info = json.loads(side.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"path: {side} is not JSON ({exc})") from None
        if not isinstance(info, dict) or info.get("format") != LEGACY_FORMAT:
            raise ValueError(f"path: {side} is not a {LEGACY_FORMAT} sidecar")
    missing = [k for k in ("finish_reason", "peak_kv_bytes", "meta") if k not in info]
    if missing:
        raise ValueError(f"path: {path} has no field {missing[0]!r}")
    if not isinstance(info["finish_reason"], list) or not all(r in FINISH_REASONS for r in info["finish_reason"]):
        raise ValueError(f"path: {path}: finish_reason must be a list of {list(FINISH_REASONS)}")
    pk = info["peak_kv_bytes"]
    if isinstance(pk, bool) or not isinstance(pk, int) or pk < 0:
        raise ValueError(f"path: {path}: peak_kv_bytes must be an int >= 0, got {pk!r}")
    if not isinstance(info["meta"], dict):
        raise ValueError(f"path: {path}: meta must be a JSON object, got {type(info['meta']).__name__}")
    dims = info.get("dims")
    if dims is not None and (not isinstance(dims, dict) or set(dims) != {"B", "T", "k"}
                             or not all(isinstance(v, int) and v >= 0 for v in dims.values())):
        raise ValueError(f"path: {path}: dims must be {{'B', 'T', 'k'}} ints >= 0, got {dims!r}")
    return {"finish_reason": tuple(info["finish_reason"]), "peak_kv_bytes": pk, "meta": info["meta"], "dims": dims}


def _check_tensors(path: Path, tensors: dict[str, torch.Tensor], dims: dict | None) -> None:
    """Names, dtypes and shapes against the header's ``dims`` (legacy files: the tokens' shape)."""
    for k in _TENSORS:
        if k not in tensors:
            raise ValueError(f"path: {path} has no tensor {k!r}")
    extra = sorted(set(tensors) - set(_TENSORS))
    if extra:
        raise ValueError(f"path: {path} has unexpected tensors {extra}")
    if dims is None:
        dims = {"B": tensors["tokens"].shape[0] if tensors["tokens"].dim() == 2 else -1,
                "T": tensors["tokens"].shape[1] if tensors["tokens"].dim() == 2 else -1,
                "k": tensors["topk_ids"].shape[-1] if tensors["topk_ids"].dim() == 3 else -1}
    for k, (dtype, spec) in _SPEC.items():
        t = tensors[k]
        if t.dtype != dtype:
            raise ValueError(f"path: {path}: tensor {k!r} has dtype {t.dtype}, expected {dtype}")
        want = tuple(dims[c] for c in spec)
        if tuple(t.shape) != want:
            raise ValueError(f"path: {path}: tensor {k!r} has shape {tuple(t.shape)}, expected {want} "
                             f"({'x'.join(spec)})")


def _check_consistent(path: Path, b: RolloutBatch) -> None:
    n, t = b.tokens.shape
    if len(b.finish_reason) != n:
        raise ValueError(f"path: {path}: {len(b.finish_reason)} finish reasons for {n} rows")
    if bool(((b.lengths < 0) | (b.lengths > t)).any()):
        raise ValueError(f"path: {path}: lengths must lie in [0, {t}]")
    made = torch.arange(t)[None] < b.lengths[:, None]
    if not torch.equal(b.mask, made & ~b.pruned[:, None]):
        raise ValueError(f"path: {path}: mask does not match lengths and pruned")


def blank_fields(b: int, t: int, k: int, *, prompt_lengths: torch.Tensor) -> dict[str, Any]:
    """The fields of ``b`` rows that generated nothing (finish reason ``"empty"``)."""
    return dict(tokens=torch.zeros(b, t, dtype=torch.long), mask=torch.zeros(b, t, dtype=torch.bool),
                lengths=torch.zeros(b, dtype=torch.long), prompt_lengths=prompt_lengths.long(),
                rollout_logp=torch.zeros(b, t), topk_logp=torch.full((b, t, k), float("-inf")),
                topk_ids=torch.zeros(b, t, k, dtype=torch.long), budget=torch.full((b, t), -1, dtype=torch.long),
                kv_kept=torch.zeros(b, t), finish_reason=("empty",) * b, peak_kv_bytes=0,
                pruned=torch.zeros(b, dtype=torch.bool), pruned_at=torch.full((b,), -1, dtype=torch.long))



@dataclass(frozen=True)
class KeptAgreement:
    """How far two runs' kept sets agree, over the compression events both recorded.

    Attributes:
        events: (row, context length) events present in both runs.
        identical: fraction of (event, layer, KV head) whose kept sets are identical.
        jaccard: mean Jaccard index |A ∩ B| / |A ∪ B| over the same (event, layer, KV head).
    """

    events: int
    identical: float
    jaccard: float


@dataclass(frozen=True)
class KeptSets:
    """The kept set of every compression event of an eviction policy's run, by row and context.

    Event ``e`` is batch row ``rows[e]`` compressing at context length ``context[e]`` (prompt
    plus fed tokens); ``positions[e, l, h]`` lists the true positions layer ``l``'s KV head ``h``
    kept, ascending, padded with -1. On a model with sliding-window layers ``l`` runs over every
    layer: a sliding layer's entry lists the positions its ring holds inside the window of the
    last fed token (the last ``min(window, context)``); a replay forces the full layers' sets only. Keyed by (row, context), events are independent of how the
    engine batched and chunked the rows, so a teacher-forced replay can be given the decode's
    sets (``teacher_forced_logprobs(..., keep_sets=...)``) and then sees exactly the tokens the
    sampler saw: what is left between the two is numerics, not selection.

    ``K`` is a width, not a budget: each row's entries past the slots it kept (its budget at that
    context) are -1. A compression event keeps, in one call, ``min(top, S)`` columns for every
    row of the batch, where ``top`` is the largest of the due rows' budgets *and the not-due
    rows' whole counts* (a row that is not due keeps every slot it holds), and ``S`` the most
    slots a row holds; ``K`` is the widest event's. So ``K`` can exceed every budget (23 at
    budget 16: a batch-mate held 23 slots) and depends on the batching; the kept positions do not.

    Shapes:
        rows, context: ``[E]`` long; positions: ``[E, L, H_kv, K]`` long.
    """

    rows: torch.Tensor
    context: torch.Tensor
    positions: torch.Tensor

    def lookup(self) -> dict[tuple[int, int], torch.Tensor]:
        """``{(row, context): positions [L, H_kv, K]}``."""
        return {(r, c): self.positions[i] for i, (r, c) in enumerate(zip(self.rows.tolist(), self.context.tolist()))}

    def agreement(self, other: KeptSets) -> KeptAgreement:
        """Agreement with ``other`` over the events both recorded (see `KeptAgreement`)."""
        mine, theirs = self.lookup(), other.lookup()
        common = sorted(set(mine) & set(theirs))
        if not common:
            return KeptAgreement(events=0, identical=float("nan"), jaccard=float("nan"))
        a = torch.stack([mine[e] for e in common])
        b = torch.stack([theirs[e] for e in common])
        k = max(a.shape[-1], b.shape[-1])
        a = torch.nn.functional.pad(a, (0, k - a.shape[-1]), value=-1)
        b = torch.nn.functional.pad(b, (0, k - b.shape[-1]), value=-1)
        inter = ((a[..., :, None] == b[..., None, :]) & (a[..., :, None] >= 0)).sum((-1, -2))
        union = (a >= 0).sum(-1) + (b >= 0).sum(-1) - inter
        same = (a == b).all(-1)
        jac = torch.where(union > 0, inter / union.clamp(min=1), 1.0)
        return KeptAgreement(events=len(common), identical=float(same.float().mean()), jaccard=float(jac.mean()))


def kept_sets(events: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *, layers: int, heads: int) -> KeptSets:
    """Assemble recorded events ``(rows [n], context [n], positions [n, L, H, K])`` on the host."""
    if not events:
        return KeptSets(rows=torch.zeros(0, dtype=torch.long), context=torch.zeros(0, dtype=torch.long),
                        positions=torch.zeros(0, layers, heads, 0, dtype=torch.long))
    k = max(p.shape[-1] for _, _, p in events)
    pos = [torch.nn.functional.pad(p.cpu(), (0, k - p.shape[-1]), value=-1) for _, _, p in events]
    return KeptSets(rows=torch.cat([r for r, _, _ in events]), context=torch.cat([c for _, c, _ in events]),
                    positions=torch.cat(pos))
