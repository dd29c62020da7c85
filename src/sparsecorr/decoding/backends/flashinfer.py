"""FlashInfer decode backend (GPU). Imported lazily: never at ``import sparsecorr``.

The kept set of every (sequence, KV head) is expressed as a page table
(`sparsecorr.decoding.backends.paging`) over the engine's KV pool, whose per-layer
``[B, H_kv, C, D]`` buffer is a FlashInfer NHD page pool with one KV head per request.
``generate(..., backend="flashinfer")`` wraps `FlashInferDecode` in
[`PagedBackend`][sparsecorr.decoding.backends.paged.PagedBackend]: one ``plan`` per decode step
shared by all layers, per-layer page ids written into the planned table (BlockTopK), and
``use_tensor_cores`` switched on for GQA group sizes FlashInfer's CUDA-core decode kernels do
not specialise (e.g. 7), as FlashInfer recommends.

Status: the page tables, the plan/run protocol and the engine's use of them are tested on CPU
with the float32 paged oracle standing in for the kernel; the kernel itself needs a CUDA GPU
and the ``flashinfer-python`` package and is exercised by ``tests/gpu/`` (marker ``gpu``).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from types import ModuleType

import torch

from .paging import PageTable

__all__ = [
    "FLASHINFER_DTYPES",
    "FLASHINFER_HEAD_DIMS",
    "INSTALL_HINT",
    "BackendUnavailableError",
    "FlashInferDecode",
    "dtype_unsupported",
    "features_unsupported",
    "flashinfer_backend",
    "flashinfer_status",
    "flashinfer_supports",
    "float_workspace",
    "needs_tensor_cores",
    "require_flashinfer",
]

INSTALL_HINT = "pip install 'sparsecorr[flashinfer]'"
_CUDA_CORE_GROUP_SIZES = (1, 2, 4, 8)
# What FlashInfer builds its paged decode / prefill kernels for, read from its source
# (flashinfer-ai/flashinfer): the head dims of its AOT build (``flashinfer/aot.py``,
# ``get_default_config``: ``fa2_head_dim`` (64, 64), (128, 128), (256, 256); head_dim 512 is left
# out of the prebuilt kernels) and of the ``DISPATCH_HEAD_DIM`` switch of
# ``include/flashinfer/utils.cuh`` that the merge-states kernel of a split-KV decode goes through
# (the 0.7.2 wheel of the ``flashinfer`` extra raises "Unsupported head_dim: 16" there); and its
# 16-bit dtypes (``f16_dtype``: float16, bfloat16; the fp8 KV variants are not used here).
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}


def float_workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    """FlashInfer's zeroed float workspace for ``device``: allocated once per (device, size) and
    shared by every wrapper in the process (scratch of one kernel at a time on one stream: the
    wrappers of a decode run one after another, as SGLang shares one buffer between its
    wrappers), so a ``generate`` call allocates no 128 MiB workspace of its own."""
    key = (torch.device(device), int(nbytes))
    buf = _WORKSPACES.get(key)
    if buf is None:
        buf = _WORKSPACES[key] = torch.zeros(nbytes, dtype=torch.uint8, device=key[0])  # "must be zeroed"
    return buf


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


def dtype_unsupported(dtype: torch.dtype) -> str | None:
    """``None`` for a dtype FlashInfer's kernels take (`FLASHINFER_DTYPES`), else the reason."""
    if dtype in FLASHINFER_DTYPES:
        return None
    return f"FlashInfer does not support dtype {dtype} (its kernels take torch.bfloat16 or torch.float16)"


