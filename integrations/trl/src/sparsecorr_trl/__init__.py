"""TRL ``GRPOTrainer`` integration for sparsecorr (``pip install 'sparsecorr[trl]'``).

The names below load on first use (PEP 562), so importing a submodule that does not need TRL
(``sparsecorr_trl.demo.command``, which the ``sparsecorr`` CLI discovers through its
``sparsecorr.commands`` entry point) does not import TRL.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> submodule that defines it
_EXPORTS = {
    "SparseCorrCallback": "sparsecorr_trl.callback",
    "SparseCorrConfig": "sparsecorr_trl.config",
    "AGGREGATION_BY_LOSS_TYPE": "sparsecorr_trl.loss",
    "check_trl_version": "sparsecorr_trl.options",
    "validate_grpo_args": "sparsecorr_trl.options",
    "SparseGRPOTrainer": "sparsecorr_trl.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sparsecorr_trl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
