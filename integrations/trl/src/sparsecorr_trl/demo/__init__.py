"""The end-to-end demo behind ``sparsecorr demo``: calibrate -> fit -> GRPO arms (sampler x correction, x seeds) -> report.

It trains with [`SparseGRPOTrainer`][sparsecorr_trl.SparseGRPOTrainer], so it ships with the TRL
glue (``pip install 'sparsecorr[demo]'``); the ``sparsecorr`` CLI finds its subcommand
(``sparsecorr_trl.demo.command``) through the ``sparsecorr.commands`` entry point. Importing
this package is cheap: ``DemoConfig`` and ``run_demo`` load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DemoConfig", "run_demo"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module 'sparsecorr_trl.demo' has no attribute {name!r}")
