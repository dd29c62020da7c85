"""The engine thread of ``rollout.name=sparsecorr``: `sparsecorr.decoding.driver.EngineDriver`,
shared with OpenRLHF's sparse rollout actor (this module keeps its old import path)."""

from __future__ import annotations

from sparsecorr.decoding.driver import EngineDriver, aborted_output

__all__ = ["EngineDriver", "aborted_output"]