def flashinfer_supports(*, head_dim: int, dtype: torch.dtype, group_size: int, sinks: bool = False,
                        softcap: float | None = None) -> str | None:
    """Whether FlashInfer's paged decode kernels are built for a model of this shape: ``None`` if
    they are, else the reason, naming the field, what FlashInfer takes and what was given.

    ``head_dim`` must be one of `FLASHINFER_HEAD_DIMS`, ``dtype`` one of `FLASHINFER_DTYPES`;
    any positive GQA ``group_size`` runs (sizes without a CUDA-core decode kernel take the
    tensor-core one, `needs_tensor_cores`). Learned ``sinks`` (GPT-OSS) run through the LSE the
    kernels return (`sparsecorr.decoding.backends.paged.apply_sinks`) and a positive ``softcap``
    (Gemma 2) through their ``logits_soft_cap``, on both the CUDA-core and the tensor-core
    kernel; prefill and teacher-forced chunks run through SDPA's backend, which computes both.
    A ``softcap`` FlashInfer cannot take (``<= 0``, which it reads as "off"; not a finite
    number) is refused. A pure check of the request: it imports nothing and does not look at
    the device.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim not in FLASHINFER_HEAD_DIMS:
        dims = ", ".join(map(str, FLASHINFER_HEAD_DIMS))
        return f"FlashInfer does not support head_dim {head_dim!r} (its kernels are built for {dims})"
    if dtype_unsupported(dtype):
        return dtype_unsupported(dtype)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        return (f"FlashInfer does not support group_size {group_size!r} (query heads per KV head: "
                "a positive int)")
    return features_unsupported(sinks=sinks, softcap=softcap)


def features_unsupported(*, sinks: bool = False, softcap: float | None = None) -> str | None:
    """``None`` where FlashInfer's decode path computes the model's attention variants (learned
    ``sinks`` through the LSE, a positive ``softcap`` as ``logits_soft_cap``), else the reason."""
    if not isinstance(sinks, bool):
        return f"FlashInfer does not support sinks={sinks!r} (whether the model has learned sinks: a bool)"
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        return f"FlashInfer does not support softcap {softcap!r} (its logits_soft_cap: a positive float)"
    return None


def needs_tensor_cores(group_size: int) -> bool:
    """True for GQA group sizes without a CUDA-core decode kernel (use the tensor-core path)."""
    return group_size not in _CUDA_CORE_GROUP_SIZES


class FlashInferDecode:
    """Batched paged-KV decode attention over per-(sequence, KV head) requests.

    Args:
        device: a CUDA device.
        group_size: query heads per KV head (GQA group, e.g. 7 for 28/4).
        head_dim: head dimension (64, 128 or 256: `flashinfer_supports`).
        workspace_bytes: FlashInfer's float workspace (128 MiB default, as its examples); one per
            device and size, shared by every instance (`float_workspace`).
        use_tensor_cores: force the tensor-core kernel; default: `needs_tensor_cores`.
        graph_buffers: ``(indptr [R + 1], indices [>= nnz], last_page_len [R])`` int32 device
            buffers for CUDA-graph mode (fixed R; ``plan`` copies each table into them).

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
        graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        flashinfer = require_flashinfer()
        self.device = torch.device(device)
        self.group_size, self.head_dim = group_size, head_dim
        tc = needs_tensor_cores(group_size) if use_tensor_cores is None else use_tensor_cores
        workspace = float_workspace(self.device, workspace_bytes)
        graph = {}
        if graph_buffers is not None:  # fixed indptr / indices / last_page_len: CUDA-graph mode
            graph = dict(use_cuda_graph=True, paged_kv_indptr_buffer=graph_buffers[0],
                         paged_kv_indices_buffer=graph_buffers[1], paged_kv_last_page_len_buffer=graph_buffers[2])
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tc, **graph
        )
        self.use_tensor_cores = tc
        self._fence: torch.cuda.Event | None = None  # recorded after each plan (see `plan`)

    def plan(self, table: PageTable, *, dtype: torch.dtype, scale: float | None = None,
             softcap: float | None = None) -> None:
        """Plan one decode step for ``table`` (call once per step; reused by every layer).

        ``softcap`` is FlashInfer's ``logits_soft_cap``: its kernels compute
        ``c * tanh(sm_scale * q.k / c)`` (``include/flashinfer/attention/variants.cuh``,
        ``DefaultAttention``: the pre-tanh scale is ``sm_scale / logits_soft_cap``), Gemma 2's
        soft-capping; ``None`` (FlashInfer's 0.0) plans the kernel without it.

        ``indptr`` and ``last_page_len`` go to FlashInfer on the host (CPU int32): it reads them
        there and copies them to the device without blocking (given device tensors, it would copy
        them back, a sync each). Its ``plan`` then stages the plan in a page-locked host buffer and
        copies it asynchronously, so before rewriting that buffer the host waits for the previous
        plan's copy: one event fence per plan, the only host wait of a step.
        """
        if self._fence is not None:
            self._fence.synchronize()
        self._wrapper.plan(
            table.indptr.cpu(),
            table.indices.to(self.device, non_blocking=True),
            table.last_page_len.cpu(),
            self.group_size,  # query heads per request
            1,  # one KV head per request
            self.head_dim,
            table.page_size,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=scale if scale is not None else self.head_dim**-0.5,
            logits_soft_cap=softcap,
        )
        self._fence = torch.cuda.Event()
        self._fence.record()

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *, return_lse: bool = True):
        """Attention of ``q`` over the planned pages: ``(out, lse)`` with the LSE converted to
        natural log, or ``out`` alone with ``return_lse=False`` (no LSE computed).

        FlashInfer's LSE is base 2: its softmax state keeps ``m + log2(d)`` over logits scaled by
        ``log2(e)`` (``include/flashinfer/attention/state.cuh``, ``get_lse``; ``variants.cuh``,
        ``sm_scale_log2``), so it is multiplied by ``ln 2`` here. No ``sinks`` are passed to
        FlashInfer: its FA2 decode kernels do not read them (0.7.2: only the trtllm-gen, cuDNN
        and CuTe-DSL decode backends do); the paged backend rescales by the LSE instead
        (`sparsecorr.decoding.backends.paged.apply_sinks`)."""
        kv = (k_pool.unsqueeze(2), v_pool.unsqueeze(2))  # NHD pages: [P, page_size, 1, D]
        if not return_lse:
            return self._wrapper.run(q, kv, return_lse=False)
        out, lse2 = self._wrapper.run(q, kv, return_lse=True)
        return out, lse2.float() * math.log(2.0)


def flashinfer_backend():
    """The ``backend="flashinfer"`` decoding backend: FlashInfer paged decode kernels for
    single-token steps, SDPA for prefill and teacher-forced chunks. Raises
    `BackendUnavailableError` saying what is missing."""
    from .paged import PagedBackend

    require_flashinfer()
    return PagedBackend(FlashInferDecode, name="flashinfer")
