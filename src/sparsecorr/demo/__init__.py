"""The end-to-end demo behind ``sparsecorr demo``: calibrate -> fit -> three GRPO arms -> report."""

from .run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
