"""PRUNE: ARRoL online rollout pruning (Xu et al., ACL 2026, arXiv 2603.24840).

A quality head on the policy's hidden states predicts, at a detection length, whether each
partial rollout will end correct; a correctness-balanced fraction of each group survives and
is decoded further; at test time answers are combined by a vote weighted by the head.
"""

from .head import POOLINGS, QualityHead
from .keep import RULES, balanced_keep, expected_kept_variance
from .pruner import Pruner
from .trainer import QualityHeadTrainer, binary_auc, fit_temperature
from .vote import majority_vote, weighted_vote

__all__ = [
    "POOLINGS",
    "RULES",
    "Pruner",
    "QualityHead",
    "QualityHeadTrainer",
    "balanced_keep",
    "binary_auc",
    "expected_kept_variance",
    "fit_temperature",
    "majority_vote",
    "weighted_vote",
]
