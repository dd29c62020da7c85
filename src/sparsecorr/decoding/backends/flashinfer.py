"""FlashInfer decode backend (GPU). Imported lazily: never at ``import sparsecorr``.

The kept set of every (sequence, KV head) is expressed as a page table
(`sparsecorr.decoding.backends.paging`): page size 1 for token-level eviction policies,
16 for BlockTopK. One `FlashInferDecode.plan` per decode step is shared by every layer
(the kept sets of all layers have the same lengths after a compression event), and
``use_tensor_cores`` is switched on for GQA group sizes FlashInfer's CUDA-core decode kernels do
not specialise (e.g. 7), as FlashInfer recommends.

Status: the page-table construction, availability checks and error messages are tested on CPU;
the kernel wrapper below needs a CUDA GPU and the ``flashinfer-python`` package and is
exercised by ``tests/gpu/`` (marker ``gpu``) on such a machine only.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from types import ModuleType

import torch

from .paging import PageTable

__all__ = [
    "INSTALL_HINT",
    "BackendUnavailableError",
    "FlashInferDecode",
    "flashinfer_status",
    "needs_tensor_cores",
    "require_flashinfer",
]

INSTALL_HINT = "pip install 'sparsecorr[flashinfer]'"
_CUDA_CORE_GROUP_SIZES = (1, 2, 4, 8)


class BackendUnavailableError(RuntimeError):
    """The requested decoding backend cannot run here (the message says what is missing)."""


def flashinfer_status() -> tuple[bool, str]:
    """``(available, reason)``: whether the FlashInfer backend can run in this process."""
    if not torch.cuda.is_available():
        return False, (
            "backend='flashinfer' needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use backend='torch' on CPU"
        )
    if importlib.util.find_spec("flashinfer") is None:
        return False, (
            "backend='flashinfer' needs the flashinfer-python package, which is not installed: "
            f"{INSTALL_HINT}"
        )
    return True, "ok"


def require_flashinfer() -> ModuleType:
    """Import and return ``flashinfer``, or raise `BackendUnavailableError` saying why."""
    ok, reason = flashinfer_status()
    if not ok:
        raise BackendUnavailableError(reason)
    return importlib.import_module("flashinfer")


def needs_tensor_cores(group_size: int) -> bool:
    """True for GQA group sizes without a CUDA-core decode kernel (use the tensor-core path)."""
    return group_size not in _CUDA_CORE_GROUP_SIZES


class FlashInferDecode:
    """Batched paged-KV decode attention over per-(sequence, KV head) requests.

    Args:
        device: a CUDA device.
        group_size: query heads per KV head (GQA group, e.g. 7 for 28/4).
        head_dim: head dimension (64 or 128).
        workspace_bytes: FlashInfer's float workspace (128 MiB default, as its examples).
        use_tensor_cores: force the tensor-core kernel; default: `needs_tensor_cores`.

    Shapes:
        run(q ``[R, G, D]``, k_pool/v_pool ``[P, page_size, D]``) -> out ``[R, G, D]``,
        lse ``[R, G]`` (natural log, float32), with R = B · H_kv requests.
    """

    def __init__(
        self,
        *,
        device: torch.device | str,
        group_size: int,
        head_dim: int,
        workspace_bytes: int = 128 * 1024 * 1024,
        use_tensor_cores: bool | None = None,
    ) -> None:
        flashinfer = require_flashinfer()
        self.device = torch.device(device)
        self.group_size, self.head_dim = group_size, head_dim
        tc = needs_tensor_cores(group_size) if use_tensor_cores is None else use_tensor_cores
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tc
        )
        self.use_tensor_cores = tc

    def plan(self, table: PageTable, *, dtype: torch.dtype, scale: float | None = None) -> None:
        """Plan one decode step for ``table`` (call once per step; reused by every layer)."""
        self._wrapper.plan(
            table.indptr.to(self.device),
            table.indices.to(self.device),
            table.last_page_len.to(self.device),
            self.group_size,  # query heads per request
            1,  # one KV head per request
            self.head_dim,
            table.page_size,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=scale if scale is not None else self.head_dim**-0.5,
        )

    def run(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q`` over the planned pages; LSE converted to natural log."""
        kv = (k_pool.unsqueeze(2), v_pool.unsqueeze(2))  # NHD pages: [P, page_size, 1, D]
        out, lse2 = self._wrapper.run(q, kv, return_lse=True)
        return out, lse2.float() * math.log(2.0)
