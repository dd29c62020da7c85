r"""The decoding backend interface: attention of new queries over the kept (or selected) KV.

The engine owns the cache, the policies and sampling; a backend only computes

\[ o = \mathrm{softmax}\big(s \, q k^\top + \log \mathbb{1}[\text{allowed}]\big)\, v \]

for each query head over the KV slots it may attend to (GQA: query head ``h`` reads KV head
``h // G``), with two optional variants: ``softcap`` \(c\) replaces the scaled logits by
\(c \tanh(\ell / c)\) before the mask (Gemma 2), and ``sinks`` \(s_h\) (one logit per query
head, natural-log units) joins the softmax denominator with no value (GPT-OSS):
\(o = \sum_j e^{\ell_j} v_j / (\sum_j e^{\ell_j} + e^{s_h})\). ``torch`` runs it with ``scaled_dot_product_attention`` in the model's dtype (CPU
and CUDA), ``reference`` in float32 with explicit einsums (the oracle), and the FlashInfer
backend (GPU) runs decode steps through paged kernels (`.paged`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch.nn.attention.bias import CausalBias

__all__ = ["AttentionBackend", "DeclaredBackend", "PagedCapable", "check_backend"]


class AttentionBackend(Protocol):
    """What a decoding backend implements.

    ``allowed`` is ``None`` (every slot), a ``torch.nn.attention.bias.CausalBias`` (causal,
    aligned to the last slot: a chunk of full rows at one length) or a bool mask broadcastable
    to ``[B, H_kv, Q, S]`` (the engine passes ``[B, 1, Q, S]`` when every KV head reads the same
    slots); a backend that declares ``additive_mask = True`` (``torch``) may instead get a
    single-token step's mask as a float bias in the query's dtype (0 allowed, ``-inf`` not), made
    once per step and shared by every layer. A backend that declares ``paged = True`` also
    implements `PagedCapable` (as
    [`PagedBackend`][sparsecorr.decoding.backends.paged.PagedBackend] does) and reads
    single-token decode steps through page tables instead.

    The capabilities are declared, not probed: every built-in backend sets ``name``, ``paged``
    and ``additive_mask``, and `check_backend` checks a user's object once, where the engine
    gets it; nothing later asks the backend what it has.

    Shapes:
        query: ``[B, H_q, Q, D]``; key, value: ``[B, H_kv, S, D]``; sinks: ``[H_q]`` -> output
        ``[B, H_q, Q, D]`` in the query's dtype.
    """

    name: str
    paged: bool  # single-token decode steps through page tables (`PagedCapable`)
    additive_mask: bool  # takes a single-token step's mask as a float bias

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor | CausalBias | None, *, scaling: float, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...


@runtime_checkable
class PagedCapable(Protocol):
    """The paged and graph capabilities of a backend declaring ``paged = True`` (their meaning:
    [`PagedBackend`][sparsecorr.decoding.backends.paged.PagedBackend]): ``begin_step`` plans a
    single-token step's page tables once for every layer, ``decode`` runs one layer of it,
    ``enable_graph`` gives the kernels fixed table buffers for a CUDA graph of ``batch`` rows and
    ``reset_graph`` goes back to eager kernels (after a failed capture, and when the engine closes)."""

    def begin_step(self, **plan) -> None: ...

    def decode(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, **kw) -> torch.Tensor: ...

    def enable_graph(self, **shape) -> None: ...

    def reset_graph(self) -> None: ...


_PAGED_METHODS = ("begin_step", "decode", "enable_graph", "reset_graph")


class DeclaredBackend:
    """A user's backend object that declares neither ``paged`` nor ``additive_mask``, seen as a
    plain one: not paged, boolean masks. ``name`` and ``attend`` are the object's."""

    paged = False
    additive_mask = False

    def __init__(self, backend) -> None:
        self.backend = backend
        self.name = getattr(backend, "name", type(backend).__name__)

    def attend(self, *args, **kwargs):
        return self.backend.attend(*args, **kwargs)


def check_backend(backend) -> AttentionBackend:
    """A backend object with its capabilities declared, checked once (`select_backend` and the
    engine call it; no step probes the backend afterwards).

    - An object declaring both ``paged`` and ``additive_mask`` (bools) is returned as is; with
      ``paged = True`` it must have `PagedCapable`'s methods.
    - An object declaring neither (only ``attend``, and ``name`` if it likes) is accepted as a
      non-paged backend taking boolean masks, wrapped in `DeclaredBackend`.
    - Anything else raises ``ValueError`` naming ``backend``: no callable ``attend``, one of the
      two flags declared without the other, a flag that is not a bool, or ``paged = True``
      without the paged methods.
    """
    if not callable(getattr(backend, "attend", None)):
        raise ValueError(f"backend: expected a backend name or an object with an attend method, "
                         f"got {type(backend).__name__} without one")
    has = [hasattr(backend, f) for f in ("paged", "additive_mask")]
    if not any(has):
        return DeclaredBackend(backend)
    if not all(has):
        missing = "paged" if not has[0] else "additive_mask"
        raise ValueError(f"backend: expected both paged and additive_mask declared (or neither: a plain "
                         f"backend), got {type(backend).__name__} without {missing}")
    for flag in ("paged", "additive_mask"):
        value = getattr(backend, flag)
        if not isinstance(value, bool):
            raise ValueError(f"backend: expected {flag} to be a bool, got {value!r} on {type(backend).__name__}")
    if backend.paged and not isinstance(backend, PagedCapable):
        missing = [m for m in _PAGED_METHODS if not callable(getattr(backend, m, None))]
        raise ValueError(f"backend: declares paged = True, so expected the methods {list(_PAGED_METHODS)}, "
                         f"got {type(backend).__name__} without {missing}")
    return backend
