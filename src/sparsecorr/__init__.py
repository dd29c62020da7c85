"""sparsecorr: measure, correct and plan sparse rollouts for LLM RL with verifiable rewards.

The stable API is re-exported flat here; each layer can also be imported on its own
(``sparsecorr.mismatch``, ``sparsecorr.correction``, ``sparsecorr.losses``,
``sparsecorr.decoding``, ``sparsecorr.pruning``). The decoding names are loaded lazily on first
use, because they import transformers (seconds), so ``import sparsecorr`` stays fast.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("sparsecorr")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+unknown"

from . import correction, losses, mismatch, pruning
from .correction import *  # noqa: F403
from .losses import *  # noqa: F403
from .mismatch import *  # noqa: F403
from .pruning import *  # noqa: F403

_LAZY = {name: "sparsecorr.decoding" for name in (
    "generate", "teacher_forced_logprobs", "RolloutBatch", "Dense", "StreamingLLM", "SnapKV",
    "RKV", "BlockTopK", "KVPolicy", "get_policy")}
_LAZY["decoding"] = "sparsecorr"


def __getattr__(name: str) -> Any:
    if name == "decoding":
        return importlib.import_module("sparsecorr.decoding")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sparsecorr' has no attribute {name!r}")


__all__ = [
    "__version__",
    "correction",
    "decoding",  # noqa: F405 (lazy, see __getattr__)
    "losses",
    "mismatch",
    "pruning",
    *mismatch.__all__,
    *correction.__all__,
    *losses.__all__,
    *pruning.__all__,
    *sorted(k for k in _LAZY if k != "decoding"),
]
