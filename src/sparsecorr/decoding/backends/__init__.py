"""Decoding backends: ``torch`` (SDPA, model dtype), ``reference`` (float32 oracle) and
``flashinfer`` (GPU paged decode, lazily imported)."""

from __future__ import annotations

import warnings

import torch

from .base import AttentionBackend, DeclaredBackend, PagedCapable, check_backend
from .paged import PagedBackend, ReferenceDecodeKernel
from .torch_ref import ReferenceBackend, TorchBackend

__all__ = [
    "AttentionBackend",
    "DeclaredBackend",
    "PagedBackend",
    "PagedCapable",
    "ReferenceBackend",
    "ReferenceDecodeKernel",
    "TorchBackend",
    "check_backend",
    "choose_backend",
    "get_backend",
    "select_backend",
]

NAMES = ("auto", "torch", "reference", "flashinfer")
_AUTO_WARNED: set[str] = set()  # "auto" fallback messages already shown (warn once per error)


def choose_backend(name: str, *, device: torch.device | str, flashinfer_ok: bool) -> str:
    """Resolve ``"auto"``: ``"flashinfer"`` for a CUDA model when FlashInfer can run (installed,
    and the model in bf16 / fp16), else ``"torch"``; any other name is returned as given (after
    checking it)."""
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"backend: expected one of {list(NAMES)} or a backend object, got {name!r}")
    if name != "auto":
        return name
    return "flashinfer" if torch.device(device).type == "cuda" and flashinfer_ok else "torch"


def _unsupported(dtype: torch.dtype, head_dim: int | None, group_size: int | None, sinks: bool,
                 softcap: float | None) -> str | None:
    """Why FlashInfer's kernels cannot run this model (``None``: they can); without ``head_dim``
    the shape is not checked."""
    from .flashinfer import dtype_unsupported, features_unsupported, flashinfer_supports

    if head_dim is None:  # no model shape given: the dtype and the attention features decide
        return dtype_unsupported(dtype) or features_unsupported(sinks=sinks, softcap=softcap)
    return flashinfer_supports(head_dim=head_dim, dtype=dtype, group_size=1 if group_size is None else group_size,
                               sinks=sinks, softcap=softcap)


def _auto(device: torch.device, dtype: torch.dtype, head_dim: int | None,
          group_size: int | None, sinks: bool, softcap: float | None) -> tuple[AttentionBackend, str]:
    """``"auto"``: FlashInfer where it can run and supports the model, else the torch backend
    with the reason in its label (bare ``"torch"`` off CUDA, where nothing needs saying)."""
    from .flashinfer import flashinfer_status

    if device.type != "cuda":
        return TorchBackend(), "torch"
    if not flashinfer_status()[0]:
        return TorchBackend(), "torch (auto: flashinfer-python is not installed)"
    why = _unsupported(dtype, head_dim, group_size, sinks, softcap)
    if why is not None:
        return TorchBackend(), f"torch (auto: {why})"
    from .flashinfer import flashinfer_backend

    try:
        return flashinfer_backend(), "flashinfer"
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
        if msg not in _AUTO_WARNED:
            _AUTO_WARNED.add(msg)
            warnings.warn(f"backend='auto': FlashInfer is installed but failed to load ({msg}); "
                          "using backend='torch'", RuntimeWarning, stacklevel=4)
        return TorchBackend(), f"torch (auto: FlashInfer failed to load: {msg})"


def _flashinfer(device: torch.device, dtype: torch.dtype, head_dim: int | None,
                group_size: int | None, sinks: bool, softcap: float | None) -> AttentionBackend:
    """``"flashinfer"`` asked for by name: never a silent fallback."""
    from .flashinfer import BackendUnavailableError, flashinfer_backend

    backend = flashinfer_backend()  # raises when CUDA or the package is missing
    if device.type != "cuda":
        raise BackendUnavailableError(f"backend='flashinfer': the model is on {device}; move it to a "
                                      "CUDA device or use backend='torch'")
    if dtype not in (torch.bfloat16, torch.float16):
        raise BackendUnavailableError(f"backend='flashinfer': its kernels take bf16 or fp16, the model is "
                                      f"{dtype}; use backend='torch'")
    why = _unsupported(dtype, head_dim, group_size, sinks, softcap)
    if why is not None:
        raise ValueError(f"backend='flashinfer': {why}; use backend='torch' (or 'auto')")
    return backend


def select_backend(name: str | AttentionBackend = "auto", *, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.bfloat16, head_dim: int | None = None,
                   group_size: int | None = None, sinks: bool = False,
                   softcap: float | None = None) -> tuple[AttentionBackend, str]:
    """A backend for a model on ``device`` and the label ``generate`` records in
    ``RolloutBatch.meta["backend"]``.

    ``"auto"`` picks ``"flashinfer"`` on CUDA where ``flashinfer-python`` is installed and its
    kernels support the model (`flashinfer_supports`: ``head_dim`` in 64 / 128 / 256, bf16 or
    fp16, any GQA ``group_size``; learned ``sinks`` (GPT-OSS) and a positive ``softcap`` (Gemma 2)
    are computed on both paths, so they do not send ``"auto"`` to torch), else ``"torch"``; on CUDA the label then says why, e.g.
    ``"torch (auto: FlashInfer does not support head_dim 16 (its kernels are built for 64, 128,
    256))"`` (off CUDA it is the bare ``"torch"``). If FlashInfer is installed but cannot be
    imported (a broken or partial install), ``"auto"`` falls back to ``"torch"`` and warns once,
    naming the error. ``"flashinfer"`` raises `BackendUnavailableError` saying what is missing (no
    CUDA, no package, not bf16 / fp16) and `ValueError` for a ``head_dim`` or ``group_size`` its
    kernels are not built for, rather than falling back. Without ``head_dim`` (a caller that does
    not know the model's shape) the shape is not checked. A backend object (anything with
    ``attend``) is checked once (`check_backend`: its declared ``paged`` / ``additive_mask``, the
    paged methods where ``paged``; one declaring neither is taken as a plain backend with boolean
    masks, `DeclaredBackend`) and returned, labelled by its ``name``; a ``ValueError`` naming
    ``backend`` says what a malformed one lacks.
    """
    if not isinstance(name, str) and hasattr(name, "attend"):
        back = check_backend(name)
        return back, getattr(back, "name", type(back).__name__)
    dev = torch.device(device)
    resolved = choose_backend(name, device=dev, flashinfer_ok=True)  # checks the name
    if name == "auto":
        return _auto(dev, dtype, head_dim, group_size, sinks, softcap)
    if resolved == "torch":
        return TorchBackend(), "torch"
    if resolved == "reference":
        return ReferenceBackend(), "reference"
    backend = _flashinfer(dev, dtype, head_dim, group_size, sinks, softcap)
    return backend, backend.name


def get_backend(name: str | AttentionBackend = "auto", *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.bfloat16, head_dim: int | None = None,
                group_size: int | None = None, sinks: bool = False,
                softcap: float | None = None) -> AttentionBackend:
    """A backend by name for a model on ``device`` (an object with ``attend`` is returned as is):
    `select_backend` without the label."""
    return select_backend(name, device=device, dtype=dtype, head_dim=head_dim, group_size=group_size,
                          sinks=sinks, softcap=softcap)[0]
