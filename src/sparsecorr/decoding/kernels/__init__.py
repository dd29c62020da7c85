"""The engine's fused ops: each a custom op whose kernel is the stock chain of aten ops on every
device and one Triton kernel on CUDA, with the fallback they share.

| op | module | stock chain | CUDA kernel |
|---|---|---|---|
| ``sparsecorr::write_kv`` | `kv_write` | two ``scatter_`` (K, V) | one Triton kernel per layer |
| ``sparsecorr::window_votes`` | `votes` | bias add, softmax, weighted sum | one Triton kernel per event |

Where Triton is missing or a kernel fails where it runs, `fused_or_stock` (`fallback`) warns
once and runs the stock chain from then on, which gives the same values.
"""

from __future__ import annotations

from .fallback import fused_or_stock
from .kv_write import write_kv, write_kv_reference, write_kv_triton
from .votes import votes_reference, votes_triton, window_votes

__all__ = [
    "fused_or_stock", "votes_reference", "votes_triton", "window_votes", "write_kv", "write_kv_reference",
    "write_kv_triton",
]
