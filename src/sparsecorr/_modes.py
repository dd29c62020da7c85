"""Module-mode helper shared by the samplers, the demo and the pruning head."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run ``module`` in eval mode (no dropout, no gradient checkpointing) inside the block and
    restore its previous train/eval mode on exit, even if the block raises."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
