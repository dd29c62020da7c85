"""Decoding backends: ``torch`` (reference, CPU/GPU) and ``flashinfer`` (GPU, lazily imported)."""

from __future__ import annotations

from .base import AttentionBackend
from .torch_ref import TorchRefBackend

__all__ = ["AttentionBackend", "TorchRefBackend", "get_backend"]


def get_backend(name: str = "auto") -> AttentionBackend:
    """``"torch"`` -> the reference backend. ``"flashinfer"`` -> raises with what is missing
    (the FlashInfer decode path is not wired into ``generate`` yet; see the FlashInfer guide).
    ``"auto"`` -> ``torch`` until then."""
    if name in ("auto", "torch"):
        return TorchRefBackend()
    if name == "flashinfer":
        from .flashinfer import BackendUnavailableError, require_flashinfer

        require_flashinfer()  # says whether CUDA or the package is missing
        raise BackendUnavailableError(
            "backend='flashinfer': the FlashInfer kernels are available but not yet wired into "
            "generate(); use backend='torch'"
        )
    raise ValueError(f"backend: expected 'auto', 'torch' or 'flashinfer', got {name!r}")
