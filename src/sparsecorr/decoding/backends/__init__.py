"""Decoding backends: ``torch`` (SDPA, model dtype), ``reference`` (float32 oracle) and
``flashinfer`` (GPU paged decode, lazily imported)."""

from __future__ import annotations

import warnings

import torch

from .base import AttentionBackend
from .paged import PagedBackend, ReferenceDecodeKernel
from .torch_ref import ReferenceBackend, TorchBackend

__all__ = [
    "AttentionBackend",
    "PagedBackend",
    "ReferenceBackend",
    "ReferenceDecodeKernel",
    "TorchBackend",
    "choose_backend",
    "get_backend",
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


def get_backend(name: str | AttentionBackend = "auto", *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.bfloat16) -> AttentionBackend:
    """A backend by name for a model on ``device`` (an object with ``attend`` is returned as is).

    ``"auto"`` picks ``"flashinfer"`` on CUDA when ``flashinfer-python`` is installed and
    ``"torch"`` otherwise; if FlashInfer is installed but cannot be imported (a broken or
    partial install), ``"auto"`` falls back to ``"torch"`` and warns once, naming the error.
    ``"flashinfer"`` raises `BackendUnavailableError` saying what is missing (no CUDA, no
    package) rather than falling back silently.
    """
    if not isinstance(name, str) and hasattr(name, "attend"):
        return name
    from .flashinfer import flashinfer_status

    half = dtype in (torch.bfloat16, torch.float16)
    ok = torch.device(device).type == "cuda" and half and flashinfer_status()[0]
    resolved = choose_backend(name, device=device, flashinfer_ok=ok)
    if resolved == "torch":
        return TorchBackend()
    if resolved == "reference":
        return ReferenceBackend()
    from .flashinfer import BackendUnavailableError, flashinfer_backend

    if name == "auto":
        try:
            return flashinfer_backend()
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
            if msg not in _AUTO_WARNED:
                _AUTO_WARNED.add(msg)
                warnings.warn(f"backend='auto': FlashInfer is installed but failed to load ({msg}); "
                              "using backend='torch'", RuntimeWarning, stacklevel=2)
            return TorchBackend()
    backend = flashinfer_backend()  # raises when CUDA or the package is missing
    if torch.device(device).type != "cuda":
        raise BackendUnavailableError(f"backend='flashinfer': the model is on {device}; move it to a "
                                      "CUDA device or use backend='torch'")
    if not half:
        raise BackendUnavailableError(f"backend='flashinfer': its kernels take bf16 or fp16, the model is "
                                      f"{dtype}; use backend='torch'")
    return backend
