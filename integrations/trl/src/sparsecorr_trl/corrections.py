"""What the trainer needs to know about a correction object, found by walking it.

- `with_group`: a correction such as ``sparse_rl()`` normalises its weights to mean 1 over
  "the batch"; under ``accelerate launch`` each process holds a shard, so ``SparseGRPOTrainer``
  hands every such statistic the world process group: the weights are then those of the whole
  global batch, and the multi-process loss equals the single-process one.
- `needs_acceptance`: ``sparse_tail(...)`` (``TailReject``) reads the per-token acceptance
  rate, which the trainer computes only when something reads it (it costs a dense forward
  with full logits).
"""

from __future__ import annotations

import dataclasses

__all__ = ["needs_acceptance", "with_group"]


def _bind(value, group):
    if isinstance(value, tuple):
        new = tuple(_bind(v, group) for v in value)
        return value if all(a is b for a, b in zip(new, value, strict=True)) else new
    return with_group(value, group)


def with_group(correction, group):
    """A copy of ``correction`` in which every (nested) dataclass field ``group`` left at
    ``None`` is ``group``; the correction itself when there is nothing to bind.

    Args:
        correction: a correction object (``chain(...)``, a preset), or anything else (returned
            as is).
        group: a ``torch.distributed`` process group, or None (returns ``correction``).
    """
    if group is None or not dataclasses.is_dataclass(correction) or isinstance(correction, type):
        return correction
    changes = {}
    for f in dataclasses.fields(correction):
        value = getattr(correction, f.name)
        if f.name == "group":
            if value is None:
                changes["group"] = group
            continue
        bound = _bind(value, group)
        if bound is not value:
            changes[f.name] = bound
    return dataclasses.replace(correction, **changes) if changes else correction


def _children(obj):
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return []
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out.extend(value if isinstance(value, tuple) else [value])
    return out


def needs_acceptance(correction) -> bool:
    """True when ``correction`` contains a tail rejection (``TailReject``: ``sparse_tail``)."""
    from sparsecorr.correction.presets import TailReject

    if isinstance(correction, TailReject):
        return True
    return any(needs_acceptance(c) for c in _children(correction))
