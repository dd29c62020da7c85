"""sparsecorr: measure, correct and plan sparse rollouts for LLM RL with verifiable rewards.

The stable API is re-exported flat here; each layer can also be imported on its own
(``sparsecorr.mismatch``, ``sparsecorr.correction``, ``sparsecorr.losses``, ...).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sparsecorr")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+unknown"

from . import mismatch
from .mismatch import *  # noqa: F403

__all__ = ["__version__", "mismatch", *mismatch.__all__]
